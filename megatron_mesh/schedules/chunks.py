"""What every runner hands to `blocks` the same way: its own diagonal block, run first
while the other chunks travel, and its column's key chunks."""
from __future__ import annotations

from typing import Sequence

import torch

from ..calls.layout import AttentionMask
from ..kernels import TileKernel
from ..runtime.grid import MeshGrid
from .blocks import GradKeyChunk, KeyChunk, backward_block, forward_block, kv_grads

KV = Sequence[torch.Tensor]  # (k_y [s, b, hkv, d], v_y [s, b, hkv, dv])


def diagonal_forward(kernel: TileKernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     grid: MeshGrid, mask: AttentionMask, scale: float,
                     out_acc: torch.Tensor, lse_acc: torch.Tensor) -> None:
    """This rank's own block (me, me), which needs nothing from anyone, merged into its fp32
    accumulators out_acc [s, b, hq, dv] and lse_acc [b, hq, s]."""
    me = grid.mesh_rank
    forward_block(kernel, q, k, v, me, me, mask, scale, out_acc, lse_acc)


def diagonal_backward(kernel: TileKernel, dout: torch.Tensor, q: torch.Tensor, out: torch.Tensor,
                      lse: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: MeshGrid,
                      mask: AttentionMask, scale: float, dq_acc: torch.Tensor,
                      dkv_flat: torch.Tensor) -> None:
    """Gradients of this rank's own block (me, me) added (fp32) into dq_acc [s, b, hq, d]
    and the flat dK, dV buffer of its own K/V chunk (`blocks.kv_grads`)."""
    me = grid.mesh_rank
    backward_block(kernel, dout, q, out, lse, k, v, me, me, mask, scale, dq_acc,
                   kv_grads(dkv_flat, k, v))


def column_keys(grid: MeshGrid, kv: Sequence[KV]) -> list[KeyChunk]:
    """The column's key chunks (y, k_y, v_y), from kv[i] = (k, v) of column member i."""
    return [(y, kv[i][0], kv[i][1]) for i, y in enumerate(grid.col_mesh_ranks)]


def column_grad_keys(grid: MeshGrid, kv: Sequence[KV], dkv_part: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> list[GradKeyChunk]:
    """The column's key chunks with their gradients (y, k_y, v_y, (dk_y, dv_y)), from
    kv[i] = (k, v) of column member i and dkv_part [R, |k| + |v|] (`blocks.kv_grad_buffer`)."""
    return [(y, kv[i][0], kv[i][1], kv_grads(dkv_part[i], k, v))
            for i, y in enumerate(grid.col_mesh_ranks)]
