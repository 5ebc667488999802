"""Tile-kernel backends behind one interface (`base.TileKernel`), and the one place that
chooses among them (`get_kernel`)."""
from __future__ import annotations

import functools
import inspect

import torch

from .base import TileKernel
from .choice import Choice, DeviceFacts, choose, log_skips
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


def takes_documents(kernel: TileKernel) -> bool:
    """Whether the kernel takes packed documents (a `segments` keyword)."""
    return "segments" in inspect.signature(kernel.forward).parameters


def get_kernel(
    backend: str | TileKernel,
    device: torch.device,
    dtype: torch.dtype | None = None,
    head_dim: int | None = None,
    documents: bool = False,
    v_head_dim: int | None = None,
) -> TileKernel:
    """The tile kernel for `backend` on `device` for tiles of `dtype` and `head_dim` (V's
    `v_head_dim` where it differs: multi-latent attention; None or equal: the same).

    The ops come from `choice.choose` (the one place that decides; see its docstring):
    'auto' asks Transformer Engine per tile shape, then takes torch's cuDNN op, flash op or
    memory-efficient op, whichever the GPU, cuDNN, dtype and head dim allow first; 'te' and
    'cudnn' raise ValueError, saying why, where they cannot run at all; 'torch' runs
    everywhere. Skipped ops are logged once with their reason. A `TileKernel` object (e.g.
    the emulated one of `megatron_mesh.emulation`) is returned as it is.
    With `documents` (packed sequences) only kernels that take them (`takes_documents`)
    are chosen: Transformer Engine's does ("thd", asked per tile; tiles it turns down run
    on torch's ops), torch's cuDNN op does not: there 'auto' falls back to torch's ops and
    'cudnn' raises ValueError.
    """
    check_backend(backend)
    if v_head_dim == head_dim:
        v_head_dim = None
    if is_kernel(backend):
        kernel = backend
    else:
        kernel = _kernel_for(backend, torch.device(device), dtype, head_dim, v_head_dim)
    if documents and not takes_documents(kernel):
        if backend != "auto":
            name = getattr(kernel, "name", type(kernel).__name__)
            raise ValueError(f"backend={name!r} does not take packed documents (cu_seqlens); "
                             "use backend='torch' or 'auto'")
        return _kernel_for("torch", torch.device(device), dtype, head_dim, v_head_dim)
    return kernel


@functools.lru_cache(maxsize=None)
def _kernel_for(backend: str, device: torch.device, dtype: torch.dtype | None,
                head_dim: int | None, v_head_dim: int | None = None) -> TileKernel:
    facts = DeviceFacts.of(device, want_te=backend in ("auto", "te"))
    chosen = choose(backend, facts, dtype, head_dim, v_head_dim)
    log_skips(chosen, f"backend={backend!r} on {device}")
    return build(chosen)


def build(chosen: Choice) -> TileKernel:
    """The kernel running `chosen.ops` (TE falls back per tile to the op after it)."""
    op, rest = chosen.first, chosen.ops[1:]
    if op == "te":
        from .te_fused import TEFusedKernel

        # packed documents fall back past torch's cuDNN op, which does not take them
        documents = build(Choice(tuple(o for o in rest if o != "cudnn")))
        return TEFusedKernel(fallback=build(Choice(rest)), documents_fallback=documents)
    if op == "cudnn":
        return CudnnKernel()
    return TorchFlashKernel(flash=op in ("cpu", "flash"))


__all__ = ["BACKENDS", "Choice", "CudnnKernel", "DeviceFacts", "TileKernel", "TorchFlashKernel",
           "build", "check_backend", "choose", "get_kernel", "is_kernel", "takes_documents"]
