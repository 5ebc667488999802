"""Tile-kernel backends behind one interface (`base.TileKernel`), and the one place that
chooses among them (`get_kernel`)."""
from __future__ import annotations

import inspect

import torch

from . import cudnn
from .base import TileKernel
from .cudnn import CudnnKernel
from .torch_flash import TorchFlashKernel

BACKENDS = ("auto", "torch", "cudnn", "te")


def is_kernel(backend: object) -> bool:
    """Whether `backend` is a tile kernel object (a `TileKernel`) rather than a name."""
    return callable(getattr(backend, "forward", None)) and callable(
        getattr(backend, "backward", None))


def check_backend(backend: str | TileKernel) -> None:
    """ValueError unless `backend` names a tile-kernel backend or is a `TileKernel`."""
    if not is_kernel(backend) and backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {', '.join(BACKENDS)} "
                         "(or a TileKernel object)")


def _te_unsupported(device: torch.device, dtype: torch.dtype | None) -> str | None:
    """Why Transformer Engine cannot run these tiles, or None."""
    from . import te_fused

    if device.type != "cuda" or not te_fused.is_available():
        return (f"tensors on {device}, Transformer Engine "
                f"{te_fused.te_version() or 'not installed'} (it needs CUDA and TE >= 2.1)")
    if dtype is not None and dtype not in te_fused.TE_DTYPES:
        return f"dtype {dtype}: TE's fused attention takes float16 / bfloat16"
    return None


def takes_documents(kernel: TileKernel) -> bool:
    """Whether the kernel takes packed documents (a `segments` keyword)."""
    return "segments" in inspect.signature(kernel.forward).parameters


def get_kernel(
    backend: str | TileKernel,
    device: torch.device,
    dtype: torch.dtype | None = None,
    head_dim: int | None = None,
    documents: bool = False,
) -> TileKernel:
    """The tile kernel for `backend` on `device` for tiles of `dtype` and `head_dim`.

    'auto' picks Transformer Engine when it is installed and takes the dtype, then torch's
    cuDNN attention when cuDNN >= 9 takes the dtype and head dim, then torch's flash /
    memory-efficient ops (the only choice on CPU). 'te' and 'cudnn' raise ValueError, saying
    why, where they cannot run; 'torch' runs everywhere. A `TileKernel` object (e.g. the
    emulated one of `megatron_mesh.emulation`) is returned as it is. With `documents`
    (packed sequences) only kernels that take them (`takes_documents`) are chosen: 'auto'
    falls back to torch's ops, a named backend that cannot raises ValueError.
    """
    kernel = _kernel_for(backend, device, dtype, head_dim)
    if documents and not takes_documents(kernel):
        if backend != "auto":
            name = getattr(kernel, "name", type(kernel).__name__)
            raise ValueError(f"backend={name!r} does not take packed documents (cu_seqlens); "
                             "use backend='torch' or 'auto'")
        return TorchFlashKernel()
    return kernel


def _kernel_for(backend: str | TileKernel, device: torch.device, dtype: torch.dtype | None,
                head_dim: int | None) -> TileKernel:
    check_backend(backend)
    if is_kernel(backend):
        return backend
    device = torch.device(device)
    if backend == "torch" or (backend == "auto" and device.type != "cuda"):
        return TorchFlashKernel()
    te_why = _te_unsupported(device, dtype)
    cudnn_why = (cudnn.unsupported(device, dtype, head_dim) if dtype is not None
                 and head_dim is not None else "dtype and head dim not given")
    if backend == "te":
        if te_why:
            raise ValueError(f"backend='te' cannot run here: {te_why}; install "
                             "transformer-engine[pytorch] or use backend='cudnn' or 'torch'")
        from .te_fused import TEFusedKernel

        return TEFusedKernel()
    if backend == "cudnn":
        if cudnn_why:
            raise ValueError(f"backend='cudnn' cannot run here: {cudnn_why}; use "
                             "backend='torch'")
        return CudnnKernel()
    if te_why is None:
        from .te_fused import TEFusedKernel

        return TEFusedKernel()
    return CudnnKernel() if cudnn_why is None else TorchFlashKernel()


__all__ = ["BACKENDS", "CudnnKernel", "TileKernel", "TorchFlashKernel", "check_backend",
           "get_kernel", "is_kernel", "takes_documents"]
