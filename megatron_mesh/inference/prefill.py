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
from ..masks.mask import Mask, as_attention_mask
from ..masks.slices import SliceMask
from ..runtime.grid import MeshGrid
from .cache import KVShard


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: MeshGrid,
                      shard: KVShard, positions: torch.Tensor, lengths: torch.Tensor,
                      softmax_scale: float | None = None,
                      window_size: tuple[int, int] | None = None,
                      softmax_offset: torch.Tensor | None = None,
                      attention_mask: Mask | SliceMask | None = None,
                      **options: object) -> torch.Tensor:
    """q [s, b, hq, d], k [s, b, hkv, d], v [s, b, hkv, dv]: this rank's zigzag share of
    the padded prompts at global `positions` [s]; `lengths` [b]: each prompt's real length
    -> out [s, b, hq, dv] (`mesh_attention`, causal, no autograd state kept). K / V go
    into `shard`. `attention_mask`: the model's mask over the whole generated sequence (a
    bidirectional prefix, say; decode reads the same value), run on the prompts' positions
    (`Mask.leading`); it must not let a real token see a later prompt's padding.
    `options`: mesh_attention's (backend, schedule)."""
    if attention_mask is None:
        masks = dict(causal=True)
    else:
        masks = dict(mask=as_attention_mask(attention_mask).leading(q.shape[0] * grid.cp_size))
    with torch.no_grad():
        out = mesh_attention(q, k, v, grid, softmax_scale=softmax_scale,
                             window_size=window_size, softmax_offset=softmax_offset,
                             **masks, **options)
    shard.write_prefill(k, v, positions, lengths)
    return out
