"""Several ranks on one GPU over gloo: collectives staged through host memory (test only).

gloo carries some collectives of CUDA tensors but not point-to-point sends of them (its TCP
transport reads the CUDA pointer as host memory: `writev ... Bad address`). Inside
`staged_through_host()` (the `HostStaging` transport of `megatron_mesh.runtime.comm`), every
collective the mesh uses (all_gather / reduce_scatter / all_to_all and batch_isend_irecv)
copies its inputs to fresh host tensors, runs the real gloo collective on those, and copies
the results back into the caller's tensors before returning. Staging happens for CPU tensors
too (always fresh copies), so the same code runs, and is checked exact, without a GPU.
Asynchronous calls complete before they return; their handles' wait() is then a no-op.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable, Sequence

import torch
import torch.distributed as dist

import megatron_mesh as mm
from megatron_mesh.runtime import comm

GATHER_LIKE = ("all_gather", "reduce_scatter", "all_to_all")
staged_calls: Counter[str] = Counter()  # name -> calls staged in this process


class Completed:
    """The handle of a staged call: it has finished when the call returns."""

    def wait(self, *args: object, **kwargs: object) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A fresh host copy of t (never t itself, also on CPU)."""
    return t.detach().to("cpu", copy=True)


class HostStaging:
    """A `comm.Transport` that runs `inner`'s collectives on host copies (module doc)."""

    def __init__(self, inner: comm.Transport | None = None) -> None:
        self.inner = inner or comm.TorchTransport()

    def _out_in(self, name: str, out: torch.Tensor, inp: torch.Tensor, run) -> None:
        staged_calls[name] += 1
        host_out = torch.empty(out.shape, dtype=out.dtype)
        run(host_out, to_host(inp))
        out.copy_(host_out)

    def all_gather(self, out, inp, group, async_op=False):
        self._out_in("all_gather", out, inp, lambda o, i: self.inner.all_gather(o, i, group))
        return Completed() if async_op else None

    def reduce_scatter(self, out, inp, group, async_op=False):
        self._out_in("reduce_scatter", out, inp,
                     lambda o, i: self.inner.reduce_scatter(o, i, group))
        return Completed() if async_op else None

    def all_to_all(self, out, inp, group):
        self._out_in("all_to_all", out, inp, lambda o, i: self.inner.all_to_all(o, i, group))

    def batch_isend_irecv(self, ops: list[dist.P2POp]) -> list[Completed]:
        """Sends copied out, receives copied back after."""
        staged_calls["batch_isend_irecv"] += 1
        host_ops, receives = [], []
        for op in ops:
            if op.op in (dist.irecv, dist.recv):
                host = torch.empty(op.tensor.shape, dtype=op.tensor.dtype)
                receives.append((op.tensor, host))
            else:
                host = to_host(op.tensor)
            host_ops.append(dist.P2POp(op.op, host, op.peer, group=op.group, tag=op.tag))
        for work in self.inner.batch_isend_irecv(host_ops):
            work.wait()
        for device_t, host in receives:
            device_t.copy_(host)
        return [Completed() for _ in ops]


def staged_through_host():
    """Within the context, the mesh's collectives run on host copies (see module doc)."""
    return comm.using(HostStaging())


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
