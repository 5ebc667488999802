"""The blocks a rank has on hand together as ONE kernel call, for kernels that declare
`whole_tile` (`kernels/flex.py`): the query chunks concatenated against the K/V chunks
concatenated (a view where the chunks lie one after another in one buffer, as a gathered
column does; else one copy of each), with the tile's mask (`flex.TileMask`) made from the
blocks' own calls (`calls.layout.blocks_for`: every mask kind): each call's slices put at
its rows' places in the tile and cut into FlexAttention's blocks from their bounds
(`calls/band_blocks.py`: only the partial blocks made, no mask of the tile's size, any
chunk length), kept per micro-batch like the grouped calls (`blocks._tile_calls`). Blocks
in `skip` are left out of the mask. A chunk held in part (the sparse exchange's packed
rows, `KeptRows`) places only its kept rows (the mask then at the packed tile's size).

Forward: the call's out and lse split per query chunk and merged into its accumulators;
backward: its dq, dk, dv split per chunk and added into theirs.
"""
from __future__ import annotations

from typing import Collection, Sequence

import torch

from ..calls.band_blocks import call_pieces, row_runs, slice_table
from ..calls.layout import AttentionMask, blocks_for
from ..common.caches import per_documents
from ..common.merge import merge_into
from ..kernels.caps import caps_of
from ..kernels.flex import TileMask
from .kept_rows import KeptRows

Kept = Sequence[KeptRows | None] | None


def takes_whole_tiles(kernel: object) -> bool:
    """Whether `kernel` takes the blocks on hand together as one call (`caps.whole_tile`)."""
    return caps_of(kernel).whole_tile


def tile_mask(mask: AttentionMask, xs: Sequence[int], ys: Sequence[int], local_len: int,
              device: torch.device, skip: Collection[tuple[int, int]] = (),
              q_kept: Kept = None, kv_kept: Kept = None) -> TileMask:
    """The pairs of query chunks `xs` (concatenated, `local_len` rows each, or their kept
    rows packed where `q_kept` names them) against key chunks `ys` (likewise) the blocks
    (x, y) not in `skip` keep."""
    return _tile_mask(mask, tuple(xs), tuple(ys), local_len, torch.device(device),
                      frozenset(skip), _rows(q_kept, len(xs)), _rows(kv_kept, len(ys)))


def _rows(kept: Kept, n: int) -> tuple[tuple[int, ...] | None, ...]:
    """Per chunk, its kept rows (None: all of them)."""
    return tuple(None if kept is None or kept[i] is None else kept[i].kept for i in range(n))


@per_documents(lambda mask, *_: mask.packing)
def _tile_mask(mask: AttentionMask, xs: tuple[int, ...], ys: tuple[int, ...], local_len: int,
               device: torch.device, skip: frozenset, q_rows: tuple, kv_rows: tuple
               ) -> TileMask:
    """`tile_mask` from the blocks' calls: each call's slices through its rows' places in
    the tile (`band_blocks.call_pieces`), cut into FlexAttention's blocks from their bounds
    (`TileMask.of_pieces`)."""
    pairs = [(qi, ki) for qi, x in enumerate(xs) for ki, y in enumerate(ys)
             if (x, y) not in skip]
    made = blocks_for([(xs[qi], ys[ki]) for qi, ki in pairs], local_len, mask, device)
    (q_places, sq), (kv_places, sk) = _places(q_rows, local_len), _places(kv_rows, local_len)
    tables, q_runs, kv_runs = [], [], []
    for (qi, ki), block in zip(pairs, made):
        for call in block.calls:
            shape = (_count(call.q_rows), _count(call.kv_rows))
            tables.append(slice_table(call.slices, shape, call.causal))
            q_runs.append(row_runs(_at(q_places[qi], call.q_rows), shape[0]))
            kv_runs.append(row_runs(_at(kv_places[ki], call.kv_rows), shape[1]))
    return TileMask.of_pieces((sq, sk), call_pieces(tables, q_runs, kv_runs), device)


Places = int | torch.Tensor  # a chunk's row r at start + r, or at places[r] (-1: not held)


def _places(rows: tuple, local_len: int) -> tuple[list[Places], int]:
    """Where each chunk's rows lie in the tile's (chunks one after another, a packed one
    its kept rows only), and the tile's rows."""
    places, at = [], 0
    for kept in rows:
        if kept is None:
            places.append(at)
            at += local_len
            continue
        table = torch.full((local_len,), -1, dtype=torch.int64)
        table[torch.tensor(kept, dtype=torch.int64)] = torch.arange(at, at + len(kept))
        places.append(table)
        at += len(kept)
    return places, at


def _at(places: Places, rows: slice | torch.Tensor) -> int | torch.Tensor:
    """The tile places of a call's chunk rows `rows` (an int: consecutive from there)."""
    if isinstance(places, int):
        return places + rows.start if isinstance(rows, slice) else places + rows.cpu()
    return places[rows] if isinstance(rows, slice) else places[rows.cpu()]


def _count(rows: slice | torch.Tensor) -> int:
    return rows.stop - rows.start if isinstance(rows, slice) else rows.numel()


def joined(parts: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """The tensors concatenated along `dim`: a view where each starts where the one before
    ends in one storage (a gathered column's chunks), else one copy."""
    first = parts[0]
    if len(parts) == 1:
        return first
    dim %= first.dim()
    step = first.shape[dim] * first.stride(dim)
    adjacent = all(t.shape == first.shape and t.stride() == first.stride()
                   and t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
                   and t.storage_offset() == first.storage_offset() + n * step
                   for n, t in enumerate(parts))
    if adjacent and step > 0:
        shape = list(first.shape)
        shape[dim] *= len(parts)
        return first.as_strided(shape, first.stride(), first.storage_offset())
    return torch.cat(list(parts), dim)


def _local_len(queries: Sequence[tuple], at: int, *kepts: Kept) -> int:
    """Rows of a whole chunk: a packed chunk's `KeptRows` knows them, else the tensors'."""
    held = next((k for kept in kepts for k in kept or () if k is not None), None)
    return queries[0][at].shape[0] if held is None else held.local_len


def _sizes(chunks: Sequence[tuple], at: int, dim: int = 0) -> list[int]:
    return [c[at].shape[dim] for c in chunks]


def _call_mask(queries: Sequence[tuple], keys: Sequence[tuple], at: int, mask: AttentionMask,
               skip: Collection[tuple[int, int]], q_kept: Kept, kv_kept: Kept
               ) -> TileMask | None:
    """The one call's mask (`tile_mask`; queries hold their q tensor at `at`), or None where
    it keeps no pair (no call)."""
    if not queries or not keys:
        return None
    s = _local_len(queries, at, q_kept, kv_kept)
    tm = tile_mask(mask, [c[0] for c in queries], [c[0] for c in keys], s,
                   queries[0][at].device, skip, q_kept, kv_kept)
    return None if tm.empty else tm


def forward(kernel, queries: Sequence[tuple], keys: Sequence[tuple], mask: AttentionMask,
            scale: float, skip: Collection[tuple[int, int]] = (), q_kept: Kept = None,
            kv_kept: Kept = None) -> None:
    """`blocks.forward_tile` in one call: queries (x, q_x, out_acc, lse_acc), keys
    (y, k_y, v_y); q_kept / kv_kept as there."""
    tm = _call_mask(queries, keys, 1, mask, skip, q_kept, kv_kept)
    if tm is None:
        return
    q = joined([c[1] for c in queries])
    k, v = (joined([c[i] for c in keys]) for i in (1, 2))
    out, lse = kernel.tile_forward(q, k, v, tm, scale)
    del q, k, v
    sizes = _sizes(queries, 1)
    for c, o, lse_part in zip(queries, out.split(sizes), lse.split(sizes, -1)):
        merge_into(c[2], c[3], o, lse_part)


def backward(kernel, queries: Sequence[tuple], keys: Sequence[tuple], mask: AttentionMask,
             scale: float, skip: Collection[tuple[int, int]] = (), q_kept: Kept = None,
             kv_kept: Kept = None) -> None:
    """`blocks.backward_tile` in one call: queries (x, dout_x, q_x, out_x, lse_x, dq_acc),
    keys (y, k_y, v_y, (dk_acc, dv_acc)); q_kept / kv_kept as there."""
    tm = _call_mask(queries, keys, 2, mask, skip, q_kept, kv_kept)
    if tm is None:
        return
    dout, q, out = (joined([c[i] for c in queries]) for i in (1, 2, 3))
    lse = joined([c[4] for c in queries], -1)
    k, v = (joined([c[i] for c in keys]) for i in (1, 2))
    dq, dk, dv = kernel.tile_backward(dout, q, k, v, out, lse, tm, scale)
    del dout, q, out, lse, k, v
    for c, part in zip(queries, dq.split(_sizes(queries, 2))):
        c[5].add_(part)
    sizes = _sizes(keys, 1)
    for c, gk, gv in zip(keys, dk.split(sizes), dv.split(sizes)):
        c[3][0].add_(gk)
        c[3][1].add_(gv)
