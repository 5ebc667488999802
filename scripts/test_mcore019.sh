#!/usr/bin/env bash
# The Megatron parts of the suite on megatron-core 0.19.x: core attention, groups, layer
# specs, arguments, parity with CP = 1 (megatron-core and the driver), checkpoint
# interchange, the no-patch example in Megatron-LM core_v0.19.0 (arguments go to pytest).
# Creates, once, a second environment in .venv-mcore019/ (ignored by git) on top of the
# first one's packages (torch, wandb, pytest, triton; see setup.sh): megatron-core 0.19.2
# with what it needs beyond them, numpy<2.4 and triton. Its wheel says Python >= 3.12 but
# imports on 3.11, hence --ignore-requires-python. As in test.sh, a test may skip only
# because it needs a GPU.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${MCORE019_VENV:-.venv-mcore019}
MCORE=megatron-core==0.19.2
TESTS=(tests/unit/test_megatron_args.py tests/distributed/test_megatron_parity.py
       tests/distributed/test_checkpoint_interchange.py
       tests/distributed/test_document_masking.py  # --reset-attention-mask: packed documents
       # placed documents: PlacedSeqParams, RoPE at placed positions, the balanced driver (MLA too)
       tests/distributed/test_placed_rope.py tests/distributed/test_placed_training.py
       tests/distributed/test_megatron_window.py tests/distributed/test_megatron_mla.py
       # attention sinks (softmax_type) against megatron-core's own attention; the gpt-oss config
       tests/distributed/test_megatron_sinks.py tests/distributed/test_training_gpt_oss.py
       tests/distributed/test_moe_documents.py  # GPTModel's padding_mask for the MoE routers
       tests/unit/test_patches.py  # every patched name exists in this megatron-core
       # --multi-latent-attention: refused on 0.16 without TE, trained on 0.17+
       tests/unit/test_mla_flags.py tests/distributed/test_training_mla.py
       # the driver's jobs that differ by megatron-core version: CP = 1, a 2x2 mesh, a 3D grid, PP 2,
       # the distributed optimizer, sequence parallelism
       "tests/distributed/test_training_driver.py::test_mesh_2x2_matches_cp1_and_loss_falls"
       "tests/distributed/test_training_driver.py::test_mesh_traffic_and_wandb_series"
       "tests/distributed/test_training_driver.py::test_3d_grid_chosen_for_the_node_matches_cp1_and_is_logged_as_built"
       "tests/distributed/test_training_driver.py::test_pipeline_2_x_mesh_2_matches_cp1"
       "tests/distributed/test_training_driver.py::test_data_parallel_with_cp_and_distributed_optimizer_matches_cp1"
       "tests/distributed/test_training_driver.py::test_distributed_optimizer_resumes_on_fewer_ranks"
       "tests/distributed/test_training_driver.py::test_optimizer_state_of_another_kind_or_tp_is_refused_by_name"
       "tests/distributed/test_training_driver.py::test_checkpoint_of_the_old_torch_optimizer_is_refused_naming_it"
       "tests/distributed/test_training_driver.py::test_sequence_parallel_tp2_x_mesh_2_matches_cp1"
       # the loss across CP with masked tokens, validation, TensorBoard, the NullTokenizer's EOD
       tests/distributed/test_training_eval.py
       # Megatron-LM core_v0.19.0 with the no-patch example (test.sh runs the patch on core_v0.16.1)
       "tests/system/test_megatron_lm.py::test_no_patch_example_imports_and_adds_the_flags"
       "tests/system/test_megatron_lm.py::test_no_patch_example_trains_the_mesh_model_like_megatron_lm_s_own"
       "tests/system/test_megatron_lm.py::test_no_patch_example_attaches_a_builder_in_the_forward_step"
       tests/distributed/test_packed_masks.py)  # chunks and a builder's mask over THD documents
if ! "$VENV/bin/python" -c "import megatron.core, torch" 2>/dev/null; then
  "${PYTHON:-python3}" -m venv --system-site-packages "$VENV"
  "$VENV/bin/pip" install "numpy<2.4" triton
  "$VENV/bin/pip" install --no-deps --ignore-requires-python "$MCORE"
fi
if ! "$VENV/bin/python" -c "import xdist, einops" 2>/dev/null; then  # a given venv made before
  "$VENV/bin/pip" install "pytest-xdist>=3.6" einops six regex
fi
"$VENV/bin/python" -c "import megatron.core as m; print('megatron-core', m.__version__)"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1
export MESH_ALLOWED_SKIPS="needs a GPU"
MEGATRON_LM_DIR=$(bash scripts/megatron_lm_checkout.sh core_v0.19.0)
if [[ -z $MEGATRON_LM_DIR ]]; then
  echo "no Megatron-LM sources: the example's tests skip" >&2
  MESH_ALLOWED_SKIPS+=";no Megatron-LM checkout"
fi
export MEGATRON_LM_DIR
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider -n "${TEST_WORKERS:-2}" --dist loadfile \
  --no-loadscope-reorder \
  "${TESTS[@]}" "$@"
