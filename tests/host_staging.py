"""Several ranks on one GPU over gloo, in tests: the mesh's collectives staged through host
memory (`megatron_mesh.runtime.host_staging`, module doc), the staged calls of this process
counted in `staged_calls`."""
from __future__ import annotations

from typing import Callable, Sequence

import torch

import megatron_mesh as mm
from megatron_mesh.runtime import comm
from megatron_mesh.runtime.host_staging import GATHER_LIKE, HostStaging

__all__ = ["GATHER_LIKE", "check_on_one_gpu", "memory_over_model", "staged_calls",
           "staged_through_host"]

_staging = HostStaging()
staged_calls = _staging.calls  # name -> calls staged in this process


def staged_through_host():
    """Within the context, the mesh's collectives run on host copies."""
    return comm.using(_staging)


GPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_on_one_gpu(rank: int, grids: Sequence[tuple[int, int, int]], cases: Sequence,
                     as_gpu_case: Callable, check: Callable) -> list[str]:
    """Failures of every case on every (A, R, C) grid, this rank sharing GPU 0 with the
    others, staged through host memory: case i runs as `as_gpu_case(case, GPU_DTYPES[i % 3])`
    through `check(case, grid, "cuda")`; an exception is reported with its case."""
    torch.cuda.set_device(0)
    bad = []
    with staged_through_host():
        for a, r, c in grids:
            grid = mm.MeshGrid.build(rows=r, cols=c, heads=a)
            for i, case in enumerate(cases):
                case = as_gpu_case(case, GPU_DTYPES[i % len(GPU_DTYPES)])
                try:
                    bad += check(case, grid, "cuda")
                except Exception as e:  # noqa: BLE001 (reported with the case)
                    bad.append(f"{case} grid {grid.shape_text} rank {rank}: "
                               f"{type(e).__name__}: {e}")
    return bad


def memory_over_model(rows: Sequence[dict], factor: float = 1.5,
                      slack_bytes: int = 2**20) -> list[str]:
    """The (grid shape, schedule) pairs whose worst rank measured more than `factor` x the
    memory model plus `slack_bytes`: rows of {shape, schedule, measured_bytes, model_bytes}."""
    worst: dict[tuple[str, str], tuple[int, int]] = {}
    for row in rows:
        key = (row["shape"], row["schedule"])
        measured = max(worst.get(key, (0, 0))[0], row["measured_bytes"])
        worst[key] = (measured, row["model_bytes"])
    return [f"{shape} {sch}: measured {m / 2**20:.1f} MiB > {factor:g} x model "
            f"{mod / 2**20:.1f} MiB" for (shape, sch), (m, mod) in worst.items()
            if m > factor * mod + slack_bytes]
