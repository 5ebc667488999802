"""megatron-mesh: exact 2D (mesh) context-parallel attention for Megatron-Core."""
