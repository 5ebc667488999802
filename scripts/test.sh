#!/usr/bin/env bash
# Set up this checkout on a fresh machine and run the test suite (arguments go to pytest).
# Without arguments, the Megatron parts then run once more on megatron-core 0.19.x
# (scripts/test_mcore019.sh; MCORE019=0 skips that leg). Test files are shared out over
# TEST_WORKERS pytest processes (default 2; 0 runs them in this one): a file's tests stay
# together, so a job's fixtures are built once; most tests wait on gloo ranks (forked from
# each worker's preloaded server, tests/preloaded.py), so two workers keep two cores busy;
# files start in the order tests/conftest.py gives.
set -euo pipefail
source "$(dirname "$0")/setup.sh" dev
"$PY" -m ruff check .  # lint and import order (pyproject.toml)
"$PY" -m pytest -q -n "${TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
if [[ $# -eq 0 && ${MCORE019:-1} != 0 ]]; then
  bash scripts/test_mcore019.sh
fi
