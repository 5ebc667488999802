"""megatron-mesh: exact 2D (mesh) context-parallel attention for Megatron-Core.

    import megatron_mesh as mm
    grid = mm.MeshGrid.build(rows=R, cols=C)
    out = mm.mesh_attention(q, k, v, grid, causal=True)
"""
from .attention import MeshAttention, MeshAttentionFunction, mesh_attention
from .comm import TrafficCounter
from .document_placement import DocumentPlacement, place_documents, zigzag_placement  # noqa: F401
from .documents import Documents, thd_merge, thd_partition_indices, thd_split
from .grid import MeshGrid
from .layout import zigzag_merge, zigzag_split
from .traffic import Traffic, best_mesh_shape, mesh_traffic
from .values import AttentionShape, mesh_shapes
from .windowed import window_traffic

__version__ = "0.1.0"

__all__ = [
    "AttentionShape",
    "Documents",
    "MeshAttention",
    "MeshAttentionFunction",
    "MeshGrid",
    "Traffic",
    "TrafficCounter",
    "best_mesh_shape",
    "mesh_attention",
    "mesh_shapes",
    "mesh_traffic",
    "thd_merge",
    "thd_partition_indices",
    "thd_split",
    "window_traffic",
    "zigzag_merge",
    "zigzag_split",
]
