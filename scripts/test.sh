#!/usr/bin/env bash
# Set up (virtualenv + pinned dependencies) and run the whole test suite: the linter and the type
# checker (their settings and paths in pyproject.toml), every test on SQLite and, beside it, the
# tests that use the database again on PostgreSQL (--database-only: tests/conftest.py). With
# arguments: pytest with those, no lint, types or PostgreSQL pass.
set -euo pipefail
cd "$(dirname "$0")/.."

# The browser tests drive Debian's chromium (never a downloaded browser build), and the metrics and
# alert-rule tests Debian's promtool (the prometheus package); a machine without them installs them
# while the virtualenv is made, one apt-get after the other (they share dpkg's lock).
packages_install=""
install_promtool() {
  # promtool only: no recommends (the node exporter), and the Prometheus server the package's
  # postinst would start stays stopped: invoke-rc.d and deb-systemd-invoke ask policy-rc.d, and
  # its exit 101 says no. A policy-rc.d made here is removed again; one already there is kept.
  local policy=/usr/sbin/policy-rc.d made="" status=0
  if ! [ -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && made=1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus || status=$?
  [ -z "$made" ] || rm -f "$policy"
  return "$status"
}
if ! [ -x /usr/bin/chromium ] || ! command -v promtool >/dev/null; then
  echo "installing chromium (browser tests) and promtool (metrics tests) where missing, in the background"
  packages_log="$(mktemp)"
  (apt-get update -qq \
     && { [ -x /usr/bin/chromium ] || apt-get install -y -qq chromium; } \
     && { command -v promtool >/dev/null || install_promtool; }) >"$packages_log" 2>&1 &
  packages_install=$!
fi

source scripts/venv.sh dev
# Our own modules' bytecode, once, for the hundreds of processes the suite starts (where the
# environment sets PYTHONDONTWRITEBYTECODE each would compile them again).
python -m compileall -q -j 0 manage.py debugsite engines tests bench scripts >/dev/null

if [ $# -eq 0 ]; then  # seconds each, before minutes of tests; a finding fails the run
  echo "== ruff, mypy ($SECONDS s in) =="
  ruff check .
  mypy
fi

if [ -n "$packages_install" ] && ! wait "$packages_install"; then  # before services.sh's own apt-get
  cat "$packages_log" >&2
  exit 1
fi
if [ "${ENSURE_SERVICES:-1}" = "1" ]; then  # PostgreSQL and Redis for the database tests
  scripts/services.sh
fi

# The whole suite on TEST_WORKERS workers (pytest-xdist), a file to a worker: on 2 cores three keep
# both busy while one waits on a browser, a server or a subprocess (docs/perf-log/ci-time.md). The
# files go out in tests/conftest.py's order, slow ones first, not xdist's (by count of tests).
workers=(-n "${TEST_WORKERS:-3}" --dist loadfile --no-loadscope-reorder)
if [ $# -eq 0 ]; then
  # The cold start, once: the engine's kernels compiled on every core into an empty cache, before
  # the workers need them. The cold-start test checks that cache as it was left; the suite runs on
  # a copy (var/test-numba-cache, kept between runs for what the tests compile beyond the engine's).
  echo "== the cold start ($SECONDS s in) =="
  rm -rf var/cold-start-cache
  python -m tests.cold_start var/cold-start-cache
  export COLD_START_CACHE="$PWD/var/cold-start-cache"
  mkdir -p var/test-numba-cache
  cp -a var/cold-start-cache/. var/test-numba-cache/
  export NUMBA_CACHE_DIR="$PWD/var/test-numba-cache"
fi
status=0
if [ $# -gt 0 ]; then
  python -m pytest "$@" || status=$?
  exit "$status"
fi
# The tests that use the database run again on PostgreSQL, in one process beside the whole suite's
# workers: its ~50 CPU-seconds fill what the workers leave idle while they wait on browsers,
# servers and subprocesses, where after them it took ~50 s of its own (docs/perf-log/ci-time.md).
# Every test makes its own databases, fleets and ports, so the two passes never share one.
pg_log="var/test-postgresql.log"
DATABASE_URL="${PG_TEST_URL:-postgres://postgres@127.0.0.1:5432/postgres}" \
  python -m pytest -p no:cacheprovider --database-only tests/history tests/server tests/fleet >"$pg_log" 2>&1 &
pg_pass=$!
echo "== every test on SQLite, the PostgreSQL pass beside it into $pg_log ($SECONDS s in) =="
python -m pytest "${workers[@]}" || status=$?
pg_status=0
wait "$pg_pass" || pg_status=$?
echo "== the tests that use the database, on PostgreSQL ($SECONDS s in) =="
cat "$pg_log"
[ "$status" -ne 0 ] || status=$pg_status
exit "$status"
