"""The rank-blocks of a `SliceMask` (a user's mask given as slices, `slices.py`).

Block (x, y) is the mask's slices cut to x's zigzag rows and y's columns: each pair of
their sub-chunks is a rectangle of positions, and each slice meeting it gives at most two
slices of it (`Slice.cut`), moved to the local rows. Then:

    no cut slice          the block is empty: not computed, and the sparse exchange
                          (`windowed.py`) sends none of its rows
    a full one            one plain call over its rows
    a causal one          one plain causal call where it is square, else
                          flash-attention's bottom-right causal (`TileMask.band`)
    several               one call each, or, past MAX_CALLS of them, one call over the
                          union of their rows with an explicit mask (`TileMask.explicit`)
                          where that box holds at most EXPLICIT_MAX_PAIRS pairs

Every call's rows see a key and its keys are seen, so the merge and the backward never meet
a row without one; a query row no slice reaches is in no call (output 0, no gradient).
"""
from __future__ import annotations

import torch

from ..kernels.base import TileMask
from ..runtime.caches import per_documents
from .block import Block, BlockKind
from .slices import CAUSAL, Slice, SliceMask
from .zigzag import held_pieces

MAX_CALLS = 4  # cut slices of a block run as one call each up to this many
EXPLICIT_MAX_PAIRS = 1 << 22  # a block's explicit mask: at most this many pairs (16 MiB fp32)


def runs(ranks: int, rank: int, local_len: int) -> list[tuple[int, int, int]]:
    """(first local row, first position, rows) of each run of contiguous positions `rank`
    holds in the zigzag layout of `ranks` shares of `local_len` rows."""
    pieces = held_pieces(ranks, rank)
    size = local_len // len(pieces)
    return [(n * size, piece * size, size) for n, piece in enumerate(pieces)]


def local_slices(mask: SliceMask, ranks: int, q_rank: int, kv_rank: int,
                 local_len: int) -> list[Slice]:
    """Block (q_rank, kv_rank)'s pairs as slices of local rows: q_* rows of q_rank's share,
    k_* rows of kv_rank's."""
    unit = local_len // len(held_pieces(ranks, q_rank))
    out = []
    for q_row, q_pos, q_len in runs(ranks, q_rank, local_len):
        for k_row, k_pos, k_len in runs(ranks, kv_rank, local_len):
            for s in mask.cut(q_pos, q_pos + q_len, k_pos, k_pos + k_len, unit):
                dq, dk = q_row - q_pos, k_row - k_pos
                out.append(Slice(s.q_start + dq, s.q_end + dq, s.k_start + dk, s.k_end + dk,
                                 s.kind))
    return out


@per_documents(lambda mask, *_: mask)  # the blocks of the last few masks (`caches.py`)
def slice_block(mask: SliceMask, ranks: int, q_rank: int, kv_rank: int, local_len: int,
                device: torch.device) -> Block:
    """Block (q_rank, kv_rank) of `mask` on zigzag shares of `local_len` rows, with its
    kernel calls (the rows on `device` where they are index tensors)."""
    parts = local_slices(mask, ranks, q_rank, kv_rank, local_len)
    if not parts:
        return Block(BlockKind.FULL, slice(0, 0), slice(0, 0), tiles=())
    if len(parts) == 1:
        return _call(parts[0])
    q_runs = _union([(s.q_start, s.q_end) for s in parts])
    kv_runs = _union([(s.k_start, s.k_end) for s in parts])
    q_rows, kv_rows = _rows(q_runs, device), _rows(kv_runs, device)
    if len(parts) > MAX_CALLS and _count(q_runs) * _count(kv_runs) <= EXPLICIT_MAX_PAIRS:
        tiles = (_explicit_call(parts, q_runs, kv_runs, q_rows, kv_rows, device),)
    else:
        tiles = tuple(_call(s) for s in parts)
    return Block(BlockKind.FULL, q_rows, kv_rows, tiles=tiles)


def _union(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The union of [start, end) ranges as sorted disjoint runs."""
    runs: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if runs and start <= runs[-1][1]:
            runs[-1] = (runs[-1][0], max(runs[-1][1], end))
        else:
            runs.append((start, end))
    return runs


def _count(runs: list[tuple[int, int]]) -> int:
    return sum(end - start for start, end in runs)


def _rows(runs: list[tuple[int, int]], device: torch.device) -> slice | torch.Tensor:
    """The rows of sorted disjoint runs: a slice for one run, else an int64 index on `device`."""
    if len(runs) == 1:
        return slice(*runs[0])
    return torch.cat([torch.arange(start, end) for start, end in runs]).to(device)


def _call(s: Slice) -> Block:
    """One slice of local rows as one kernel call."""
    rows, cols = slice(s.q_start, s.q_end), slice(s.k_start, s.k_end)
    sq, sk = s.q_end - s.q_start, s.k_end - s.k_start
    if s.kind != CAUSAL:
        return Block(BlockKind.FULL, rows, cols)
    if sq == sk:  # top-left and bottom-right alignment agree
        return Block(BlockKind.DIAGONAL, rows, cols)
    return Block(BlockKind.FULL, rows, cols, mask=TileMask.band(sq, sk, -1, 0))


def _explicit_call(parts: list[Slice], q_runs: list[tuple[int, int]],
                   kv_runs: list[tuple[int, int]], q_rows: slice | torch.Tensor,
                   kv_rows: slice | torch.Tensor, device: torch.device) -> Block:
    """One call over the union of the slices' rows (`q_runs`, `kv_runs`), with the mask they
    make of it."""
    seen = torch.zeros(_count(q_runs), _count(kv_runs), dtype=torch.bool)
    for s in parts:
        i, j = _at(q_runs, s.q_start), _at(kv_runs, s.k_start)
        sq, sk = s.q_end - s.q_start, s.k_end - s.k_start
        tile = torch.ones(sq, sk, dtype=torch.bool)
        seen[i:i + sq, j:j + sk] = tile.tril(sk - sq) if s.kind == CAUSAL else tile
    mask = None if bool(seen.all()) else TileMask.explicit(seen, device)
    return Block(BlockKind.FULL, q_rows, kv_rows, mask=mask)


def _at(runs: list[tuple[int, int]], row: int) -> int:
    """Where local `row` (inside one of the sorted disjoint `runs`) is in their rows."""
    before = 0
    for start, end in runs:
        if row < end:
            return before + row - start
        before += end - start
    raise ValueError(f"row {row} is in none of the runs {runs}")
