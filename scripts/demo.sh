#!/usr/bin/env bash
# Set up this checkout on a fresh machine and train the tiny GPT on a CPU with context
# parallelism 4 as a 2 x 2 mesh (4 gloo processes), printing loss and throughput as it goes.
# Extra arguments pass to the driver (e.g. --train-iters 200 --wandb-project demo).
# The setup (pip) runs only when something is missing (scripts/env_ready.py says what); it
# installs the extras the demo and the real-data walk-through of docs/training.md use
# (--wandb-project, --tensorboard-dir and `tensorboard --logdir`).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRAS=megatron,wandb,tensorboard
if "$PY" scripts/env_ready.py "$EXTRAS"; then
  export OMP_NUM_THREADS=1
else
  source scripts/setup.sh "$EXTRAS"
fi
exec "$PY" -m torch.distributed.run --standalone --nproc-per-node 4 -m megatron_mesh.pretrain_gpt \
  --config configs/tiny-cpu.yaml --context-parallel-size 4 --context-parallel-algo mesh \
  --mesh-shape 2x2 --train-iters 100 --log-interval 10 "$@"
