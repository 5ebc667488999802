"""The blocks a rank has on hand together as ONE kernel call, for kernels that declare
`whole_tile` (`kernels/flex.py`): the query chunks concatenated against the K/V chunks
concatenated (a view where the chunks lie one after another in one buffer, as a gathered
column does; else one copy of each), with the tile's mask (`flex.TileMask`) made from the
blocks' own calls (`calls.layout.blocks_for`: every mask kind), block by block where a
chunk is a whole number of FlexAttention's blocks (else through a mask of the tile's size),
and kept per micro-batch like the grouped calls (`blocks._tile_calls`). Blocks in `skip`
are left out of the mask. A chunk held in part (the sparse exchange's packed rows,
`KeptRows`) takes its kept rows of the blocks' squares (the mask then made at the packed
tile's size, which holds only the rows the blocks use).

Forward: the call's out and lse split per query chunk and merged into its accumulators;
backward: its dq, dk, dv split per chunk and added into theirs.
"""
from __future__ import annotations

from typing import Collection, Sequence

import torch

from ..calls.layout import AttentionMask, blocks_for
from ..common.caches import per_documents
from ..common.merge import merge_into
from ..kernels.caps import caps_of
from ..kernels.flex import BLOCK, TileMask
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
    device = torch.device(device)
    if _packed(q_kept, kv_kept):
        return _packed_mask(mask, tuple(xs), tuple(ys), local_len, device, frozenset(skip),
                            _rows(q_kept, len(xs)), _rows(kv_kept, len(ys)))
    return _tile_mask(mask, tuple(xs), tuple(ys), local_len, device, frozenset(skip))


def _packed(*kepts: Kept) -> bool:
    return any(held is not None for kept in kepts for held in kept or ())


def _rows(kept: Kept, n: int) -> tuple[tuple[int, ...] | None, ...]:
    """Per chunk, its kept rows (None: all of them)."""
    return tuple(None if kept is None or kept[i] is None else kept[i].kept for i in range(n))


@per_documents(lambda mask, *_: mask.packing)
def _packed_mask(mask: AttentionMask, xs: tuple[int, ...], ys: tuple[int, ...], local_len: int,
                 device: torch.device, skip: frozenset, q_rows: tuple, kv_rows: tuple
                 ) -> TileMask:
    def index(rows):
        return (torch.arange(local_len, device=device) if rows is None
                else torch.tensor(rows, dtype=torch.int64, device=device))
    q_index, kv_index = [index(r) for r in q_rows], [index(r) for r in kv_rows]
    q_at = [0] + [int(t.numel()) for t in q_index]
    kv_at = [0] + [int(t.numel()) for t in kv_index]
    for at in (q_at, kv_at):
        for i in range(1, len(at)):
            at[i] += at[i - 1]
    pairs = [(qi, ki) for qi, x in enumerate(xs) for ki, y in enumerate(ys)
             if (x, y) not in skip]
    made = blocks_for([(xs[qi], ys[ki]) for qi, ki in pairs], local_len, mask, device)
    seen = torch.zeros(q_at[-1], kv_at[-1], dtype=torch.bool, device=device)
    for (qi, ki), block in zip(pairs, made):
        square = _square(block, local_len, device)
        seen[q_at[qi]:q_at[qi + 1], kv_at[ki]:kv_at[ki + 1]] = \
            square.index_select(0, q_index[qi]).index_select(1, kv_index[ki])
    return TileMask.of(seen)


@per_documents(lambda mask, *_: mask.packing)
def _tile_mask(mask: AttentionMask, xs: tuple[int, ...], ys: tuple[int, ...], local_len: int,
               device: torch.device, skip: frozenset) -> TileMask:
    pairs = [(qi, ki) for qi, x in enumerate(xs) for ki, y in enumerate(ys)
             if (x, y) not in skip]
    made = blocks_for([(xs[qi], ys[ki]) for qi, ki in pairs], local_len, mask, device)
    shape = (len(xs) * local_len, len(ys) * local_len)
    regions = ((pair, _square(block, local_len, device)) for pair, block in zip(pairs, made))
    if local_len % BLOCK == 0:  # each block's square on its own: no mask of the tile's size
        return TileMask.of_regions(shape, local_len, regions, device)
    seen = torch.zeros(shape, dtype=torch.bool, device=device)
    for (qi, ki), square in regions:
        seen[qi * local_len:(qi + 1) * local_len, ki * local_len:(ki + 1) * local_len] = square
    return TileMask.of(seen)


def _square(block, local_len: int, device: torch.device) -> torch.Tensor:
    """bool [local_len, local_len]: the pairs of a block's calls, in its chunks' rows (a
    call's rows and keys as slices, or gathered and put back by index: no index tensor of
    the call's rows x keys)."""
    seen = torch.zeros(local_len, local_len, dtype=torch.bool, device=device)
    for call in block.calls:
        kept, rows = call.seen().to(device), call.q_rows
        if isinstance(rows, slice):
            _or_keys(seen[rows], call.kv_rows, kept)
        else:
            rows = rows.to(device)
            part = seen.index_select(0, rows)
            _or_keys(part, call.kv_rows, kept)
            seen.index_copy_(0, rows, part)
    return seen


def _or_keys(part: torch.Tensor, keys: slice | torch.Tensor, kept: torch.Tensor) -> None:
    """part[:, keys] |= kept, in place (keys a slice or an index of columns)."""
    if isinstance(keys, slice):
        part[:, keys] |= kept
        return
    keys = keys.to(part.device)
    part.index_copy_(1, keys, part.index_select(1, keys) | kept)


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


def forward(kernel, queries: Sequence[tuple], keys: Sequence[tuple], mask: AttentionMask,
            scale: float, skip: Collection[tuple[int, int]] = (), q_kept: Kept = None,
            kv_kept: Kept = None) -> None:
    """`blocks.forward_tile` in one call: queries (x, q_x, out_acc, lse_acc), keys
    (y, k_y, v_y); q_kept / kv_kept as there."""
    if not queries or not keys:
        return
    s = _local_len(queries, 1, q_kept, kv_kept)
    tm = tile_mask(mask, [c[0] for c in queries], [c[0] for c in keys], s,
                   queries[0][1].device, skip, q_kept, kv_kept)
    if tm.empty:
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
    if not queries or not keys:
        return
    s = _local_len(queries, 2, q_kept, kv_kept)
    tm = tile_mask(mask, [c[0] for c in queries], [c[0] for c in keys], s,
                   queries[0][2].device, skip, q_kept, kv_kept)
    if tm.empty:
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
