"""Pretrain a GPT model on megatron-core, with mesh context parallelism.

    torchrun --nproc-per-node 8 -m megatron_mesh.pretrain_gpt --config configs/gpt3-1.3b.yaml \\
        --context-parallel-size 8 --context-parallel-algo mesh --mesh-shape 2x4 --bf16

``--help`` lists the flags; docs/training.md describes the driver.
"""
from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Sequence

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed")
warnings.filterwarnings("ignore", message="full scope is deprecated")

EXTRA_MODULES = ("megatron", "yaml", "psutil")  # what the 'megatron' extra installs


def _log_to_stdout() -> None:
    """megatron_mesh's INFO lines (the mesh shape chosen, the grid built) on global rank 0."""
    logger = logging.getLogger("megatron_mesh")
    if os.environ.get("RANK", "0") != "0" or logger.handlers:
        return
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(" %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def _error(message: str) -> None:
    """One line on stderr in one write: the ranks of a job share one output, and print's
    separate newline let two ranks' lines run together."""
    sys.stderr.write(f"pretrain_gpt: error: {message}\n")
    sys.stderr.flush()


def _flag_error(message: str) -> None:
    """A flag error, on the first local rank only: the checks read only the command line,
    the environment and the node's files, so every rank of a node finds the same error, and
    printing it once per rank repeated it P times before the launcher's own report."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        _error(message)


def main(argv: Sequence[str] | None = None) -> int:
    _log_to_stdout()
    try:
        from megatron_mesh.training.arguments import ConfigError, parse_args
    except ModuleNotFoundError as e:  # --help too: the flags are megatron-core's
        if (e.name or "").split(".")[0] not in EXTRA_MODULES:
            raise
        _flag_error(f"the driver needs the 'megatron' extra (no module named {e.name!r}): "
                    "pip install 'megatron-mesh[megatron]'")
        return 2
    try:
        args = parse_args(argv)
    except ConfigError as e:
        _flag_error(str(e))
        return 2
    from megatron_mesh.training.checksums import CheckpointError
    from megatron_mesh.training.run import run
    from megatron_mesh.training.save_failure import SaveError
    from megatron_mesh.training.stopping import NonFiniteError

    try:
        return run(args)
    except CheckpointError as e:  # a checkpoint that cannot be used: nothing trained yet
        _error(str(e))
        return 2
    except (NonFiniteError, SaveError) as e:  # stopped; what was saved before is intact
        _error(str(e))
        return 1


if __name__ == "__main__":
    sys.exit(main())
