"""Attention kernel calls one rank makes for its tile of a dense sequence, per pass.

A rows x cols tile (R K/V chunks of the column x C query chunks of the row) holds R * C
rank-blocks. The blocks a schedule has on hand together go to the kernel as few calls
(`masks.groups`): calls over the same query rows take their keys concatenated (a causal
diagonal last, bottom-right aligned, where the kernel takes that: `bottom_right`), then
full calls over the same keys take their queries concatenated. What is on hand together:

    gathered    forward : each query chunk of the row against the whole column;
                backward: the diagonal block alone (while the gathers run), each other
                          query chunk against the column, then the own chunk's other blocks
    streamed_kv forward : the diagonal alone, then at each ring step the row's query chunks
                          against the K/V chunk held
                backward: likewise, but at the last step one query chunk at a time (each
                          dQ partial leaves on the row ring as soon as it is final)
    streamed_q  forward : the diagonal alone, then at each ring step the Q chunk held
                          against the column
                backward: likewise; the own chunk's blocks kept for after the last step
                          (`streamed_q.own_blocks_later`) in one group

A ring of one rank runs the gathered code (`Schedule.runs_gathered`). Counts are per rank;
the functions give the most over the ranks of the mesh (the rank that makes the most calls
sets the pace), or one rank's (`rank`). Torch-free: the planner prices kernel time by
calls. `tests/unit/test_tile_calls.py` holds the real calls to these counts.
"""
from __future__ import annotations

import os
from typing import Iterable

from ..values import Schedule, check_positive_int

# Grouping is on where MESH_GROUP_CALLS=1 is set in the environment (read on every tile);
# off by default until the memory model (`memory.py`) counts the grouped calls' copies.
GROUP_CALLS_DEFAULT = False


def grouping(grouped: bool | None = None) -> bool:
    """Whether tiles group their blocks' calls: `grouped` where given, else MESH_GROUP_CALLS
    in the environment ('1' on, '0' off), else `GROUP_CALLS_DEFAULT`."""
    if grouped is not None:
        return grouped
    value = os.environ.get("MESH_GROUP_CALLS")
    return GROUP_CALLS_DEFAULT if value is None else value != "0"

Pair = tuple[int, int]  # (query owner x, key owner y): mesh ranks (zigzag positions)


def _schedule(schedule: Schedule | str) -> Schedule:
    try:
        return Schedule(str(schedule))
    except ValueError:
        valid = ", ".join(s.value for s in Schedule)
        raise ValueError(f"schedule {schedule!r} is not one of {valid}") from None


def _call(x: int, y: int, causal: bool) -> tuple[str, str, bool]:
    """The zigzag block rule (`masks.block.block_kind`): (query rows, key rows, causal) of
    block (x, y) as 'whole' / 'first' / 'second' halves."""
    if not causal:
        return "whole", "whole", False
    if x == y:
        return "whole", "whole", True
    return ("whole", "first", False) if x > y else ("second", "whole", False)


def group_count(pairs: Iterable[Pair], causal: bool, bottom_right: bool = True) -> int:
    """Kernel calls for the blocks `pairs` on hand together (`masks.groups.group_calls`
    on dense blocks)."""
    by_rows: dict[tuple[int, str], list[tuple[int, str, bool]]] = {}
    for x, y in pairs:
        q_rows, kv_rows, diag = _call(x, y, causal)
        by_rows.setdefault((x, q_rows), []).append((y, kv_rows, diag))
    calls, by_keys = 0, set()
    for calls_of_rows in by_rows.values():
        full = sorted((y, kv) for y, kv, diag in calls_of_rows if not diag)
        diagonals = sum(diag for *_, diag in calls_of_rows)
        if diagonals and bottom_right and full:
            calls += diagonals  # the diagonal takes the full calls' keys
        else:
            calls += diagonals
            if full:
                by_keys.add(tuple(full))
    return calls + len(by_keys)


def _grid(rows: int, cols: int, schedule: Schedule | str) -> Schedule:
    check_positive_int("rows", rows)
    check_positive_int("cols", cols)
    schedule = _schedule(schedule)
    return Schedule.GATHERED if schedule.runs_gathered(rows, cols) else schedule


def _groups(rows: int, cols: int, schedule: Schedule, rank: int, phase: str
            ) -> list[list[Pair]]:
    """The groups of blocks rank `rank` (mesh rank i * cols + j) computes together."""
    i, j = divmod(rank, cols)
    row = [i * cols + c for c in range(cols)]  # query owners, by column index
    col = [r * cols + j for r in range(rows)]  # key owners, by row index
    me = rank
    if schedule is Schedule.GATHERED:
        if phase == "forward":
            return [[(x, y) for y in col] for x in row]
        others = [[(x, y) for y in col] for x in row if x != me]
        return [[(me, me)], *others, [(me, y) for y in col if y != me]]
    if schedule is Schedule.STREAMED_KV:
        groups = [[(me, me)]]
        for t in range(rows):
            y = col[(i - t) % rows]
            xs = [x for x in row if not (t == 0 and x == me)]
            if phase == "backward" and t == rows - 1:
                groups += [[(x, y)] for x in xs]
            else:
                groups.append([(x, y) for x in xs])
        return groups
    later = set(col[r] for r in _own_blocks_later(rows, i)) if phase == "backward" else set()
    groups = [[(me, me)]]
    for t in range(cols):
        x = row[(j - t) % cols]
        groups.append([(x, y) for y in col if not (t == 0 and (y == me or y in later))])
    if later:
        groups.append([(me, y) for y in sorted(later)])
    return groups


def _own_blocks_later(rows: int, row_index: int) -> list[int]:
    """`streamed_q.own_blocks_later`: the own chunk's off-diagonal row indices kept for
    after the last ring step."""
    off = [r for r in range(rows) if r != row_index]
    return off[(rows - 1) // 2:]


def _calls(rows: int, cols: int, causal: bool, schedule: Schedule | str, phase: str,
           bottom_right: bool, rank: int | None, grouped: bool | None) -> int:
    schedule = _grid(rows, cols, schedule)
    if not grouping(grouped):
        return rows * cols  # one call per block
    ranks = range(rows * cols) if rank is None else [rank]
    return max(sum(group_count(g, causal, bottom_right) for g in _groups(
        rows, cols, schedule, r, phase) if g) for r in ranks)


def forward_calls(rows: int, cols: int, causal: bool, schedule: Schedule | str, *,
                  bottom_right: bool = True, rank: int | None = None,
                  grouped: bool | None = None) -> int:
    """Kernel calls of one rank's forward tile (R = rows K/V chunks x C = cols query
    chunks, a dense sequence, `causal` or full): the most over the mesh's ranks, or rank
    `rank`'s (its mesh rank); `bottom_right`: the kernel takes causal calls of more keys
    than queries (`KernelCaps.bottom_right`: torch's kernels; not cuDNN's nor TE's);
    `grouped`: as `grouping` (None: as the runtime runs now; ungrouped, R * C)."""
    return _calls(rows, cols, causal, schedule, "forward", bottom_right, rank, grouped)


def backward_calls(rows: int, cols: int, causal: bool, schedule: Schedule | str, *,
                   bottom_right: bool = True, rank: int | None = None,
                   grouped: bool | None = None) -> int:
    """Kernel calls of one rank's backward tile (as `forward_calls`)."""
    return _calls(rows, cols, causal, schedule, "backward", bottom_right, rank, grouped)
