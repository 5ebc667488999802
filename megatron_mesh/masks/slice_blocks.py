"""The rank-blocks of a `SliceMask` (a mask given as slices, `slices.py`).

Block (x, y) is the mask's slices cut to x's zigzag rows and y's columns: each pair of
their sub-chunks is a rectangle of positions, and each slice meeting it gives at most two
slices of it (`Slice.cut`), moved to the local rows. Then:

    no cut slice          the block is empty: not computed, and the sparse exchange
                          (`schedules/sparse.py`) sends none of its rows
    each cut slice        one plain call over its rows: full; causal where it is square,
                          else flash-attention's bottom-right causal (`TileMask.band`);
                          a window band as flash-attention's window (`TileMask.band`)

Every call's rows see a key and its keys are seen, so the merge and the backward never meet
a row without one; a query row no slice reaches is in no call (output 0, no gradient). A
block holds its rows and its calls' bounds only, no mask of size rows x keys, whatever the
mask (`groups.py` then joins calls that share query or key rows). Many small slices (short
documents) are many small calls: a variable-length call over the ones that run down the
diagonal would be one, where the kernels take it for any batch.
"""
from __future__ import annotations

import torch

from ..common.caches import per_documents
from ..common.tile_mask import TileMask
from .block import Block, BlockKind
from .slices import CAUSAL, Slice, SliceMask
from .zigzag import held_pieces


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
                                 s.kind, s.window))
    return out


@per_documents(lambda mask, *_: mask)  # the blocks of the last few masks (`caches.py`)
def slice_block(mask: SliceMask, ranks: int, q_rank: int, kv_rank: int, local_len: int,
                device: torch.device) -> Block:
    """Block (q_rank, kv_rank) of `mask` on zigzag shares of `local_len` rows, with its
    kernel calls (the rows it uses on `device` where they are an index tensor)."""
    parts = local_slices(mask, ranks, q_rank, kv_rank, local_len)
    if not parts:
        return Block(BlockKind.FULL, slice(0, 0), slice(0, 0), tiles=())
    if len(parts) == 1:
        return _call(parts[0])
    q_rows = _rows(_union([(s.q_start, s.q_end) for s in parts]), device)
    kv_rows = _rows(_union([(s.k_start, s.k_end) for s in parts]), device)
    return Block(BlockKind.FULL, q_rows, kv_rows, tiles=tuple(_call(s) for s in parts))


def _call(s: Slice) -> Block:
    """One slice of local rows as one kernel call."""
    rows, cols = slice(s.q_start, s.q_end), slice(s.k_start, s.k_end)
    sq, sk = s.q_end - s.q_start, s.k_end - s.k_start
    if s.window is not None:  # a window band, bottom-right aligned on the cut
        return Block(BlockKind.FULL, rows, cols, mask=TileMask.band(sq, sk, *s.window))
    if s.kind != CAUSAL:
        return Block(BlockKind.FULL, rows, cols)
    if sq == sk:  # top-left and bottom-right alignment agree
        return Block(BlockKind.DIAGONAL, rows, cols)
    return Block(BlockKind.FULL, rows, cols, mask=TileMask.band(sq, sk, -1, 0))


def _union(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The union of [start, end) ranges as sorted disjoint runs."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _rows(ranges: list[tuple[int, int]], device: torch.device) -> slice | torch.Tensor:
    """The rows of [start, end) ranges in order: a slice where they follow one another, else
    an int64 index on `device`."""
    if all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])):
        return slice(ranges[0][0], ranges[-1][1])
    return torch.cat([torch.arange(start, end) for start, end in ranges]).to(device)
