"""One rank-block's kernel calls, shared by every schedule."""
from __future__ import annotations

from typing import Sequence

import torch

from ..kernels import TileKernel
from ..masks.layout import AttentionMask, block_for
from ..runtime.flat import flat_size, views
from .merge import merge_into


def rows(t: torch.Tensor, index: slice | torch.Tensor, dim: int = 0) -> torch.Tensor:
    """The block's rows of t along `dim`: a view for a slice, a gathered copy for an
    index tensor (packed documents)."""
    if isinstance(index, slice):
        return t[(slice(None),) * (dim % t.dim()) + (index,)]
    return t.index_select(dim, index)


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
    for blk in block_for(x, y, q_x.shape[0], mask, q_x.device).calls:
        kv = blk.kv_rows
        out, lse = kernel.forward(rows(q_x, blk.q_rows), rows(k_y, kv), rows(v_y, kv),
                                  blk.causal, scale, segments=blk.segments, mask=blk.mask)
        if isinstance(blk.q_rows, slice):
            merge_into(out_acc, lse_acc, out, lse, blk.q_rows)
            continue
        acc_out, acc_lse = rows(out_acc, blk.q_rows), rows(lse_acc, blk.q_rows, -1)
        merge_into(acc_out, acc_lse, out, lse)
        out_acc.index_copy_(0, blk.q_rows, acc_out)
        lse_acc.index_copy_(-1, blk.q_rows, acc_lse)


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
    for blk in block_for(x, y, q_x.shape[0], mask, q_x.device).calls:
        q_rows, kv_rows = blk.q_rows, blk.kv_rows
        dq, dk, dv = kernel.backward(
            rows(dout_x, q_rows), rows(q_x, q_rows), rows(k_y, kv_rows), rows(v_y, kv_rows),
            rows(out_x, q_rows), rows(lse_x, q_rows, -1), blk.causal, scale,
            segments=blk.segments, mask=blk.mask,
        )
        _add_rows(dq_acc, q_rows, dq)
        _add_rows(dkv_acc[0], kv_rows, dk)
        _add_rows(dkv_acc[1], kv_rows, dv)


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

