#!/usr/bin/env bash
# Set up (virtualenv + pinned dependencies) and run the whole test suite: the linter and the type
# checker (their settings and paths in pyproject.toml), every test on SQLite, then the tests that
# use the database again on PostgreSQL (--database-only: tests/conftest.py). With arguments:
# pytest with those, no lint, types or PostgreSQL pass.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh dev

if [ $# -eq 0 ]; then  # seconds each, before minutes of tests; a finding fails the run
  echo "== ruff, mypy =="
  ruff check .
  mypy
fi

if [ "${ENSURE_SERVICES:-1}" = "1" ]; then  # PostgreSQL and Redis for the database tests
  scripts/services.sh
fi

# The browser tests drive Debian's chromium (never a downloaded browser build).
if ! [ -x /usr/bin/chromium ]; then
  echo "installing chromium for the browser tests"
  apt-get update -qq && apt-get install -y -qq chromium >/dev/null
fi

# The whole suite on TEST_WORKERS workers (pytest-xdist), a file to a worker: on 2 cores three keep
# both busy while one waits on a browser, a server or a subprocess (docs/perf-log/ci-time.md).
workers=(-n "${TEST_WORKERS:-3}" --dist loadfile)
if [ $# -eq 0 ]; then
  # The cold start, once: the engine's kernels compiled on every core into an empty cache, before
  # the workers need them. The cold-start test checks that cache as it was left; the suite runs on
  # a copy (var/test-numba-cache, kept between runs for what the tests compile beyond the engine's).
  rm -rf var/cold-start-cache
  python -m tests.cold_start var/cold-start-cache
  export COLD_START_CACHE="$PWD/var/cold-start-cache"
  mkdir -p var/test-numba-cache
  cp -a var/cold-start-cache/. var/test-numba-cache/
  export NUMBA_CACHE_DIR="$PWD/var/test-numba-cache"
fi
status=0
if [ $# -eq 0 ]; then
  python -m pytest "${workers[@]}" || status=$?
else
  python -m pytest "$@" || status=$?
fi
if [ "$status" -eq 0 ] && [ $# -eq 0 ]; then
  echo "== the tests that use the database, again on PostgreSQL =="
  DATABASE_URL="${PG_TEST_URL:-postgres://postgres@127.0.0.1:5432/postgres}" \
    python -m pytest "${workers[@]}" -p no:cacheprovider --database-only tests/history tests/server tests/fleet \
    || status=$?
fi
exit "$status"
