"""What the commands (pretrain_gpt, generate) print before and around their run: the
package's INFO lines on global rank 0, and error lines, one write each.

Standard library only: a command prints its errors with it when the megatron extra is
missing too.
"""
from __future__ import annotations

import hashlib
import logging
import os
import sys
import tempfile
import time
import warnings

EXTRA_MODULES = ("megatron", "yaml", "psutil")  # what the 'megatron' extra installs
# a rank that does not print a flag error waits for the printing rank's mark at most this
# long (that rank may have died of something else): the launcher (torchrun) stops every rank
# at the first that ends, so none may end before the line is written
FLAG_ERROR_WAIT_S = 60.0
# tests only: seconds the printing rank sleeps before it writes a flag error (a slow rank
# under load); unset in any real run
PRINT_DELAY_ENV = "MEGATRON_MESH_TEST_PRINT_DELAY_S"
LIBRARY_WARNINGS = (  # megatron-core's and torch's notes to their own developers
    r".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed",
    r"full scope is deprecated",
    r"`load_state_dict` is deprecated and will be removed",
    r"Please use DTensor instead and we are deprecating ShardedTensor",
)


def quiet_library_warnings() -> None:
    """Hide the warnings megatron-core and torch print on import, model build and checkpoint
    load that name nothing a user of the commands can change (one set for every command)."""
    for message in LIBRARY_WARNINGS:
        warnings.filterwarnings("ignore", message=message)


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


def _mark_path(prog: str) -> str:
    """Where the first local rank marks a flag error as printed: one name per job and node
    (the launcher's ids), in the node's temporary folder."""
    ids = [os.environ.get(k, "") for k in (
        "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "MASTER_ADDR", "MASTER_PORT",
        "GROUP_RANK", "SLURM_JOB_ID", "SLURM_STEP_ID")]
    key = "\0".join([*ids, prog])
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    return os.path.join(tempfile.gettempdir(), f"megatron-mesh-printed-{digest}")


def _remove_old_marks(age_s: float = 3600.0) -> None:
    """Remove the marks of flag errors printed more than `age_s` ago."""
    folder = tempfile.gettempdir()
    try:
        names = [n for n in os.listdir(folder) if n.startswith("megatron-mesh-printed-")]
    except OSError:
        return
    for name in names:
        path = os.path.join(folder, name)
        try:
            if os.stat(path).st_mtime < time.time() - age_s:
                os.remove(path)
        except OSError:
            pass


def _started() -> float:
    """When this process started (wall clock), from /proc; now where there is none."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def flag_error(prog: str, message: str) -> None:
    """A flag error, printed once per node: the checks read only the command line, the
    environment and the node's files, so every rank finds the same error. The first local
    rank writes the line, then marks it written (a file); the other local ranks return only
    after that mark (or `FLAG_ERROR_WAIT_S`): a launcher stops every rank once one ends, and
    a rank that ended first cost the line when the printing rank was slow."""
    mark = _mark_path(prog)
    if os.environ.get("LOCAL_RANK", "0") == "0":
        delay = os.environ.get(PRINT_DELAY_ENV)
        if delay:
            time.sleep(float(delay))
        error(prog, message)
        try:
            with open(mark, "w"):
                pass
            os.utime(mark)  # a mark of an earlier job with the same ids is renewed
        except OSError:
            pass  # the others wait out FLAG_ERROR_WAIT_S or the launcher
        _remove_old_marks()
        return
    since = _started() - 1.0  # a mark left by an earlier job of the same ids is older
    deadline = time.monotonic() + FLAG_ERROR_WAIT_S
    while time.monotonic() < deadline:
        try:
            if os.stat(mark).st_mtime >= since:
                return
        except OSError:
            pass
        time.sleep(0.05)


def missing_extra(prog: str, e: ModuleNotFoundError) -> bool:
    """Whether `e` is a module of the 'megatron' extra missing (then said once, as a flag
    error naming the extra); a command's flags are megatron-core's, --help included."""
    if (e.name or "").split(".")[0] not in EXTRA_MODULES:
        return False
    flag_error(prog, f"{prog} needs the 'megatron' extra (no module named {e.name!r}): "
               "pip install 'megatron-mesh[megatron]'")
    return True
