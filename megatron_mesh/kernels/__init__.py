"""Tile-kernel backends behind one interface (`base.TileKernel`, what each takes declared
as `caps.KernelCaps`), and the one place that chooses among them (`get_kernel`)."""
from __future__ import annotations

import functools
from typing import Iterable

import torch

from ..layer_plan import BACKEND_NAMES
from .base import TileKernel, folds_diagonal, log_once
from .caps import WINDOWS, KernelCaps, caps_of, kernel_name, what
from .choice import Choice, DeviceFacts, choose, log_skips
from .cudnn import CudnnKernel
from .flex import FlexTileKernel
from .te_fused import TEFusedKernel
from .torch_flash import TorchFlashKernel

BACKENDS = BACKEND_NAMES
# The kernel each named backend builds; its class's `caps` are what the name takes. 'flex'
# (FlexAttention, a whole tile in one call) is taken by name only: 'auto' never builds it.
BACKEND_KERNELS = {"torch": TorchFlashKernel, "cudnn": CudnnKernel, "te": TEFusedKernel,
                   "flex": FlexTileKernel}

# The kernel that runs each op of a `choice.Choice`.
OP_KERNELS = {"te": TEFusedKernel, "cudnn": CudnnKernel, "flash": TorchFlashKernel,
              "efficient": TorchFlashKernel, "cpu": TorchFlashKernel}

Needs = KernelCaps | Iterable[str] | str | None  # what `KernelCaps.of` takes


def is_kernel(backend: object) -> bool:
    """Whether `backend` is a tile kernel object (a `TileKernel`) rather than a name."""
    return callable(getattr(backend, "forward", None)) and callable(
        getattr(backend, "backward", None))


def check_backend(backend: str | TileKernel) -> None:
    """ValueError unless `backend` names a tile-kernel backend or is a `TileKernel`."""
    if not is_kernel(backend) and backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {', '.join(BACKENDS)} "
                         "(or a TileKernel object)")


def refuse(backend: str | TileKernel, needs: KernelCaps) -> None:
    """ValueError when a named backend (its kernel class's caps) or a kernel object (its
    own caps) does not take `needs`, naming it, what it lacks and what would; 'auto' is
    never refused here (`get_kernel` decides it per device)."""
    if isinstance(backend, str):
        if backend == "auto":
            return
        caps, who = BACKEND_KERNELS[backend].caps, f"backend={backend!r}"
    else:
        caps, who = caps_of(backend), f"the tile kernel {kernel_name(backend)!r}"
    missing = caps.missing(needs)
    if missing:
        instead = ("use backend='torch' or 'auto'" if TorchFlashKernel.caps.covers(needs)
                   else "no tile kernel here takes it")
        raise ValueError(f"{who} does not take {what(missing)}; {instead}")


def backend_for(backend: str | TileKernel, needs: Needs) -> str | TileKernel:
    """The backend for layers that need `needs`, decided from caps alone (no device yet;
    `attention.window_backend`): a named backend or kernel object as it is where it takes
    them (else `refuse`'s ValueError); 'auto' as it is where every kernel it may build
    takes them, else 'torch' (the kernel `get_kernel` falls back to)."""
    check_backend(backend)
    needs = KernelCaps.of(needs)
    refuse(backend, needs)
    if isinstance(backend, str) and backend == "auto" and not all(
            k.caps.covers(needs) for k in OP_KERNELS.values()):
        return "torch"
    return backend


def backend_folds_diagonal(backend: str, dtype: torch.dtype) -> bool:
    """Whether the kernel `backend` names ('torch', 'cudnn', 'te') folds a causal diagonal
    into a grouped call for inputs of `dtype` on a GPU: `base.folds_diagonal` asked on a meta
    tensor (a device that is not the CPU), the rule the tiles run by. torch's in fp16 / bf16
    (CUDA's flash op, its own bottom-right causal), not in fp32 (the memory-efficient op would
    need a mask of sq x sk); cuDNN's and TE's never."""
    if backend not in BACKEND_KERNELS:
        raise ValueError(f"backend={backend!r} is not one of {', '.join(BACKEND_KERNELS)}")
    q = torch.empty(0, 1, 1, 1, dtype=dtype, device="meta")
    return folds_diagonal(BACKEND_KERNELS[backend](), q)


def get_kernel(
    backend: str | TileKernel,
    device: torch.device,
    dtype: torch.dtype | None = None,
    head_dim: int | None = None,
    *,
    needs: Needs = None,
    v_head_dim: int | None = None,
    documents: bool = False,
) -> TileKernel:
    """The tile kernel for `backend` on `device` for tiles of `dtype` and `head_dim` (V's
    `v_head_dim` where it differs: multi-latent attention; None or equal: the same) whose
    caps cover `needs` (a `KernelCaps` or capability names, e.g. {'documents'}; V's own
    head dim adds 'v_head_dim', `documents` 'documents').

    The ops come from `choice.choose` (the one place that decides; see its docstring):
    'auto' asks Transformer Engine per tile shape, then takes torch's cuDNN op, flash op or
    memory-efficient op, whichever the GPU, cuDNN, dtype and head dim allow first; 'te' and
    'cudnn' raise ValueError, saying why, where they cannot run at all; 'torch' runs
    everywhere. Skipped ops are logged once with their reason. A `TileKernel` object (e.g.
    the emulated one of `megatron_mesh.emulation`) is returned as it is.
    Needs are checked against declared caps (`refuse`): a named backend or kernel object
    without one raises ValueError naming it and what would work (before any device check);
    where the kernel 'auto' chooses lacks one, torch's ops run (e.g. packed documents
    where torch's cuDNN op was chosen; TE's kernel takes them, "thd" asked per tile).
    """
    check_backend(backend)
    if v_head_dim == head_dim:
        v_head_dim = None
    needs = KernelCaps.of(needs) | KernelCaps(documents=documents,
                                              v_head_dim=v_head_dim is not None)
    refuse(backend, needs)
    if is_kernel(backend):
        return backend
    kernel = _kernel_for(backend, torch.device(device), dtype, head_dim, v_head_dim)
    if caps_of(kernel).covers(needs):
        return kernel
    if backend != "auto":
        refuse(kernel, needs)  # built with less than its class declares
    kernel = _kernel_for("torch", torch.device(device), dtype, head_dim, v_head_dim)
    refuse(kernel, needs)
    return kernel


@functools.lru_cache(maxsize=None)
def _kernel_for(backend: str, device: torch.device, dtype: torch.dtype | None,
                head_dim: int | None, v_head_dim: int | None = None) -> TileKernel:
    facts = DeviceFacts.of(device, want_te=backend in ("auto", "te"))
    chosen = choose(backend, facts, dtype, head_dim, v_head_dim)
    where = f"backend={backend!r} on {device}"
    log_skips(chosen, where)
    kernel = build(chosen)
    log_once(f"tile kernel for {where}, {dtype}, head dim {head_dim}: {kernel.name}")
    return kernel


def build(chosen: Choice) -> TileKernel:
    """The kernel running `chosen.ops` (TE falls back per tile to the op after it)."""
    op, rest = chosen.first, chosen.ops[1:]
    if op == "te":
        # packed documents fall back to a variable-length op (torch's flash op) where the
        # choice has one: torch's cuDNN op would make one call per document
        documents = build(Choice(tuple(o for o in rest if o != "cudnn") or rest))
        return TEFusedKernel(fallback=build(Choice(rest)), documents_fallback=documents)
    if op == "flex":
        return FlexTileKernel()
    if op == "cudnn":
        return CudnnKernel(documents=TorchFlashKernel(flash=True) if "flash" in rest else None)
    return TorchFlashKernel(flash=op in ("cpu", "flash"))


__all__ = ["BACKENDS", "BACKEND_KERNELS", "WINDOWS", "Choice", "CudnnKernel", "DeviceFacts",
           "FlexTileKernel", "KernelCaps", "TEFusedKernel", "TileKernel", "TorchFlashKernel",
           "backend_folds_diagonal", "backend_for", "build", "caps_of", "check_backend", "choose",
           "get_kernel", "is_kernel", "refuse"]
