#!/usr/bin/env bash
# Set up (virtualenv + pinned runtime dependencies) and run the server with the demo engine,
# debug endpoints and tracing on. Extra arguments go to `manage.py serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
exec python manage.py serve --enable-debug --enable-tracing "$@"
