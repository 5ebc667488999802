"""megatron-mesh: exact 2D (mesh) context-parallel attention for Megatron-Core.

    import megatron_mesh as mm
    grid = mm.MeshGrid.build(rows=R, cols=C)
    out = mm.mesh_attention(q, k, v, grid, causal=True)
"""
from .attention import MeshAttentionFunction, mesh_attention
from .comm import TrafficCounter
from .grid import MeshGrid
from .layout import zigzag_merge, zigzag_split
from .traffic import (
    AttentionShape,
    Traffic,
    best_mesh_shape,
    mesh_shapes,
    mesh_traffic,
    window_traffic,
)

__version__ = "0.1.0"

__all__ = [
    "AttentionShape",
    "MeshAttentionFunction",
    "MeshGrid",
    "Traffic",
    "TrafficCounter",
    "best_mesh_shape",
    "mesh_attention",
    "mesh_shapes",
    "mesh_traffic",
    "window_traffic",
    "zigzag_merge",
    "zigzag_split",
]
