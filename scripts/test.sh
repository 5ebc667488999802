#!/usr/bin/env bash
# Set up this checkout on a fresh machine and run the test suite (arguments go to pytest).
# Without arguments, the Megatron parts then run once more on megatron-core 0.19.x
# (scripts/test_mcore019.sh; MCORE019=0 skips that leg). Test files are shared out over
# TEST_WORKERS pytest processes (default 2; 0 runs them in this one): a file's tests stay
# together, so a job's fixtures are built once; most tests wait on gloo ranks (forked from
# each worker's preloaded server, tests/preloaded.py), so two workers keep two cores busy;
# files start in the order tests/conftest.py gives. A test may skip only because it needs a
# GPU (MESH_ALLOWED_SKIPS, tests/conftest.py); any other skip fails the run. Megatron-LM's
# tests run on core_v0.16.1 (scripts/megatron_lm_checkout.sh unpacks it from
# MEGATRON_LM_SOURCES, default ../shared/megatron-lm); without those sources they skip.
set -euo pipefail
source "$(dirname "$0")/setup.sh" dev
"$PY" -m ruff check .  # lint and import order (pyproject.toml)
export MESH_ALLOWED_SKIPS="needs a GPU"
megatron_lm=$(bash scripts/megatron_lm_checkout.sh core_v0.16.1)
if [[ -z $megatron_lm ]]; then
  echo "no Megatron-LM sources: tests/system/test_megatron_lm.py skips" >&2
  MESH_ALLOWED_SKIPS+=";no Megatron-LM checkout"
fi
# the example's forward-step builder is core_v0.18+'s route: the second leg runs it
MEGATRON_LM_DIR=$megatron_lm "$PY" -m pytest -q -n "${TEST_WORKERS:-2}" --dist loadfile \
  --no-loadscope-reorder \
  --deselect tests/system/test_megatron_lm.py::test_no_patch_example_attaches_a_builder_in_the_forward_step \
  "$@"
if [[ $# -eq 0 && ${MCORE019:-1} != 0 ]]; then
  bash scripts/test_mcore019.sh
fi
