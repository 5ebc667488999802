"""Running megatron-core models on a machine without CUDA (gloo, fp32).

A few megatron-core code paths put small tensors on the GPU even when the model lives on
the CPU: RoPE moves its frequencies to `torch.cuda.current_device()`, its context-parallel
slicing builds a pinned index tensor and calls `.cuda()`, the schedules create counters with
`device="cuda"`, activation recomputation saves and restores the CUDA generator's state,
the dist-checkpoint writer synchronizes CUDA after staging tensors in host memory, the
distributed optimizer sorts parameters by `Tensor.type()` ('torch.cuda.FloatTensor', ...).
`megatron_on_cpu()` keeps all of these on the CPU: inside it, CUDA device requests become CPU
ones, pinning is skipped, CUDA synchronization has nothing to wait for, `Tensor.type()` names
the CUDA type of the tensor's dtype, and the CUDA generator's state is empty (recomputation
still saves and restores the CPU generator, the one a CPU run draws from). The computation
itself is untouched. With CUDA available it does nothing.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

from megatron_mesh.megatron.patches import patched

__all__ = ["megatron_on_cpu"]


def _is_cuda(device: Any) -> bool:
    """A CUDA device: 'cuda[:n]', torch.device('cuda', n) or a bare index n (megatron-core
    passes `torch.cuda.current_device()`, an index, as a device)."""
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    if isinstance(device, (str, torch.device)):
        try:
            return torch.device(device).type == "cuda"
        except (RuntimeError, ValueError):
            return False
    return False


def _cuda_type_name(name: str) -> str:
    """'torch.FloatTensor' -> 'torch.cuda.FloatTensor': the name of the same dtype on CUDA."""
    return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name


class _CudaRequestsOnCpu(TorchFunctionMode):
    """Rewrite torch calls that ask for CUDA memory into CPU ones."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return _cuda_type_name(func(*args))
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda(a) else a for a in args)
        return func(*args, **kwargs)


CPU_PATCHES = ("torch.cuda.current_device", "torch.cuda.current_stream", "torch.cuda.synchronize",
               "megatron.core.tensor_parallel.random._get_cuda_rng_state",
               "megatron.core.tensor_parallel.random._set_cuda_rng_state")


@contextlib.contextmanager
def megatron_on_cpu() -> Iterator[None]:
    """Context for building and running megatron-core models without CUDA; no-op with CUDA.

    Also, within the block (`patches.patched`, restored on exit), `torch.cuda.current_device()`
    answers "cpu",
    `torch.cuda.current_stream()` the CPU's (no-op) stream, `torch.cuda.synchronize()` is a
    no-op and megatron-core's CUDA generator state is empty: megatron-core asks the first
    where to put RoPE frequencies and buffers, its DDP (0.19) waits on the second's events
    before a gradient reduction, its checkpoint writer calls the third, and it saves the last
    around recomputed activations.
    """
    if torch.cuda.is_available():
        yield
        return
    with patched(*CPU_PATCHES), _CudaRequestsOnCpu():
        yield
