#!/usr/bin/env bash
# Set up this checkout on a fresh machine and run the test suite (arguments go to pytest).
set -euo pipefail
source "$(dirname "$0")/setup.sh" dev
exec "$PY" -m pytest -q "$@"
