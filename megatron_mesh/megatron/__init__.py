"""Megatron-Core integration: CLI arguments, 2D CP groups, core attention and layer specs.

The only part of megatron_mesh that imports megatron.core.
"""
from megatron_mesh.megatron.arguments import (
    ALGORITHMS,
    add_mesh_args,
    mesh_spec_options,
    parse_mesh_shape,
    validate_mesh_args,
)
from megatron_mesh.megatron.compat import check_supported_version
from megatron_mesh.megatron.core_attention import MeshDotProductAttention
from megatron_mesh.megatron.cpu import megatron_on_cpu
from megatron_mesh.megatron.groups import (
    destroy_mesh_grids,
    get_mesh_grid,
    initialize_mesh_grids,
    mesh_grid_is_initialized,
)
from megatron_mesh.megatron.mask_builder import attach_mask_builder
from megatron_mesh.megatron.spec import get_gpt_layer_spec, use_mesh_core_attention

check_supported_version()  # before anything builds on megatron-core

__all__ = [
    "ALGORITHMS",
    "MeshDotProductAttention",
    "add_mesh_args",
    "attach_mask_builder",
    "destroy_mesh_grids",
    "get_gpt_layer_spec",
    "get_mesh_grid",
    "initialize_mesh_grids",
    "megatron_on_cpu",
    "mesh_grid_is_initialized",
    "mesh_spec_options",
    "parse_mesh_shape",
    "use_mesh_core_attention",
    "validate_mesh_args",
]
