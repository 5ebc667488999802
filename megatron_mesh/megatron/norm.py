"""Layer norms for megatron-core's local layers that also work with sequence parallelism.

Without Transformer Engine or Apex, megatron-core's local spec builds its norms with
`WrappedTorchNorm` (torch's LayerNorm / RMSNorm), which refuses `sequence_parallel`. A norm
over the hidden dimension is per token, so it runs unchanged on a sequence shard
`[s / TP, b, h]`; what sequence parallelism changes is its weights' gradients: each TP rank
holds the sum over its own tokens only. `TorchNorm` marks the weights `sequence_parallel`,
which is how megatron-core's `finalize_model_grads` knows to all-reduce them over TP (what it
does for Transformer Engine's and Apex's norms).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)

__all__ = ["TorchNorm", "sequence_parallel_block_spec"]

_NORMS = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}


class TorchNorm:
    """torch's LayerNorm or RMSNorm (config.normalization) over `hidden_size`, its weights
    marked `sequence_parallel` when config.sequence_parallel is set."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5,
                **unused: Any) -> torch.nn.Module:
        if config.normalization not in _NORMS:
            raise ValueError(f"normalization {config.normalization!r}: valid with torch's "
                             f"norms are {', '.join(_NORMS)}")
        if config.layernorm_zero_centered_gamma:
            raise ValueError("layernorm_zero_centered_gamma needs Transformer Engine or Apex norms")
        norm = _NORMS[config.normalization](hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def _with_torch_norms(node: Any) -> Any:
    """A copy of a spec with every WrappedTorchNorm replaced by TorchNorm."""
    if node is WrappedTorchNorm:
        return TorchNorm
    if isinstance(node, ModuleSpec):
        return dataclasses.replace(node, module=_with_torch_norms(node.module),
                                   submodules=_with_torch_norms(node.submodules))
    if isinstance(node, (list, tuple)):
        return type(node)(_with_torch_norms(item) for item in node)
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return dataclasses.replace(node, **{
            f.name: _with_torch_norms(getattr(node, f.name)) for f in dataclasses.fields(node)
            if f.init})
    return node


def sequence_parallel_block_spec(layer_spec: ModuleSpec,
                                 config: TransformerConfig) -> TransformerBlockSubmodules:
    """The decoder block of this pipeline stage for a local layer spec, with TorchNorm in
    place of WrappedTorchNorm in its layers and as its final norm, so that it can run with
    `config.sequence_parallel`."""
    return TransformerBlockSubmodules(
        layer_specs=[_with_torch_norms(layer_spec)] * get_num_layers_to_build(config),
        layer_norm=TorchNorm,
    )
