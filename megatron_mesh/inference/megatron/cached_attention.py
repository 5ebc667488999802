"""Megatron-Core's core-attention slot for generation: the mesh with a sharded KV cache.

`CachedMeshAttention` is `MeshDotProductAttention` (same constructor, checks and state-dict
keys, so a training checkpoint loads into it) whose forward, while a generation session is
attached (`attach`), hands q / k / v to the session (`inference.InferenceSession`):
prefill through the mesh writing the cache, or a decode step over the sharded cache.
Without a session it is the training module. A chunked layer (`attention_chunk_size`) runs
the session with its chunks as the mask: prefill on the prompts, decode a row per token.
`CachedMeshAttentionInTEState` is the same over `MeshDotProductAttentionInTEState`, for
models whose training spec kept a Transformer Engine attention's `_extra_state`:
`cached_attention_spec` takes the one matching the spec.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_mesh.inference.session import InferenceSession
from megatron_mesh.masks.chunked import chunked_mask
from megatron_mesh.masks.slices import SliceMask
from megatron_mesh.megatron.core_attention import (
    MeshDotProductAttention,
    MeshDotProductAttentionInTEState,
)
from megatron_mesh.megatron.sink import mesh_offset


class _CachedForward:
    """The forward of a mesh core attention with an optional `InferenceSession`."""

    session: InferenceSession | None = None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: Any = None,
                attention_bias: torch.Tensor | None = None,
                packed_seq_params: Any = None) -> torch.Tensor:
        """q [s, b, np, hn], k / v [s, b, ng, hn] -> [s, b, np * hv]; with a session, s is
        this rank's prompt share (prefill) or 1 (a decode step)."""
        if self.session is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type,
                                   attention_bias, packed_seq_params)
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("generation runs dense prompts without attention_bias")
        session, model_mask = self.session, self.session.attention_mask
        if self.chunk is not None:  # this layer's chunks, over the whole generated sequence
            session.attention_mask = self._chunks(session)
        try:
            out = session.attend(self.layer_number, query, key, value, self.grid,
                                 self.softmax_scale, self.window_size,
                                 mesh_offset(self.softmax_offset))  # the sinks, if any
        finally:
            session.attention_mask = model_mask
        return out.reshape(out.shape[0], out.shape[1], -1)

    def _chunks(self, session: InferenceSession) -> SliceMask:
        """This chunked layer's mask over the session's prompts and new tokens (positions
        0 .. prompt length + room), which prefill runs on the prompts and decode reads a row
        of; ValueError where the session brings a mask or packed prompts."""
        if session.attention_mask is not None or session.placement is not None:
            what = "packed prompts" if session.placement is not None else "a mask"
            raise ValueError(f"layer {self.layer_number} is chunked (attention_chunk_size="
                             f"{self.chunk}) and the session has {what}; generate dense "
                             "prompts without attention_mask")
        layout = session.layout
        return chunked_mask(layout.prompt_len + layout.max_new, self.chunk)


class CachedMeshAttention(_CachedForward, MeshDotProductAttention):
    """The mesh core attention with an optional `InferenceSession`."""


class CachedMeshAttentionInTEState(_CachedForward, MeshDotProductAttentionInTEState):
    """The same, keeping a TE attention's `_extra_state` as it was loaded."""


def attach(model: torch.nn.Module, session: InferenceSession | None) -> int:
    """Give every CachedMeshAttention of `model` the session (None detaches); returns how
    many there are."""
    layers = [m for m in model.modules() if isinstance(m, _CachedForward)]
    for m in layers:
        m.session = session
    return len(layers)


def cached_attention_spec(spec: Any) -> Any:
    """A copy of a GPT layer spec whose core attention is CachedMeshAttention (the mesh
    options of the spec's own mesh attention kept)."""
    from megatron_mesh.megatron.spec import _replace

    params = {**(_mesh_params(spec) or {}), "context_parallel_algo": "mesh"}
    module = (CachedMeshAttentionInTEState
              if issubclass(_core_module(spec) or object, MeshDotProductAttentionInTEState)
              else CachedMeshAttention)
    return _replace(spec, ModuleSpec(module=module, params=params))[0]


def _core_spec(node: Any) -> ModuleSpec | None:
    """The first core_attention ModuleSpec in a spec (None: none)."""
    if isinstance(node, ModuleSpec):
        return _core_spec(node.submodules)
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        for f in dataclasses.fields(node):
            value = getattr(node, f.name)
            if f.name == "core_attention" and isinstance(value, ModuleSpec):
                return value
            found = _core_spec(value)
            if found is not None:
                return found
    return None


def _core_module(node: Any) -> type | None:
    """The module class of the first core_attention ModuleSpec in a spec (None: none)."""
    spec = _core_spec(node)
    return spec.module if spec is not None and isinstance(spec.module, type) else None


def _mesh_params(node: Any) -> dict | None:
    """The params of the first core_attention ModuleSpec in a spec (None: none found)."""
    spec = _core_spec(node)
    if spec is None:
        return None
    return {k: v for k, v in (spec.params or {}).items()
            if k in ("backend", "schedule", "attention_chunk_size")}
