"""Attention kernel calls one rank makes for its tile of a dense sequence, per pass.

A rows x cols tile (R K/V chunks of the column x C query chunks of the row) holds R * C
rank-blocks. The blocks a schedule has on hand together go to the kernel as few calls
(`calls.groups`): calls over the same query rows take their keys concatenated (a causal
diagonal last, bottom-right aligned, where the kernel takes that: `bottom_right`), then
full calls over the same keys take their queries concatenated. What is on hand together:

    gathered    forward : each query chunk of the row against the whole column;
                backward: the diagonal block alone (while the gathers run), each other
                          query chunk against the column, then the own chunk's other blocks
    streamed_kv forward : the diagonal alone, then at each ring step the row's query chunks
                          against the K/V chunk held
                backward: the diagonal alone, then each query chunk of the row against
                          the K/V chunk held, one at a time (grouping them would copy the
                          row's Q, dO, outputs and lse: more than the K/V streaming saves;
                          at the last step each dQ partial leaves as soon as it is final)
    streamed_q  forward : the diagonal alone, then at each ring step the Q chunk held
                          against the column
                backward: likewise; the own chunk's blocks kept for after the last step
                          (`streamed_q.own_blocks_later`) in one group

A grouped call concatenates at most `group_tokens()` keys (or query rows; 16384 unless
MESH_GROUP_TOKENS says otherwise): past that the pieces go in several calls, cut from the
last (the diagonal's) back, so its copies and outputs stay a few chunks' worth however tall
or wide the grid is (a query chunk of a 64 x 1 grid's tile would otherwise copy up to the
whole column's K/V). The value is where the H200 profile (`planner/profiles`) puts an
8-chunk column's tile within a point of the uncapped one at 4K and 8K tokens per rank;
8K keys would cost 3 to 4 points there. The counts take a rank's chunk tokens for it
(`chunk_tokens`; None: no cap).

A kernel that takes whole tiles (`kernels.caps.KernelCaps.whole_tile`, FlexAttention's)
makes one call of each group, whatever the mask (`whole_tile=True`): the group's chunks
concatenated, whole, against a block mask, uncapped. The gathered schedule then hands it the
whole tile (C > 1): forward the row's C query chunks against the column in one call;
backward the diagonal alone (while the gathers run), then the tile but the diagonal in one.

A ring of one rank runs the gathered code (`Schedule.runs_gathered`). Counts are per rank;
the functions give the most over the ranks of the mesh (the rank that makes the most calls
sets the pace), or one rank's (`rank`). Torch-free: the planner prices kernel time by
calls, the memory model (`memory.py`) the largest call's copies (`call_shapes`);
answers are memoized per grid (a plan asks for every rank's). `tests/distributed/
test_tile_calls.py` holds the real calls to these counts.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import NamedTuple

from ..layer_plan import Schedule, check_positive_int

# Grouping is on unless MESH_GROUP_CALLS=0 is set in the environment (read on every tile):
# the blocks' own calls are kept for A/B comparisons only (`scripts/bench_tiles.py
# --calls blocks`).
GROUP_CALLS_DEFAULT = True
# The most keys (or query rows) one grouped call concatenates (MESH_GROUP_TOKENS overrides)
GROUP_TOKENS = 16384


def grouping(grouped: bool | None = None) -> bool:
    """Whether tiles group their blocks' calls: `grouped` where given, else MESH_GROUP_CALLS
    in the environment ('0' off, anything else on), else `GROUP_CALLS_DEFAULT` (on)."""
    if grouped is not None:
        return grouped
    value = os.environ.get("MESH_GROUP_CALLS")
    return GROUP_CALLS_DEFAULT if value is None else value != "0"


def group_tokens(tokens: int | None = None) -> int:
    """The most keys (or query rows) a grouped call concatenates: `tokens` where given,
    else MESH_GROUP_TOKENS in the environment, else `GROUP_TOKENS`."""
    if tokens is None:
        value = env_group_tokens()
        return GROUP_TOKENS if value is None else value
    check_positive_int("group tokens", tokens)
    return tokens


def env_group_tokens() -> int | None:
    """MESH_GROUP_TOKENS in the environment as tokens (None: unset); ValueError naming a
    value that is not a positive integer."""
    value = os.environ.get("MESH_GROUP_TOKENS")
    if value is None:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"MESH_GROUP_TOKENS={value!r} is not a positive integer (tokens)")
    return int(value)


def piece_limit(chunk_tokens: int | None, tokens: int | None = None) -> int | None:
    """The cap (`group_tokens(tokens)`) in half chunks of a rank's `chunk_tokens`-token
    chunk (None: no cap)."""
    if chunk_tokens is None:
        return None
    check_positive_int("chunk_tokens", chunk_tokens)
    return group_tokens(tokens) // max(1, chunk_tokens // 2)


def _runs(n: int, size: int, limit: int | None) -> list[int]:
    """Pieces per call of n pieces of `size` half chunks cut into runs of at most `limit`
    half chunks (at least one piece each; None: one run)."""
    if n == 0:
        return []
    m = n if limit is None else max(1, limit // size)
    return [m] * (n // m) + [n % m] * (n % m > 0)


Pair = tuple[int, int]  # (query owner x, key owner y): mesh ranks (zigzag positions)


@dataclass(frozen=True)
class CallShape:
    """One kernel call: the rows of each query piece and each key piece it concatenates,
    in half chunks (2: a whole chunk, 1: one zigzag half); `diagonal`: a whole-tile call
    holding a causal diagonal block (its mask has partial blocks, `memory.py`)."""

    q: tuple[int, ...]
    kv: tuple[int, ...]
    diagonal: bool = False


class Group(NamedTuple):
    """Blocks on hand together, as the schedules make them: one query chunk x against key
    chunks Y (`by_rows`), or query chunks X against one key chunk y; `lower` / `higher`:
    how many of the others lie before / after the one (zigzag positions), `diagonal`:
    whether the one's own block is among them; `skipped`: chunks in the same buffers whose
    blocks are computed apart (the diagonal, streamed_q's later ones), which a whole-tile
    call takes too (masked out)."""

    by_rows: bool
    lower: int
    higher: int
    diagonal: bool
    skipped: int = 0


def _schedule(schedule: Schedule | str) -> Schedule:
    try:
        return Schedule(str(schedule))
    except ValueError:
        valid = ", ".join(s.value for s in Schedule)
        raise ValueError(f"schedule {schedule!r} is not one of {valid}") from None


@functools.lru_cache(maxsize=1024)
def group_shapes(group: Group, causal: bool, bottom_right: bool = True,
                 limit: int | None = None) -> tuple[CallShape, ...]:
    """The calls `calls.groups.group_calls` makes of `group`'s dense blocks, each
    concatenating at most `limit` half chunks (`piece_limit`; None: no cap). The zigzag
    blocks of a dense causal sequence (`calls.layout.block_for`, cut from its one causal
    slice): x > y sees y's first half with all its rows,
    x < y sees all of y with its second half, x == y is the causal diagonal; without a
    causal mask every block is whole against whole."""
    lower, higher, diagonal = group.lower, group.higher, group.diagonal
    others = lower + higher
    if not causal:  # every block whole: pieces concatenated on one side
        runs = _runs(others + diagonal, 2, limit)
        return tuple(CallShape((2,), (2,) * n) if group.by_rows else CallShape((2,) * n, (2,))
                     for n in runs)
    out = []
    if group.by_rows:  # Q(x) against the first halves of y < x, its second half against y > x
        if diagonal and lower and bottom_right:  # the diagonal's keys last, one call
            folded = lower if limit is None else min(lower, max(0, limit - 2))
            out.append(CallShape((2,), (1,) * folded + (2,)))
            lower -= folded
        else:
            out += [CallShape((2,), (2,))] * diagonal
        out += [CallShape((2,), (1,) * n) for n in _runs(lower, 1, limit)]
        out += [CallShape((1,), (2,) * n) for n in _runs(higher, 2, limit)]
    else:  # Q(x > y) against y's first half, the second halves of Q(x < y) against all of y
        out += [CallShape((2,), (2,))] * diagonal
        out += [CallShape((2,) * n, (1,)) for n in _runs(higher, 2, limit)]
        out += [CallShape((1,) * n, (2,)) for n in _runs(lower, 1, limit)]
    return tuple(out)


def whole_tile_shape(group: Group, causal: bool = True) -> CallShape:
    """The one call of `group` on a kernel taking whole tiles: its chunks whole,
    concatenated on the grouped side (its skipped ones too), `diagonal` where it holds a
    causal diagonal."""
    n = group.lower + group.higher + group.diagonal + group.skipped
    diagonal = causal and group.diagonal
    return (CallShape((2,), (2,) * n, diagonal) if group.by_rows
            else CallShape((2,) * n, (2,), diagonal))


def _grid(rows: int, cols: int, schedule: Schedule | str) -> Schedule:
    check_positive_int("rows", rows)
    check_positive_int("cols", cols)
    schedule = _schedule(schedule)
    return Schedule.GATHERED if schedule.runs_gathered(rows, cols) else schedule


def _groups(rows: int, cols: int, schedule: Schedule, rank: int, phase: str
            ) -> list[tuple[Group, int]]:
    """The groups of blocks rank `rank` (mesh rank i * cols + j) computes together, each
    with how many times it occurs, counted in closed form: row member x_c = i * cols + c
    lies before column member y_r = r * cols + j where i < r, or i == r and c < j."""
    i, j = divmod(rank, cols)
    diagonal = (Group(True, 0, 0, True), 1)
    # a query chunk x_c (c != j) against the column: i (+1 where c > j) chunks before it
    row_before = (Group(True, i, rows - i, False), j)  # the j chunks c < j
    row_after = (Group(True, i + 1, rows - i - 1, False), cols - 1 - j)  # c > j
    if schedule is Schedule.GATHERED:
        if phase == "forward":  # and x_j = this rank's own chunk, with the diagonal
            return [row_before, row_after, (Group(True, i, rows - 1 - i, True), 1)]
        own = (Group(True, i, rows - 1 - i, False, 1), 1)  # the own chunk's other blocks
        return [diagonal, row_before, row_after, own]
    if schedule is Schedule.STREAMED_KV:  # the row's chunks against y_r: the diagonal first
        if phase == "backward":  # one query chunk at a time
            before = cols * (rows - 1 - i) + j  # (x_c, y_r) with x_c before y_r
            after = cols * i + cols - 1 - j
            return [diagonal, (Group(False, 1, 0, False), before),
                    (Group(False, 0, 1, False), after)]
        return [diagonal, (Group(False, 0, cols, False), i),  # r < i: every x_c after y_r
                (Group(False, cols, 0, False), rows - 1 - i),  # r > i: every x_c before
                (Group(False, j, cols - 1 - j, False, 1), 1)]  # r = i: the others
    # streamed_q: the query chunk x_c (c = j - t) against the column; at step 0 this rank's
    # own chunk against the column but the diagonal, in backward only the first (R - 1) // 2
    # of them (`streamed_q.own_blocks_later`), the others after the last step
    kept = (rows - 1) // 2 if phase == "backward" else rows - 1
    later_before = max(0, i - kept)
    groups = [diagonal, row_before, row_after,
              (Group(True, min(kept, i), kept - min(kept, i), False, rows - kept), 1)]
    if phase == "backward":
        groups.append((Group(True, later_before, rows - 1 - kept - later_before, False), 1))
    return groups


def _whole_gathered_tile(rows: int, cols: int, causal: bool, phase: str
                         ) -> dict[CallShape, int]:
    """The gathered schedule's calls on a kernel taking whole tiles (C > 1), on every rank:
    forward the row's C query chunks against the column's R in one call; backward the
    diagonal alone, then the tile but the diagonal in one call (`gathered.backward`)."""
    tile = CallShape((2,) * cols, (2,) * rows, causal and phase == "forward")
    if phase == "forward":
        return {tile: 1}
    return {CallShape((2,), (2,), causal): 1, tile: 1}


def _rank_calls(rows: int, cols: int, causal: bool, schedule: Schedule, phase: str,
                bottom_right: bool, rank: int, limit: int | None,
                whole_tile: bool = False) -> dict[CallShape, int]:
    """The calls of one rank's pass, grouped (one a group where `whole_tile`): how many of
    each shape (empty groups make none)."""
    if whole_tile and schedule is Schedule.GATHERED and cols > 1:
        return _whole_gathered_tile(rows, cols, causal, phase)
    calls: dict[CallShape, int] = {}
    for g, n in _groups(rows, cols, schedule, rank, phase):
        if n and (g.lower or g.higher or g.diagonal):
            shapes = ((whole_tile_shape(g, causal),) if whole_tile
                      else group_shapes(g, causal, bottom_right, limit))
            for c in shapes:
                calls[c] = calls.get(c, 0) + n
    return calls


@functools.lru_cache(maxsize=1024)
def _calls(rows: int, cols: int, causal: bool, schedule: Schedule | str, phase: str,
           bottom_right: bool, rank: int | None, grouped: bool, limit: int | None,
           whole_tile: bool = False) -> int:
    schedule = _grid(rows, cols, schedule)
    if not grouped and not whole_tile:
        return rows * cols  # one call per block
    ranks = range(rows * cols) if rank is None else [rank]
    return max(sum(_rank_calls(rows, cols, causal, schedule, phase, bottom_right, r,
                               limit, whole_tile).values())
               for r in ranks)


def forward_calls(rows: int, cols: int, causal: bool, schedule: Schedule | str, *,
                  bottom_right: bool = True, rank: int | None = None,
                  grouped: bool | None = None, chunk_tokens: int | None = None,
                  cap_tokens: int | None = None, whole_tile: bool = False) -> int:
    """Kernel calls of one rank's forward tile (R = rows K/V chunks x C = cols query
    chunks, a dense sequence, `causal` or full): the most over the mesh's ranks, or rank
    `rank`'s (its mesh rank); `bottom_right`: the kernel folds a causal diagonal into a
    call of more keys than queries (`kernels.base.folds_diagonal`: torch's kernel on CUDA's
    flash op; not cuDNN's nor TE's); `grouped`: as `grouping` (None: as the runtime runs
    now, grouped unless MESH_GROUP_CALLS=0; ungrouped, R * C); `chunk_tokens`: the tokens
    of a rank's chunk, each call concatenating at most `cap_tokens` of them (None: the
    runtime's, `group_tokens()`; chunk_tokens None: no cap); `whole_tile`: the kernel takes
    whole tiles (FlexAttention's), one call a group, grouped or not, uncapped."""
    return _calls(rows, cols, causal, schedule, "forward", bottom_right, rank,
                  grouping(grouped), piece_limit(chunk_tokens, cap_tokens), whole_tile)


def backward_calls(rows: int, cols: int, causal: bool, schedule: Schedule | str, *,
                   bottom_right: bool = True, rank: int | None = None,
                   grouped: bool | None = None, chunk_tokens: int | None = None,
                   cap_tokens: int | None = None, whole_tile: bool = False) -> int:
    """Kernel calls of one rank's backward tile (as `forward_calls`)."""
    return _calls(rows, cols, causal, schedule, "backward", bottom_right, rank,
                  grouping(grouped), piece_limit(chunk_tokens, cap_tokens), whole_tile)


@functools.lru_cache(maxsize=1024)
def call_shapes(rows: int, cols: int, causal: bool, schedule: Schedule | str, phase: str,
                bottom_right: bool = False, limit: int | None = None,
                whole_tile: bool = False) -> frozenset[CallShape]:
    """Every shape of call (`CallShape`) some rank makes in `phase` ('forward' or
    'backward'), grouped, the schedule as it runs on this grid, each call at most `limit`
    half chunks (`piece_limit`; None: no cap); `whole_tile`: one call a group."""
    schedule = _grid(rows, cols, schedule)
    return frozenset(c for r in range(rows * cols)
                     for c in _rank_calls(rows, cols, causal, schedule, phase, bottom_right, r,
                                          limit, whole_tile))
