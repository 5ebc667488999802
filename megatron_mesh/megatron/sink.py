"""Attention sinks in megatron-core's core-attention slot (`config.softmax_type`).

`MeshDotProductAttention` holds its `softmax_offset` as megatron-core's own
`DotProductAttention` (and Transformer Engine's `TEDotProductAttention`) do, so checkpoints
interchange with them:

- "vanilla": `softmax_offset` is None;
- "off-by-one": a plain tensor of zeros (not a parameter, not in the state dict);
- "learnable": a parameter `softmax_offset` [heads of this TP rank] of `params_dtype`,
  initialized by `config.init_method` (with `perform_initialization`), sharded over TP on
  axis 0 in the dist checkpoint, replicated over DP x CP.

The mesh takes it as a float32 [heads] tensor (`megatron_mesh/masks/sink.py`). A CP rank's
gradient is the partial of its query rows; megatron-core's DDP sums (averages) them over the
data x context parallel group, as for every dense weight. Unlike megatron-core's attention,
the parameter is marked tensor-parallel (axis 0), so the gradient norm for clipping counts
every TP rank's heads (megatron-core's counts only TP rank 0's).
"""
from __future__ import annotations

import torch
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")

__all__ = ["SOFTMAX_TYPES", "check_softmax_type", "init_softmax_offset", "mesh_offset",
           "offset_sharded_state_dict"]


def check_softmax_type(config: TransformerConfig) -> str:
    """config.softmax_type (megatron-core releases without it: 'vanilla'); ValueError naming
    the valid ones otherwise."""
    kind = getattr(config, "softmax_type", "vanilla")
    if kind not in SOFTMAX_TYPES:
        raise ValueError(f"softmax_type {kind!r}: valid values are {', '.join(SOFTMAX_TYPES)}")
    return kind


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_softmax_offset(module: torch.nn.Module, config: TransformerConfig,
                        heads: int) -> None:
    """Give `module` its `softmax_offset` for config.softmax_type over its `heads` (this TP
    rank's query heads), as megatron-core's DotProductAttention does."""
    kind = check_softmax_type(config)
    if kind == "vanilla":
        module.softmax_offset = None
    elif kind == "off-by-one":
        module.softmax_offset = torch.zeros(heads, device=_device(), dtype=config.params_dtype)
    else:
        param = torch.nn.Parameter(torch.empty(heads, device=_device(),
                                               dtype=config.params_dtype))
        set_tensor_model_parallel_attributes(param, is_parallel=True, dim=0, stride=1)
        module.register_parameter("softmax_offset", param)
        if config.perform_initialization:
            config.init_method(param.data)


def mesh_offset(offset: torch.Tensor | None) -> torch.Tensor | None:
    """The sink logits as the mesh takes them: float32 (differentiable for a parameter)."""
    return None if offset is None else offset.float()


def offset_sharded_state_dict(module: torch.nn.Module, config: TransformerConfig,
                              tp_group: torch.distributed.ProcessGroup, prefix: str,
                              sharded_offsets: tuple, metadata: dict | None) -> dict:
    """megatron-core's sharded state dict of a core attention: with a learnable softmax the
    module's state dict (`softmax_offset` sharded over TP on axis 0, an `_extra_state` as a
    ShardedObject), else nothing."""
    learnable = check_softmax_type(config) == "learnable"
    state = module.state_dict(prefix="", keep_vars=True) if learnable else {}
    from megatron.core import parallel_state

    dp_cp = (metadata or {}).get("dp_cp_group")
    if dp_cp is None:
        dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
    return make_sharded_tensors_for_checkpoint(state, prefix, {"softmax_offset": 0},
                                               sharded_offsets, tp_group=tp_group,
                                               dp_cp_group=dp_cp)
