"""Collectives staged through host memory: several ranks sharing one GPU over gloo.

NCCL takes one rank per GPU, and gloo carries some collectives of CUDA tensors but not
point-to-point sends of them (its TCP transport reads the CUDA pointer as host memory). With
`HostStaging` as the mesh's transport (`comm.using`), every collective the mesh uses
(all_gather / reduce_scatter / all_to_all and batch_isend_irecv) copies its inputs to fresh
host tensors, runs the real collective on those, and copies the results back into the
caller's tensors before returning. Staging happens for CPU tensors too (always fresh copies),
so the same code runs, and is checked exact, without a GPU. Asynchronous calls complete
before they return; their handles' wait() is then a no-op. For checking, not for speed:
every byte crosses host memory twice and nothing overlaps.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable

import torch
import torch.distributed as dist

from . import comm

__all__ = ["GATHER_LIKE", "Completed", "HostStaging", "to_host"]

GATHER_LIKE = ("all_gather", "reduce_scatter", "all_to_all")


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
    """A `comm.Transport` that runs `inner`'s collectives on host copies (module doc);
    `calls` counts the staged calls by name (four names at most)."""

    def __init__(self, inner: comm.Transport | None = None) -> None:
        self.inner = inner or comm.TorchTransport()
        self.calls: Counter[str] = Counter()

    def _out_in(self, name: str, out: torch.Tensor, inp: torch.Tensor,
                run: Callable[[torch.Tensor, torch.Tensor], object]) -> None:
        self.calls[name] += 1
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
        self.calls["batch_isend_irecv"] += 1
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
