"""RoPE at each placed row's position: the stand-in for the attention modules'
`apply_rotary_pos_emb` (a leaf module: the patch registry and `placement.py` import it).

`placement.placed_seq_params` sets `POSITIONS` on the cu_seqlens tensor of a
`PlacedSeqParams`: each local row's position within its document. A call with that tensor
as cu_seqlens runs megatron-core's sbhd RoPE row by row at those positions; any other call
is megatron-core's `apply_rotary_pos_emb` unchanged.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

POSITIONS = "_mesh_placed_positions"  # the cu_seqlens tensor's attribute


@functools.lru_cache(maxsize=4)
def _signature(function: Any) -> inspect.Signature:
    """`function`'s signature, read once."""
    return inspect.signature(function)


def placed_apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, *args: Any,
                                **kwargs: Any) -> torch.Tensor:
    """megatron-core's `apply_rotary_pos_emb`; for the cu_seqlens of a PlacedSeqParams, its
    sbhd path row by row: t [t, h, d] with freqs [max_s, 1, 1, d] gathered at each row's
    position within its document."""
    from megatron.core.models.common.embeddings import rope_utils

    original = rope_utils.apply_rotary_pos_emb
    # megatron-core passes cu_seqlens by keyword; (t, freqs, config, cu_seqlens, ...) else
    cu = kwargs.get("cu_seqlens", args[1] if len(args) > 1 else None)
    positions = getattr(cu, POSITIONS, None)
    if positions is None:  # not placed: megatron-core's RoPE at once
        return original(t, freqs, *args, **kwargs)
    bound = _signature(original).bind(t, freqs, *args, **kwargs)
    if positions.numel() != t.shape[0]:
        raise ValueError(f"placed RoPE: {t.shape[0]} rows, but the placement gives this rank "
                         f"{positions.numel()}")
    bound.arguments["cu_seqlens"] = None
    bound.arguments["t"] = t.unsqueeze(1)
    bound.arguments["freqs"] = freqs.index_select(0, positions.to(freqs.device))
    return original(*bound.args, **bound.kwargs).squeeze(1)
