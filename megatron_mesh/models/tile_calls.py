"""Attention kernel calls one rank makes for its tile of a dense sequence, per pass.

A rows x cols tile (R K/V chunks of the column x C query chunks of the row) computes
R * C rank-blocks. Each block is one kernel call (forward and backward alike), whatever
the schedule: gathered, streamed_kv and streamed_q compute the same blocks in another
order. Torch-free: the planner prices kernel time by calls.
"""
from __future__ import annotations

from ..values import Schedule, check_positive_int


def _schedule(schedule: Schedule | str) -> Schedule:
    try:
        return Schedule(str(schedule))
    except ValueError:
        valid = ", ".join(s.value for s in Schedule)
        raise ValueError(f"schedule {schedule!r} is not one of {valid}") from None


def forward_calls(rows: int, cols: int, causal: bool, schedule: Schedule | str) -> int:
    """Kernel calls of one rank's forward tile (R = rows K/V chunks x C = cols query
    chunks, a dense sequence, `causal` or full)."""
    check_positive_int("rows", rows)
    check_positive_int("cols", cols)
    _schedule(schedule)
    return rows * cols


def backward_calls(rows: int, cols: int, causal: bool, schedule: Schedule | str) -> int:
    """Kernel calls of one rank's backward tile (as `forward_calls`)."""
    return forward_calls(rows, cols, causal, schedule)
