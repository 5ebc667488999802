"""Several ranks on one GPU over gloo: collectives staged through host memory (test only).

gloo carries some collectives of CUDA tensors but not point-to-point sends of them (its
TCP transport reads the CUDA pointer as host memory: `writev ... Bad address`). Inside
`staged_through_host()`, every collective the mesh uses (all_gather / reduce_scatter /
all_to_all single-tensor forms and batch_isend_irecv) copies its inputs to fresh host
tensors, runs the real gloo collective on those, and copies the results back into the
caller's tensors before returning. Staging happens for CPU tensors too (always fresh
copies), so the same code runs, and is checked exact, without a GPU. Asynchronous calls
complete before they return; their handles' wait() is then a no-op.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from typing import Callable, Iterator

import torch
import torch.distributed as dist

GATHER_LIKE = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
               "reduce_scatter_tensor", "all_to_all_single")
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


def stage_out_in(real: Callable, name: str) -> Callable:
    """real(out, inp, ...) run on host copies; out is filled from the host result."""

    def staged(out: torch.Tensor, inp: torch.Tensor, *args, async_op: bool = False, **kwargs):
        staged_calls[name] += 1
        host_out = torch.empty(out.shape, dtype=out.dtype)
        real(host_out, to_host(inp), *args, **kwargs)
        out.copy_(host_out)
        return Completed() if async_op else None

    return staged


def stage_batch(real: Callable) -> Callable:
    """batch_isend_irecv on host copies: sends copied out, receives copied back after."""

    def staged(ops: list[dist.P2POp]) -> list[Completed]:
        staged_calls["batch_isend_irecv"] += 1
        host_ops, receives = [], []
        for op in ops:
            if op.op in (dist.irecv, dist.recv):
                host = torch.empty(op.tensor.shape, dtype=op.tensor.dtype)
                receives.append((op.tensor, host))
            else:
                host = to_host(op.tensor)
            host_ops.append(dist.P2POp(op.op, host, op.peer, group=op.group, tag=op.tag))
        for work in real(host_ops):
            work.wait()
        for device_t, host in receives:
            device_t.copy_(host)
        return [Completed() for _ in ops]

    return staged


@contextlib.contextmanager
def staged_through_host() -> Iterator[None]:
    """Within the context, the mesh's collectives run on host copies (see module doc)."""
    originals = {name: getattr(dist, name) for name in GATHER_LIKE if hasattr(dist, name)}
    originals["batch_isend_irecv"] = dist.batch_isend_irecv
    for name, real in originals.items():
        setattr(dist, name,
                stage_batch(real) if name == "batch_isend_irecv" else stage_out_in(real, name))
    try:
        yield
    finally:
        for name, real in originals.items():
            setattr(dist, name, real)
