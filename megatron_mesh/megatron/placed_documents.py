"""Placed documents through Megatron-Core: `PlacedSeqParams` and RoPE at placed positions.

A micro-batch of documents placed by `place_documents` (whole documents on one CP rank,
long ones zigzag over consecutive ranks, T / P tokens per rank, no padding per document)
reaches every layer as a `PlacedSeqParams`: Megatron's `PackedSeqParams` with qkv_format
"thd", the documents' cu_seqlens (int32, unpadded), max_seqlen the longest document, and the
`placement`, which `MeshDotProductAttention` takes; megatron-core reads the rest as of any
THD batch (max_seqlen for the RoPE table, cu_seqlens for RoPE).

RoPE: megatron-core's THD RoPE (`rope_utils._apply_rotary_pos_emb_thd`, 0.16 and 0.19)
assumes Transformer Engine's CP layout (2P pieces per document, rank r holding pieces r and
2P-1-r). Inside `placed_rope()` the attention modules' `apply_rotary_pos_emb` (SelfAttention's
and MLA's, the name each module imported) is replaced by one that, given a
`PlacedSeqParams`' cu_seqlens, applies megatron-core's own RoPE row-wise (its sbhd path) at
each local row's position within its document; any other call goes through unchanged.
`MeshDotProductAttention` refuses a `PlacedSeqParams` outside `placed_rope()`, so RoPE at
the wrong positions cannot pass silently.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_mesh.masks.document_placement import DocumentPlacement
from megatron_mesh.megatron.rope import POSITIONS as _POSITIONS
from megatron_mesh.megatron.rope import placed_apply_rotary_pos_emb

__all__ = ["PLACED_ROPE_PATCHES", "PlacedSeqParams", "placed_apply_rotary_pos_emb",
           "placed_rope", "placed_rope_active", "placed_seq_params", "placement_of",
           "row_positions"]

# placed_seq_params stamps its cu_seqlens tensor with the host values it was built from, so
# PlacedSeqParams checks them without copying the (device) tensor back to the host
_HOST_CU = "_mesh_host_cu_seqlens"

# the attention modules' own name for megatron-core's RoPE (each imported it by name)
PLACED_ROPE_PATCHES = ("megatron.core.transformer.attention.apply_rotary_pos_emb",
                       "megatron.core.transformer.multi_latent_attention.apply_rotary_pos_emb")


@dataclass
class PlacedSeqParams(PackedSeqParams):
    """Megatron's PackedSeqParams for documents placed by `place_documents`: qkv_format
    "thd", cu_seqlens_q = cu_seqlens_kv = the documents' cumulative lengths (int32, no
    padded ones), and `placement`, the same on every CP rank. Build it with
    `placed_seq_params` (which also gives RoPE this rank's positions)."""

    placement: DocumentPlacement | None = None

    def __post_init__(self) -> None:
        parent = getattr(super(), "__post_init__", None)  # megatron-core 0.19 has one
        if parent is not None:
            parent()
        if not isinstance(self.placement, DocumentPlacement):
            raise ValueError("PlacedSeqParams.placement must be a DocumentPlacement (from "
                             f"place_documents), got {type(self.placement).__name__}")
        if self.qkv_format != "thd":
            raise ValueError(f"PlacedSeqParams.qkv_format={self.qkv_format!r}: placed "
                             "documents are packed sequences, 'thd'")
        if self.cu_seqlens_q_padded is not None or self.cu_seqlens_kv_padded is not None:
            raise ValueError("PlacedSeqParams with cu_seqlens_*_padded: placed documents are "
                             "not padded per document")
        for side in ("q", "kv"):
            cu = getattr(self, f"cu_seqlens_{side}")
            if cu is None or not _same_cu(cu, self.placement.cu_seqlens):
                raise ValueError(f"PlacedSeqParams.cu_seqlens_{side} must be the placement's "
                                 f"documents {list(self.placement.cu_seqlens)[:8]}...")


def _same_cu(cu: torch.Tensor, expected: tuple[int, ...]) -> bool:
    """Whether `cu` holds `expected`: from the host values placed_seq_params stamped on it
    (no device-to-host copy on the hot path), else (a hand-built tensor) from its values."""
    host = getattr(cu, _HOST_CU, None)
    if host is not None:
        return host is expected or host == expected
    return tuple(cu.tolist()) == expected


def row_positions(placement: DocumentPlacement, rank: int) -> torch.Tensor:
    """int64 [T / P]: each of `rank`'s local rows' position within its document."""
    runs = placement.runs[rank]
    if not runs:
        return torch.zeros(0, dtype=torch.int64)
    return torch.cat([torch.arange(first, first + n, dtype=torch.int64)
                      for _, first, n in runs])


def placed_seq_params(placement: DocumentPlacement, cp_rank: int,
                      device: torch.device | str = "cpu") -> PlacedSeqParams:
    """The PlacedSeqParams of `placement` on CP rank `cp_rank`, its tensors on `device`;
    its cu_seqlens carry this rank's row positions for `placed_rope()`."""
    cu = torch.tensor(placement.cu_seqlens, dtype=torch.int32, device=device)
    setattr(cu, _POSITIONS, row_positions(placement, cp_rank).to(device))
    setattr(cu, _HOST_CU, placement.cu_seqlens)  # built from these: checked on the host
    longest = max(placement.lengths)
    return PlacedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=longest, max_seqlen_kv=longest, placement=placement)


def placement_of(params: PackedSeqParams | None, config: object | None = None
                 ) -> DocumentPlacement | None:
    """The placement a PackedSeqParams carries (None for plain THD documents or none);
    refuses what would rotate placed rows at the wrong positions."""
    if isinstance(params, PlacedSeqParams):
        if (getattr(config, "multi_latent_attention", False)
                and getattr(config, "apply_rope_fusion", False)):
            raise ValueError(
                "PlacedSeqParams with multi-latent attention and apply_rope_fusion: Transformer "
                "Engine's fused MLA RoPE assumes its own CP layout; set apply_rope_fusion=False")
        if not placed_rope_active():
            raise RuntimeError(
                "PlacedSeqParams outside megatron_mesh.megatron.placed_documents.placed_rope(): "
                "megatron-core's THD RoPE would rotate the placed rows at Transformer "
                "Engine's CP positions; run the model inside `with placed_rope():`")
        return params.placement
    return None


def placed_rope_active() -> bool:
    """Whether `placed_rope()` is in force (SelfAttention's RoPE is the placed one)."""
    import megatron.core.transformer.attention as attention

    return attention.apply_rotary_pos_emb is placed_apply_rotary_pos_emb


@contextlib.contextmanager
def placed_rope() -> Iterator[None]:
    """Within the block, SelfAttention's and MLA's RoPE take PlacedSeqParams (module
    docstring); nested uses are fine."""
    from megatron_mesh.megatron.patches import patched

    if placed_rope_active():
        yield
        return
    with patched(*PLACED_ROPE_PATCHES):
        yield
