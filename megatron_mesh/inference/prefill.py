"""Prefill: the prompts' attention through the mesh, forward only, and this rank's K / V
share written into its cache.

The prompts are right-padded to a common length S_pad, a multiple of 2P, and cut by
Megatron's zigzag (CP rank r holds sub-chunks r and 2P-1-r). Causal attention never lets a
real token see the padding after it, so the real rows are exact; the padding's cache slots
are marked EMPTY (`cache.KVShard.write_prefill`) so decode never sees them. The bytes per
rank are the forward's (`traffic.mesh_traffic(...).forward`), on any A x R x C grid.
"""
from __future__ import annotations

import torch

from ..attention import mesh_attention
from ..runtime.grid import MeshGrid
from .cache import KVShard


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: MeshGrid,
                      shard: KVShard, positions: torch.Tensor, lengths: torch.Tensor,
                      softmax_scale: float | None = None,
                      window_size: tuple[int, int] | None = None,
                      softmax_offset: torch.Tensor | None = None,
                      **options: object) -> torch.Tensor:
    """q [s, b, hq, d], k [s, b, hkv, d], v [s, b, hkv, dv]: this rank's zigzag share of
    the padded prompts at global `positions` [s]; `lengths` [b]: each prompt's real length
    -> out [s, b, hq, dv] (`mesh_attention`, causal, no autograd state kept). K / V go
    into `shard`. `options`: mesh_attention's (backend, schedule)."""
    with torch.no_grad():
        out = mesh_attention(q, k, v, grid, causal=True, softmax_scale=softmax_scale,
                             window_size=window_size, softmax_offset=softmax_offset,
                             **options)
    shard.write_prefill(k, v, positions, lengths)
    return out
