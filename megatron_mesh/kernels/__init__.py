"""Tile-kernel backends behind one interface (`base.TileKernel`)."""
from __future__ import annotations

import torch

from .base import TileKernel
from .torch_flash import TorchFlashKernel

BACKENDS = ("auto", "torch", "te")


def check_backend(backend: str) -> None:
    """ValueError unless `backend` names a tile-kernel backend."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {', '.join(BACKENDS)}")


def get_kernel(backend: str, device: torch.device) -> TileKernel:
    """The tile kernel for `backend` ('auto', 'torch' or 'te') on `device`.

    'auto' picks Transformer Engine on CUDA when it is installed, else torch.
    """
    check_backend(backend)
    if backend == "torch" or (backend == "auto" and device.type != "cuda"):
        return TorchFlashKernel()
    from . import te_fused

    if backend == "te":
        if device.type != "cuda" or not te_fused.is_available():
            raise ValueError(
                f"backend='te' needs CUDA tensors and Transformer Engine (tensors on {device}, "
                f"Transformer Engine {te_fused.te_version() or 'not installed'}); "
                "install transformer-engine[pytorch] or use backend='torch'"
            )
        return te_fused.TEFusedKernel()
    return te_fused.TEFusedKernel() if te_fused.is_available() else TorchFlashKernel()


__all__ = ["BACKENDS", "TileKernel", "TorchFlashKernel", "check_backend", "get_kernel"]
