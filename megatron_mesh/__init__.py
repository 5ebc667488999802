"""megatron-mesh: exact 2D (mesh) context-parallel attention for Megatron-Core.

    import megatron_mesh as mm
    grid = mm.MeshGrid.build(rows=R, cols=C)
    out = mm.mesh_attention(q, k, v, grid, causal=True)
    out = mm.mesh_attention(q, k, v, grid, mask=mm.prefix_lm_mask(seq_len=S, prefix_len=L))
    mask = mm.documents_mask(cu_seqlens) & mm.sliding_window_mask(128)  # one Mask value
    out = mm.mesh_attention(q, k, v, grid, mask=mask)  # q, k, v THD [t, h, d]
"""
from .attention import MeshAttention, MeshAttentionFunction, mesh_attention
from .calls.layout import zigzag_merge, zigzag_split
from .cost_models.sparse import placement_traffic, window_traffic
from .cost_models.traffic import Traffic, best_mesh_shape, mesh_traffic
from .layer_plan import AttentionShape, mesh_shapes
from .masks.chunked import chunked_mask
from .masks.document_placement import DocumentPlacement, zigzag_placement
from .masks.document_placer import place_documents
from .masks.documents import Documents, thd_merge, thd_partition_indices, thd_split
from .masks.mask import Mask, documents_mask, sliding_window_mask
from .masks.prefix import prefix_lm_mask
from .masks.slices import Slice, SliceMask
from .runtime.comm import TrafficCounter
from .runtime.grid import MeshGrid

__version__ = "0.1.0"

__all__ = [
    "AttentionShape",
    "DocumentPlacement",
    "Documents",
    "Mask",
    "MeshAttention",
    "MeshAttentionFunction",
    "MeshGrid",
    "Slice",
    "SliceMask",
    "Traffic",
    "TrafficCounter",
    "best_mesh_shape",
    "chunked_mask",
    "documents_mask",
    "mesh_attention",
    "mesh_shapes",
    "mesh_traffic",
    "place_documents",
    "placement_traffic",
    "prefix_lm_mask",
    "sliding_window_mask",
    "thd_merge",
    "thd_partition_indices",
    "thd_split",
    "window_traffic",
    "zigzag_placement",
    "zigzag_merge",
    "zigzag_split",
]
