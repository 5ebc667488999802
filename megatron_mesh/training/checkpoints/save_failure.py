"""A checkpoint save that fails (a full disk, a quota, an I/O error): stop every rank with
one line that names the folder, what went wrong and the checkpoint still intact.

A save runs in steps (`agreed`): each rank runs the step, then all ranks exchange whether it
failed, so a failure on one rank (rank 0 writes the folder, the manifest and the marker)
stops all of them with the same message instead of leaving the others in a collective.
"""
from __future__ import annotations

import errno
import os
import shutil
from typing import Callable

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

_FULL = (errno.ENOSPC, errno.EDQUOT)
_MIB = 1 << 20


class SaveError(RuntimeError):
    """A save that failed; the previous checkpoint is intact and the message says which."""


def disk_full(error: BaseException) -> bool:
    """Whether ENOSPC / EDQUOT is behind `error`: an OSError in its chain, or (megatron-core's
    writer processes report a failure as text) the error's text in its message or in a
    torch CheckpointException's per-rank failures."""
    texts = [os.strerror(n) for n in _FULL] + [f"[Errno {n}]" for n in _FULL]
    seen, stack = set(), [error]
    while stack:
        e = stack.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _FULL or any(t in str(e) for t in texts):
            return True
        stack += [x for x in (e.__cause__, e.__context__) if x is not None]
        for failure in (getattr(e, "failures", None) or {}).values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, BaseException):
                stack.append(inner)
    return False


def _first_line(error: BaseException) -> str:
    """The error's last non-empty line (a CheckpointException ends with the cause)."""
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    return (lines[-1] if lines else type(error).__name__)[:300]


def folder_bytes(path: str) -> int:
    """Bytes of the files under path (0 when it is not there)."""
    total = 0
    for parent, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(parent, name))
            except OSError:
                pass
    return total


def agreed(step: Callable[[], None]) -> str | None:
    """Run `step` on this rank; then every rank learns whether it failed on any rank.

    Returns None when it succeeded everywhere, else the failure ("full: ..." for a full disk,
    "error: ..." otherwise), the lowest failing rank's, on every rank."""
    outcome = None
    try:
        step()
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - reported on every rank
        outcome = ("full: " if disk_full(e) else "error: ") + _first_line(e)
    if dist.is_initialized() and dist.get_world_size() > 1:
        every: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(every, outcome)
        outcome = next((o for o in every if o), None)
    return outcome


def save_failed(root: str, iteration: int, tmp: str, outcome: str, previous: int | None,
                previous_bytes: int) -> SaveError:
    """The error of a failed save of `iteration` under `root` (the unfinished `tmp` is
    removed by rank 0 first; `previous`: the newest complete checkpoint, if any, of
    `previous_bytes`). The disk counts as full on ENOSPC / EDQUOT, and also when less is free
    than the previous checkpoint took (or under 1 MiB): torch's zip writer reports a full
    disk as "unexpected pos" without the errno."""
    written = folder_bytes(tmp)
    usage = shutil.disk_usage(root)
    if not dist.is_initialized() or dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    kind, _, reason = outcome.partition(": ")
    if kind == "full" or usage.free < max(previous_bytes, _MIB):
        need = (f"the last checkpoint took {previous_bytes / _MIB:.1f} MiB" if previous_bytes
                else f"{written / _MIB:.1f} MiB were written before it stopped")
        what = (f"the disk is full ({reason}; {usage.free / _MIB:.1f} MiB free of "
                f"{usage.total / _MIB:.1f} MiB, {need})")
        todo = "free space or give --save a folder on a larger disk"
    else:
        what = f"the files could not be written ({reason})"
        todo = "fix the folder"
    kept = ("no earlier checkpoint was saved there" if previous is None else
            f"the previous checkpoint {previous} ({os.path.join(root, f'iter_{previous:07d}')}) "
            "is intact")
    return SaveError(f"saving checkpoint {iteration} to {root} failed: {what}; {kept} (the "
                     f"unfinished {os.path.basename(tmp)} was removed); {todo}, then resume "
                     f"with --load {root}")
