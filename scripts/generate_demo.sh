#!/usr/bin/env bash
# Continue the prompts of examples/prompts.txt with the tiny GPT the demo trained and saved
# (bash scripts/demo.sh --save outputs/demo-ckpt), on a CPU with context parallelism 4 as a
# 2 x 2 mesh: prefill through the mesh, the KV cache cut over the 4 ranks. Prints each
# continuation; outputs/generated.jsonl keeps ids and log-probabilities. Extra arguments
# pass to the command (e.g. --temperature 0.8 --seed 3, --mesh-shape 2x1x2).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export OMP_NUM_THREADS=1
"$PY" -m torch.distributed.run --standalone --nproc-per-node 4 -m megatron_mesh.generate \
  --config configs/tiny-cpu.yaml --load outputs/demo-ckpt --prompts-file examples/prompts.txt \
  --max-new-tokens 16 --context-parallel-size 4 --cp-comm-type mesh --mesh-shape 2x2 \
  --output outputs/generated.jsonl "$@"
"$PY" - <<'PY'
import json
for line in open("outputs/generated.jsonl"):
    r = json.loads(line)
    print(" ".join(map(str, r["prompt_ids"])), "->", r.get("text"))
PY
