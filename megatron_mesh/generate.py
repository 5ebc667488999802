"""Generate from a checkpoint of the pretraining driver, with mesh context parallelism.

    torchrun --nproc-per-node 4 -m megatron_mesh.generate --config configs/tiny-cpu.yaml \\
        --load ckpt --prompt-ids-file prompts.json --max-new-tokens 32 \\
        --context-parallel-size 4 --cp-comm-type mesh --mesh-shape 2x2 --output out.jsonl

Greedy unless --temperature / --top-k / --top-p; docs/inference.md describes the design.
The model flags left out are the checkpoint's. Bad input (flags, prompts, a model flag that
differs from the checkpoint's) exits 2 with one line, before any collective. The command
lives with the rest of generation, in megatron_mesh/inference/megatron/command.py.
"""
from __future__ import annotations

import sys

from megatron_mesh.training.job.console import quiet_library_warnings

quiet_library_warnings()  # the driver's set: megatron-core's notes to its own developers

from megatron_mesh.inference.megatron.command import main  # noqa: E402  (megatron-core in main)

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
