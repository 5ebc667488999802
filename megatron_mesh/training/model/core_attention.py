"""Which core attention the driver's layers run, decided from the flags alone: the flag
checks read it before any process group exists (a tile kernel that cannot run is refused
there, `arguments.check_mesh_kernel`), the model spec builds it (`gpt.layer_spec`). No
megatron-core import."""
from __future__ import annotations

from megatron_mesh.megatron.arguments import MESH, is_mesh
from megatron_mesh.megatron.compat import have_transformer_engine
from megatron_mesh.training.job.device import has_cuda


def te_layers(transformer_impl: str) -> bool:
    """Transformer Engine layers under --transformer-impl: when asked, or with 'auto' when TE
    imports and CUDA is there. RuntimeError where TE is asked for and not installed."""
    if transformer_impl == "local":
        return False
    te = have_transformer_engine()
    if transformer_impl == "transformer_engine" and not te:
        raise RuntimeError("--transformer-impl transformer_engine: Transformer Engine is not "
                           "installed; use --transformer-impl local")
    return te and has_cuda()


def core_attention(attention_backend: str, algo: str | None, cp_size: int, use_te: bool
                   ) -> str | None:
    """The core attention the layers use: a context-parallel algorithm of our spec's
    `MeshDotProductAttention` ('mesh' or one of TE's), or None for megatron-core's local
    (unfused, S x S scores) attention.

    --attention-backend local asks for the latter; 'auto' for TE's attention with TE layers
    (`use_te`), else the mesh tile kernel; 'flash' for the mesh tile kernel also with TE
    layers at CP = 1. At CP = 1 the mesh is a 1 x 1 grid: one fused call over the whole
    sequence, whatever the algorithm's name; without TE, CP > 1 runs only the mesh.
    """
    if attention_backend == "local":
        return None
    if is_mesh(algo) or not use_te:
        return MESH
    if attention_backend == "flash" and cp_size == 1:
        return MESH
    return algo


__all__ = ["core_attention", "te_layers"]
