"""Where the job runs: CUDA with NCCL, or CPU with gloo (fp32)."""
from __future__ import annotations

import torch


def has_cuda() -> bool:
    return torch.cuda.is_available()


def device() -> torch.device:
    """This rank's device: the CUDA device set at init, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if has_cuda() else torch.device("cpu")


def peak_memory_bytes() -> int:
    """Peak memory of this rank: CUDA allocator peak on a GPU, the process's peak RSS on a CPU."""
    if has_cuda():
        return torch.cuda.max_memory_allocated()
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def synchronize() -> None:
    if has_cuda():
        torch.cuda.synchronize()
