"""The kernel calls of the blocks a rank has on hand, shared by every schedule: grouped
into few calls (`calls.groups`), their results merged (forward) or added (backward) into
each chunk's fp32 accumulators."""
from __future__ import annotations

from typing import Collection, Sequence

import torch

from ..calls.groups import Call, Piece, group_calls
from ..calls.layout import AttentionMask, blocks_for
from ..common.caches import per_documents
from ..common.merge import merge_into
from ..cost_models.tile_calls import group_tokens, grouping
from ..kernels import TileKernel
from ..kernels.base import folds_diagonal
from ..runtime.flat import flat_size, views
from ..runtime.grid import MeshGrid
from . import whole_tile
from .kept_rows import KeptRows


def rows(t: torch.Tensor, index: slice | torch.Tensor, dim: int = 0) -> torch.Tensor:
    """The block's rows of t along `dim`: a view for a slice, a gathered copy for an
    index tensor (packed documents)."""
    if isinstance(index, slice):
        return t[(slice(None),) * (dim % t.dim()) + (index,)]
    return t.index_select(dim, index)


QueryChunk = tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]  # (x, q_x, out_acc, lse_acc)
KeyChunk = tuple[int, torch.Tensor, torch.Tensor]  # (y, k_y, v_y)
# (x, dout_x, q_x, out_x, lse_x, dq_acc) and (y, k_y, v_y, (dk_acc, dv_acc))
GradQueryChunk = tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
GradKeyChunk = tuple[int, torch.Tensor, torch.Tensor, Sequence[torch.Tensor]]
# per chunk, the rows it holds when it holds only some of them, packed (None: all)
Kept = Sequence[KeptRows | None] | None


def _at(kept: Kept, piece: Piece) -> slice | torch.Tensor:
    """The piece's rows in its chunk's tensors (packed where the chunk keeps some rows)."""
    held = None if kept is None else kept[piece.chunk]
    return piece.rows if held is None else held(piece.rows)


def tile_calls(kernel: TileKernel, xs: Sequence[int], ys: Sequence[int], q: torch.Tensor,
               mask: AttentionMask, skip: Collection[tuple[int, int]] = (),
               grouped: bool | None = None, local_len: int | None = None) -> tuple[Call, ...]:
    """The kernel calls computing blocks (x, y) for x in `xs`, y in `ys`, but those in
    `skip`, grouped (`groups.group_calls`; a causal diagonal folded in where
    `folds_diagonal(kernel, q)`; at most `cost_models.tile_calls.group_tokens()` keys or query
    rows concatenated per call) unless `cost_models.tile_calls.grouping(grouped)` says not,
    else each block's own; pieces index xs and ys. q [s, b, hq, d]: one query chunk
    (local_len: the chunk's rows where q holds only some of them)."""
    s = q.shape[0] if local_len is None else local_len
    return _tile_calls(mask, tuple(xs), tuple(ys), s, q.device, frozenset(skip),
                       folds_diagonal(kernel, q), grouping(grouped), group_tokens())


def plan_blocks(mask: AttentionMask, grid: MeshGrid, local_len: int,
                device: torch.device | str = "cpu") -> None:
    """Make this rank's blocks of a micro-batch ahead of its first layer (its row's query
    chunks against its column's K/V chunks, all in one array pass): the layers' tiles then
    find them in the caches (`layout.blocks_for`). The driver calls it once per micro-batch
    (`megatron.core_attention.plan_micro_batch`). `local_len`: rows of one chunk after the
    heads all-to-all (A x tokens per rank); `mask.ranks`: R x C."""
    blocks_for([(x, y) for x in grid.row_mesh_ranks for y in grid.col_mesh_ranks], local_len,
               mask, device)


# a layer's tiles: every layer and both passes of a micro-batch take the same calls; with
# documents for the last few micro-batches only (`caches.py`)
@per_documents(lambda mask, *_: mask.packing)
def _tile_calls(mask: AttentionMask, xs: tuple[int, ...], ys: tuple[int, ...], local_len: int,
                device: torch.device, skip: frozenset, bottom_right: bool, grouped: bool,
                limit: int | None) -> tuple[Call, ...]:
    pairs = [(qi, ki) for qi, x in enumerate(xs) for ki, y in enumerate(ys)
             if (x, y) not in skip]
    made = blocks_for([(xs[qi], ys[ki]) for qi, ki in pairs], local_len, mask, device)
    blocks = [(qi, ki, block) for (qi, ki), block in zip(pairs, made)]
    return tuple(group_calls(blocks, bottom_right, grouped, limit))


def _cat(parts: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def _gather(chunks: Sequence, i: int, pieces: Sequence[Piece], place: torch.Tensor | None,
            dim: int = 0, kept: Kept = None) -> torch.Tensor:
    """A call's rows along `dim` of tensor `i` of the chunks its pieces index: the pieces
    concatenated, or each copied to its place in the call (documents joined:
    `groups.Call.q_place` / `kv_place`), one copy either way."""
    parts = [rows(chunks[p.chunk][i], _at(kept, p), dim) for p in pieces]
    if place is None:
        return _cat(parts, dim)
    dim %= parts[0].dim()
    shape = list(parts[0].shape)
    shape[dim] = sum(t.shape[dim] for t in parts)
    out = parts[0].new_empty(shape)
    offset = 0
    for t in parts:
        n = t.shape[dim]
        out.index_copy_(dim, place[offset:offset + n], t)
        offset += n
    return out


def _back(t: torch.Tensor, place: torch.Tensor | None, dim: int = 0) -> torch.Tensor:
    """A call's result rows (along dim) in the order of its pieces concatenated."""
    return t if place is None else t.index_select(dim, place)


def _pieces(t: torch.Tensor, pieces: Sequence[Piece], dim: int = 0):
    """(piece, its rows of t along dim) for consecutive pieces of a call's result t."""
    offset = 0
    for p in pieces:
        n = p.size
        yield p, t.narrow(dim % t.dim(), offset, n)
        offset += n


def _calls_of(kernel: TileKernel, queries: Sequence[tuple], keys: Sequence[tuple],
              q_field: int, mask: AttentionMask, skip: Collection[tuple[int, int]],
              grouped: bool | None, q_kept: Kept = None) -> Sequence:
    """The kernel calls of the blocks of `queries` x `keys` but `skip` (`tile_calls`; none
    without a query or a key chunk); q_field: where a query chunk holds its q tensor."""
    if not queries or not keys:
        return ()
    held = next((kept for kept in q_kept or () if kept is not None), None)
    return tile_calls(kernel, [c[0] for c in queries], [c[0] for c in keys],
                      queries[0][q_field], mask, skip, grouped,
                      None if held is None else held.local_len)


def forward_tile(kernel: TileKernel, queries: Sequence[QueryChunk], keys: Sequence[KeyChunk],
                 mask: AttentionMask, scale: float,
                 skip: Collection[tuple[int, int]] = (), grouped: bool | None = None,
                 q_kept: Kept = None, kv_kept: Kept = None) -> None:
    """Blocks (x, y) of the query chunks q_x [s, b, hq, d] against the key chunks
    k_y [s, b, hkv, d], v_y [s, b, hkv, dv] on hand, but those in `skip`, in few kernel
    calls (`groups.group_calls`), merged into each x's fp32 accumulators out_acc
    [s, b, hq, dv] and lse_acc [b, hq, s]; in one call where the kernel takes whole tiles
    (`whole_tile`). q_kept / kv_kept: per chunk, its `KeptRows` where it holds only those
    rows, packed (its s is then len(kept))."""
    if whole_tile.takes_whole_tiles(kernel):
        return whole_tile.forward(kernel, queries, keys, mask, scale, skip, q_kept, kv_kept)
    for call in _calls_of(kernel, queries, keys, 1, mask, skip, grouped, q_kept):
        q = _gather(queries, 1, call.q, call.q_place, kept=q_kept)
        k, v = (_gather(keys, i, call.kv, call.kv_place, kept=kv_kept) for i in (1, 2))
        out, lse = kernel.forward(q, k, v, call.causal, scale, slices=call.slices)
        del q, k, v
        out, lse = _back(out, call.q_place), _back(lse, call.q_place, -1)
        for (p, out_part), (_, lse_part) in zip(_pieces(out, call.q), _pieces(lse, call.q, -1)):
            _merge_rows(*queries[p.chunk][2:], out_part, lse_part, _at(q_kept, p))
        del out, lse, out_part, lse_part  # not held while the next call runs


def _merge_rows(out_acc: torch.Tensor, lse_acc: torch.Tensor, out: torch.Tensor,
                lse: torch.Tensor, index: slice | torch.Tensor) -> None:
    """Merge a partial of rows `index` into the accumulators (`merge.merge_into`)."""
    if isinstance(index, slice):
        merge_into(out_acc, lse_acc, out, lse, index)
        return
    acc_out, acc_lse = rows(out_acc, index), rows(lse_acc, index, -1)
    merge_into(acc_out, acc_lse, out, lse)
    out_acc.index_copy_(0, index, acc_out)
    lse_acc.index_copy_(-1, index, acc_lse)


def forward_block(
    kernel: TileKernel,
    q_x: torch.Tensor,
    k_y: torch.Tensor,
    v_y: torch.Tensor,
    x: int,
    y: int,
    mask: AttentionMask,
    scale: float,
    out_acc: torch.Tensor,
    lse_acc: torch.Tensor,
) -> None:
    """Attention of Q(x) [s, b, hq, d] over K/V(y) [s, b, hkv, d], merged into x's fp32
    accumulators out_acc [s, b, hq, d] and lse_acc [b, hq, s]."""
    forward_tile(kernel, [(x, q_x, out_acc, lse_acc)], [(y, k_y, v_y)], mask, scale)


def backward_tile(kernel: TileKernel, queries: Sequence[GradQueryChunk],
                  keys: Sequence[GradKeyChunk], mask: AttentionMask, scale: float,
                  skip: Collection[tuple[int, int]] = (), grouped: bool | None = None,
                  q_kept: Kept = None, kv_kept: Kept = None) -> None:
    """Gradients of blocks (x, y) (as `forward_tile`) added (fp32) into each x's dq_acc
    [s, b, hq, d] and each y's (dk_acc [s, b, hkv, d], dv_acc [s, b, hkv, dv])
    (`kv_grads`). out_x / lse_x are x's whole-row output (or a stand-in with the same D)
    and lse; q_kept / kv_kept as in `forward_tile`. In one call where the kernel takes
    whole tiles (`whole_tile`)."""
    if whole_tile.takes_whole_tiles(kernel):
        return whole_tile.backward(kernel, queries, keys, mask, scale, skip, q_kept, kv_kept)
    for call in _calls_of(kernel, queries, keys, 2, mask, skip, grouped, q_kept):
        dout, q, out = (_gather(queries, i, call.q, call.q_place, kept=q_kept)
                        for i in (1, 2, 3))
        lse = _gather(queries, 4, call.q, call.q_place, -1, q_kept)
        k, v = (_gather(keys, i, call.kv, call.kv_place, kept=kv_kept) for i in (1, 2))
        dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, call.causal, scale,
                                     slices=call.slices)
        del dout, q, out, lse, k, v
        dq = _back(dq, call.q_place)
        dk, dv = _back(dk, call.kv_place), _back(dv, call.kv_place)
        for p, part in _pieces(dq, call.q):
            _add_rows(queries[p.chunk][5], _at(q_kept, p), part)
        del dq, part
        for grad, i in ((dk, 0), (dv, 1)):
            for p, part in _pieces(grad, call.kv):
                _add_rows(keys[p.chunk][3][i], _at(kv_kept, p), part)
        del dk, dv, grad, part  # not held while the next call runs


def backward_block(
    kernel: TileKernel,
    dout_x: torch.Tensor,
    q_x: torch.Tensor,
    out_x: torch.Tensor,
    lse_x: torch.Tensor,
    k_y: torch.Tensor,
    v_y: torch.Tensor,
    x: int,
    y: int,
    mask: AttentionMask,
    scale: float,
    dq_acc: torch.Tensor,
    dkv_acc: Sequence[torch.Tensor],
) -> None:
    """Gradients of block (x, y) added (fp32) into dq_acc [s, b, hq, d] of x and
    dkv_acc = (dk [s, b, hkv, d], dv [s, b, hkv, dv]) of y (`kv_grads`). out_x / lse_x
    are x's whole-row output (or a stand-in with the same D) and lse."""
    backward_tile(kernel, [(x, dout_x, q_x, out_x, lse_x, dq_acc)], [(y, k_y, v_y, dkv_acc)],
                  mask, scale)


def _add_rows(acc: torch.Tensor, index: slice | torch.Tensor, t: torch.Tensor) -> None:
    """acc[index] += t along dim 0 (index: a slice, or an index tensor)."""
    if isinstance(index, slice):
        acc[index] += t
    else:
        acc.index_add_(0, index, t.to(acc.dtype))


def kv_grads(flat: torch.Tensor, k: torch.Tensor, v: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dk, dv) views of one K/V chunk's flat gradient buffer [|k| + |v|] (V may have its
    own head dim)."""
    return views(flat, (k.shape, v.shape))


def kv_grad_buffer(k: torch.Tensor, v: torch.Tensor, chunks: int | None = None
                   ) -> torch.Tensor:
    """Zero fp32 gradient buffer of one K/V chunk, flat [|k| + |v|], or [chunks, |k| + |v|]."""
    n = flat_size((k.shape, v.shape))
    shape = (n,) if chunks is None else (chunks, n)
    return torch.zeros(shape, dtype=torch.float32, device=k.device)


def split_kv_grads(flat: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """dk, dv in k's and v's dtypes from a flat gradient buffer of their chunk."""
    dk, dv = kv_grads(flat.reshape(-1), k, v)
    return dk.to(k.dtype), dv.to(v.dtype)

