"""Pretrain a GPT model on megatron-core, with mesh context parallelism.

    torchrun --nproc-per-node 8 -m megatron_mesh.pretrain_gpt --config configs/gpt3-1.3b.yaml \\
        --context-parallel-size 8 --context-parallel-algo mesh --mesh-shape 2x4 --bf16

``--help`` lists the flags; docs/training.md describes the driver.
"""
from __future__ import annotations

import sys
from typing import Sequence

from megatron_mesh.training.job.console import (
    error,
    flag_error,
    log_to_stdout,
    missing_extra,
    quiet_library_warnings,
)

quiet_library_warnings()

PROG = "pretrain_gpt"


def main(argv: Sequence[str] | None = None) -> int:
    log_to_stdout()
    try:
        from megatron_mesh.training.config.arguments import ConfigError, parse_args
    except ModuleNotFoundError as e:  # --help too: the flags are megatron-core's
        if not missing_extra(PROG, e):
            raise
        return 2
    try:
        args = parse_args(argv)
    except ConfigError as e:
        flag_error(PROG, str(e))
        return 2
    from megatron_mesh.megatron.mask_builder import MaskBuilderError
    from megatron_mesh.training.checkpoints.checksums import CheckpointError
    from megatron_mesh.training.checkpoints.save_failure import SaveError
    from megatron_mesh.training.loop.stopping import NonFiniteError
    from megatron_mesh.training.run import run

    try:
        return run(args)
    except CheckpointError as e:  # a checkpoint that cannot be used: nothing trained yet
        error(PROG, str(e))
        return 2
    except MaskBuilderError as e:  # every rank raises the same (agreed_mask): said once
        flag_error(PROG, str(e))
        return 2
    except (NonFiniteError, SaveError) as e:  # stopped; what was saved before is intact
        error(PROG, str(e))
        return 1


if __name__ == "__main__":
    sys.exit(main())
