"""GPT layer specs whose core attention runs the chosen context-parallel algorithm.

The spec chooses the class, once: `MeshDotProductAttention` for 'mesh' (carrying the
algorithm in `params={'context_parallel_algo': ...}`, so the layer needs nothing else from
TransformerConfig), Megatron's `TEDotProductAttention` with `cp_comm_type` for the others.
Without Transformer Engine the others keep `MeshDotProductAttention`, which is plain
attention at CP = 1 and names the missing package at CP > 1.
`TransformerConfig(cp_comm_type='mesh')` also selects the mesh for a spec that names
`MeshDotProductAttention` without params. `grid` (what `initialize_mesh_grids` returned)
goes to the layers in the params, as megatron-core hands them `pg_collection`; without it a
layer takes the grid built for its CP group.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_mesh.megatron.arguments import ALGORITHMS, is_mesh
from megatron_mesh.megatron.compat import have_transformer_engine
from megatron_mesh.megatron.core_attention import (
    MeshDotProductAttention,
    MeshDotProductAttentionInTEState,
    transformer_engine_attention,
)
from megatron_mesh.runtime.grid import MeshGrid

__all__ = ["get_gpt_layer_spec", "mesh_core_attention_spec", "use_mesh_core_attention"]


def mesh_core_attention_spec(
    context_parallel_algo: str = "mesh",
    backend: str = "auto",
    schedule: str | None = None,
    grad_reduce_dtype: str | None = None,
    grid: MeshGrid | None = None,
    attention_chunk_size: int | None = None,
) -> ModuleSpec:
    """The core_attention submodule spec for `context_parallel_algo`: the mesh (tile kernel
    `backend`; `schedule` and `grad_reduce_dtype`, None for the defaults; `grid`, the mesh
    grid of the layers' CP group; `attention_chunk_size`, chunked attention in the layers
    that apply RoPE) or, for another algorithm, Transformer Engine's attention when it is
    installed (which takes no chunks: ValueError)."""
    if context_parallel_algo not in ALGORITHMS:
        raise ValueError(
            f"unknown context-parallel algorithm {context_parallel_algo!r}; "
            f"valid: {', '.join(ALGORITHMS)}"
        )
    te_attention = None if is_mesh(context_parallel_algo) else transformer_engine_attention()
    if te_attention is not None and attention_chunk_size is not None:
        raise ValueError(f"attention_chunk_size={attention_chunk_size} runs in the mesh's core "
                         f"attention, not Transformer Engine's ({context_parallel_algo!r}); use "
                         "the 'mesh' algorithm")
    if te_attention is not None:
        return ModuleSpec(module=te_attention, params={"cp_comm_type": context_parallel_algo})
    params: dict[str, Any] = {"context_parallel_algo": context_parallel_algo}
    if backend != "auto":
        params["backend"] = backend
    if schedule is not None:
        params["schedule"] = schedule
    if grad_reduce_dtype is not None:
        params["grad_reduce_dtype"] = grad_reduce_dtype
    if grid is not None:
        params["grid"] = grid
    if attention_chunk_size is not None:
        params["attention_chunk_size"] = attention_chunk_size
    return ModuleSpec(module=MeshDotProductAttention, params=params)


def use_mesh_core_attention(
    spec: Any, context_parallel_algo: str = "mesh", backend: str = "auto",
    schedule: str | None = None, grad_reduce_dtype: str | None = None,
    grid: MeshGrid | None = None, attention_chunk_size: int | None = None,
) -> Any:
    """A copy of a layer or block spec with every `core_attention` submodule replaced.

    Walks ModuleSpec.submodules dataclasses (self_attention of a layer, layer_specs of a
    block); raises ValueError when the spec holds no core_attention to replace. A core
    attention with extra state (Transformer Engine's) becomes
    MeshDotProductAttentionInTEState, so checkpoints keep their keys.
    """
    core = mesh_core_attention_spec(context_parallel_algo, backend, schedule, grad_reduce_dtype,
                                    grid, attention_chunk_size)
    spec, count = _replace(spec, core)
    if count == 0:
        raise ValueError(f"no core_attention submodule found in spec {spec!r}")
    return spec


def _replace(node: Any, core: ModuleSpec) -> tuple[Any, int]:
    if isinstance(node, ModuleSpec):
        submodules, count = _replace(node.submodules, core)
        return (dataclasses.replace(node, submodules=submodules) if count else node), count
    if isinstance(node, (list, tuple)):
        parts = [_replace(item, core) for item in node]
        return type(node)(p for p, _ in parts), sum(c for _, c in parts)
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        changes, count = {}, 0
        for field in dataclasses.fields(node):
            value = getattr(node, field.name)
            if field.name == "core_attention":
                changes[field.name], count = _in_place_of(value, core), count + 1
                continue
            new, n = _replace(value, core)
            if n:
                changes[field.name], count = new, count + n
        return (dataclasses.replace(node, **changes) if count else node), count
    return node, 0


def _has_extra_state(module: Any) -> bool:
    """Whether a module class (or ModuleSpec) saves an `_extra_state` in its state dict."""
    module = module.module if isinstance(module, ModuleSpec) else module
    method = getattr(module, "get_extra_state", torch.nn.Module.get_extra_state)
    return method is not torch.nn.Module.get_extra_state


def _in_place_of(replaced: Any, core: ModuleSpec) -> ModuleSpec:
    """`core`, as the mesh class that keeps `replaced`'s extra state when it has one."""
    if core.module is MeshDotProductAttention and _has_extra_state(replaced):
        return dataclasses.replace(core, module=MeshDotProductAttentionInTEState)
    return core


def get_gpt_layer_spec(
    context_parallel_algo: str = "mesh",
    use_te: bool = False,
    backend: str = "auto",
    schedule: str | None = None,
    grad_reduce_dtype: str | None = None,
    grid: MeshGrid | None = None,
    attention_chunk_size: int | None = None,
    **kwargs: Any,
) -> ModuleSpec:
    """Megatron's GPT layer spec (local, or TE's with use_te) with the mesh core attention.

    kwargs go to `get_gpt_layer_local_spec` / `get_gpt_layer_with_transformer_engine_spec`
    (num_experts, qk_layernorm, normalization, ...). backend picks the mesh tile kernel,
    schedule the mesh schedule (`layer_plan.SCHEDULE_NAMES`), grad_reduce_dtype the dtype of the
    gradient exchange (fp32 / input), grid the mesh grid `initialize_mesh_grids` returned,
    attention_chunk_size chunked attention in the layers that apply RoPE (Llama 4).
    """
    from megatron.core.models.gpt import gpt_layer_specs

    if use_te:
        if not have_transformer_engine():
            raise ValueError(
                "use_te=True needs Transformer Engine (pip install transformer-engine[pytorch]); "
                "use use_te=False for the local spec, which works with the mesh without it"
            )
        layer = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(**kwargs)
    else:
        layer = gpt_layer_specs.get_gpt_layer_local_spec(**kwargs)
    return use_mesh_core_attention(layer, context_parallel_algo, backend, schedule,
                                   grad_reduce_dtype, grid, attention_chunk_size)
