"""Measured peak memory of CPU tensors allocated inside a context (the CPU allocator keeps
no statistics, so storages are tracked as torch's dispatcher creates them).

    with CpuPeakMemory() as mem:
        out = mesh_attention(q, k, v, grid)
    mem.peak_bytes, mem.live_bytes
    pass_peaks(lambda: mesh_attention(q, k, v, grid), dout)  # {'forward': B, 'backward': B}
    out, lse = untracked(lambda: kernel.tile_forward(...))  # a fused kernel's work unseen

A storage counts from the op that creates it until the last tensor viewing it is gone; views
and in-place results of storages made outside the context are not counted. Work buffers
inside a kernel that never become tensors are not seen. A collective's buffers are let go by
the backend's own thread just after the collective ends: before an allocation counts as a
new peak, that thread is given a millisecond to do so (else the peak would depend on how
the two threads were scheduled). `untracked` runs a kernel with the trackers off and counts
only what it returns (and keeps): a fused kernel's work buffers never become tensors, and
torch's eager FlexAttention op, which stands in for the compiled one on the CPU, runs under
no dispatch mode (its [sq, sk] scores are not what the CUDA kernel holds).
"""
from __future__ import annotations

import threading
import time
import weakref
from typing import Any, Callable, Iterable

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes


class CpuPeakMemory(TorchDispatchMode):
    """Live and peak bytes of CPU storages created while the context is open."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, list[int]] = {}  # storage address -> [bytes, tensors alive]
        self.live_bytes = 0
        self.peak_bytes = 0
        self._lock = threading.Lock()  # tensors may die on a collective's thread

    def _release(self, key: int) -> None:
        with self._lock:
            entry = self._live.get(key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] == 0:
                self.live_bytes -= entry[0]
                del self._live[key]

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs))
                 if isinstance(t, torch.Tensor)}
        self.count(pytree.tree_leaves(out), given)
        return out

    def count(self, tensors: Iterable[Any], given: set[int] = frozenset()) -> None:
        """Count the CPU storages of `tensors` (other values skipped) from now until the last
        tensor viewing each is gone; storages in `given` (an op's inputs: its views and
        in-place results) are not new."""
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            key = t.untyped_storage().data_ptr()
            with self._lock:
                entry = self._live.get(key)
                if entry is None:
                    if key == 0 or key in given:  # empty, a view or an in-place result
                        continue
                    entry = self._live[key] = [t.untyped_storage().nbytes(), 0]
                    self.live_bytes += entry[0]
                entry[1] += 1
            weakref.finalize(t, self._release, key)
        if self.live_bytes > self.peak_bytes:
            time.sleep(0.001)  # let a collective's thread drop what it has finished with
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)


def untracked(run: Callable[[], Any],
              kept: Callable[[Any], Iterable[torch.Tensor]] = lambda result: ()) -> Any:
    """run() with the open trackers off (a fused kernel: its work buffers are not seen),
    then the storages of its result's tensors and of `kept(result)` (what it made and
    keeps, e.g. a mask it built) counted from its return on, in each of them."""
    with _disable_current_modes() as modes:
        result = run()
    trackers = [m for m in modes if isinstance(m, CpuPeakMemory)]
    made = [*pytree.tree_leaves(result), *kept(result)]
    for tracker in trackers:
        tracker.count(made)
    return result


def pass_peaks(forward: Callable[[], torch.Tensor], dout: torch.Tensor) -> dict[str, int]:
    """{'forward': bytes, 'backward': bytes}: the peak of the tensors `forward()` creates, and
    of those its output's backward(dout) creates, each beyond what is still alive when the
    pass ends (its result): the extra memory `memory.extra_memory` models."""
    with CpuPeakMemory() as fwd:
        out = forward()
    with CpuPeakMemory() as bwd:
        out.backward(dout)
    return {"forward": fwd.peak_bytes - fwd.live_bytes, "backward": bwd.peak_bytes - bwd.live_bytes}
