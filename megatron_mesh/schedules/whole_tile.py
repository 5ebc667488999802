"""The blocks a rank has on hand together as ONE kernel call, for kernels that declare
`whole_tile` (`kernels/flex.py`): the query chunks concatenated against the K/V chunks
concatenated (a view where the chunks lie one after another in one buffer, as a gathered
column does; else one copy of each), with the tile's mask (`flex.TileMask`) made from the
blocks' own calls (`calls.layout.blocks_for`: every mask kind), block by block where a
chunk is a whole number of FlexAttention's blocks (else through a mask of the tile's size),
and kept per micro-batch like the grouped calls (`blocks._tile_calls`). Blocks in `skip`
are left out of the mask.

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


def takes_whole_tiles(kernel: object) -> bool:
    """Whether `kernel` takes the blocks on hand together as one call (`caps.whole_tile`)."""
    return caps_of(kernel).whole_tile


def tile_mask(mask: AttentionMask, xs: Sequence[int], ys: Sequence[int], local_len: int,
              device: torch.device, skip: Collection[tuple[int, int]] = ()) -> TileMask:
    """The pairs of query chunks `xs` (concatenated, `local_len` rows each) against key
    chunks `ys` (likewise) the blocks (x, y) not in `skip` keep."""
    return _tile_mask(mask, tuple(xs), tuple(ys), local_len, torch.device(device),
                      frozenset(skip))


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
    """bool [local_len, local_len]: the pairs of a block's calls, in its chunks' rows."""
    seen = torch.zeros(local_len, local_len, dtype=torch.bool, device=device)
    for call in block.calls:
        rows, keys = _index(call.q_rows, device), _index(call.kv_rows, device)
        seen[rows[:, None], keys[None, :]] |= call.seen().to(device)
    return seen


def _index(rows: slice | torch.Tensor, device: torch.device) -> torch.Tensor:
    if isinstance(rows, slice):
        return torch.arange(rows.start, rows.stop, device=device)
    return rows.to(device)


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


def _chunks(t: torch.Tensor, n: int, dim: int = 0):
    return t.chunk(n, dim) if n > 1 else (t,)


def forward(kernel, queries: Sequence[tuple], keys: Sequence[tuple], mask: AttentionMask,
            scale: float, skip: Collection[tuple[int, int]] = ()) -> None:
    """`blocks.forward_tile` in one call: queries (x, q_x, out_acc, lse_acc), keys
    (y, k_y, v_y)."""
    if not queries or not keys:
        return
    s = queries[0][1].shape[0]
    tm = tile_mask(mask, [c[0] for c in queries], [c[0] for c in keys], s,
                   queries[0][1].device, skip)
    if tm.empty:
        return
    q = joined([c[1] for c in queries])
    k, v = (joined([c[i] for c in keys]) for i in (1, 2))
    out, lse = kernel.tile_forward(q, k, v, tm, scale)
    del q, k, v
    n = len(queries)
    for c, o, lse_part in zip(queries, _chunks(out, n), _chunks(lse, n, -1)):
        merge_into(c[2], c[3], o, lse_part)


def backward(kernel, queries: Sequence[tuple], keys: Sequence[tuple], mask: AttentionMask,
             scale: float, skip: Collection[tuple[int, int]] = ()) -> None:
    """`blocks.backward_tile` in one call: queries (x, dout_x, q_x, out_x, lse_x, dq_acc),
    keys (y, k_y, v_y, (dk_acc, dv_acc))."""
    if not queries or not keys:
        return
    s = queries[0][2].shape[0]
    tm = tile_mask(mask, [c[0] for c in queries], [c[0] for c in keys], s,
                   queries[0][2].device, skip)
    if tm.empty:
        return
    dout, q, out = (joined([c[i] for c in queries]) for i in (1, 2, 3))
    lse = joined([c[4] for c in queries], -1)
    k, v = (joined([c[i] for c in keys]) for i in (1, 2))
    dq, dk, dv = kernel.tile_backward(dout, q, k, v, out, lse, tm, scale)
    del dout, q, out, lse, k, v
    for c, part in zip(queries, _chunks(dq, len(queries))):
        c[5].add_(part)
    m = len(keys)
    for c, gk, gv in zip(keys, _chunks(dk, m), _chunks(dv, m)):
        c[3][0].add_(gk)
        c[3][1].add_(gv)
