"""What the commands (pretrain_gpt, generate) print before and around their run: the
package's INFO lines on global rank 0, and error lines, one write each.

Standard library only: a command prints its errors with it when the megatron extra is
missing too.
"""
from __future__ import annotations

import logging
import os
import sys
import time

# how long a rank that does not print a flag error waits before it exits: the launcher
# (torchrun) stops every rank at the first that ends, so the rank that prints goes first
FLAG_ERROR_GRACE_S = 2.0
EXTRA_MODULES = ("megatron", "yaml", "psutil")  # what the 'megatron' extra installs


def log_to_stdout() -> None:
    """megatron_mesh's INFO lines (the mesh shape chosen, the grid built) on global rank 0."""
    logger = logging.getLogger("megatron_mesh")
    if os.environ.get("RANK", "0") != "0" or logger.handlers:
        return
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(" %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def error(prog: str, message: str) -> None:
    """"<prog>: error: <message>", one line on stderr in one write: the ranks of a job share
    one output, and print's separate newline let two ranks' lines run together."""
    sys.stderr.write(f"{prog}: error: {message}\n")
    sys.stderr.flush()


def flag_error(prog: str, message: str) -> None:
    """A flag error, on the first local rank only: the checks read only the command line,
    the environment and the node's files, so every rank of a node finds the same error, and
    printing it once per rank repeated it P times before the launcher's own report. The other
    ranks wait `FLAG_ERROR_GRACE_S` first: had one of them ended before the first local rank
    wrote, the launcher could stop that rank with the line unwritten."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        error(prog, message)
    else:
        time.sleep(FLAG_ERROR_GRACE_S)


def missing_extra(prog: str, e: ModuleNotFoundError) -> bool:
    """Whether `e` is a module of the 'megatron' extra missing (then said once, as a flag
    error naming the extra); a command's flags are megatron-core's, --help included."""
    if (e.name or "").split(".")[0] not in EXTRA_MODULES:
        return False
    flag_error(prog, f"{prog} needs the 'megatron' extra (no module named {e.name!r}): "
               "pip install 'megatron-mesh[megatron]'")
    return True
