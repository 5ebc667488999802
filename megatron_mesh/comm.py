"""The collectives the mesh uses, along dim 0, with a per-rank byte counter.

Bytes a rank sends, for a group of n ranks: all_gather of an m-byte input (n-1)*m;
reduce_scatter to an m-byte output (n-1)*m; all_to_all of an M-byte input M*(n-1)/n;
ring_exchange of an m-byte tensor m. Groups of one rank skip the collective, send nothing
and copy nothing.
"""
from __future__ import annotations

import time
from collections import Counter
from typing import Callable, Literal, Mapping, Protocol, Sequence

import torch
import torch.distributed as dist

from .flat import flat_size, pack, views

Phase = Literal["forward", "backward"]
Direction = Literal["row", "col", "heads"]

_active: list["TrafficCounter"] = []
_links: list["LinkModel"] = []  # the emulated links in force, if any (innermost last)


class LinkModel(Protocol):
    """Emulated links (`megatron_mesh.emulation`): when would a transfer started now end?"""

    def reserve(self, op: str, sends: Mapping[int, int], group_ranks: Sequence[int]) -> float:
        """`sends`: global rank -> bytes this rank sends it (for a collective, over the
        ranks `group_ranks`); returns the time.monotonic() at which the links are done."""
        ...


def _done_at(op: str, group: dist.ProcessGroup | None, nbytes: int,
             peer: int | None = None) -> float | None:
    """When the emulated links finish this rank's sends of `nbytes` to `peer` (a global
    rank) or, for a collective, to every other member of `group`; None without them."""
    if not _links:
        return None
    ranks = (dist.get_process_group_ranks(group) if group is not None
             else list(range(dist.get_world_size())))
    me = dist.get_rank()
    sends = {peer: nbytes} if peer is not None else {r: nbytes for r in ranks if r != me}
    return _links[-1].reserve(op, sends, ranks)


def _wait_until(done_at: float | None) -> None:
    if done_at is not None:
        time.sleep(max(0.0, done_at - time.monotonic()))


def _collective(new_name: str, old_name: str):
    """Newer torch names the single-tensor collectives *_single, older *_into_tensor /
    *_tensor; looked up at call time."""
    return getattr(dist, new_name, None) or getattr(dist, old_name)


class TrafficCounter:
    """Counts the bytes this rank sends in mesh collectives while the context is open.

        with TrafficCounter() as tc:
            mesh_attention(q, k, v, grid).backward(dout)
        tc.total_bytes, tc.bytes(phase="forward", direction="row")
    """

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str, str]] = Counter()  # (phase, direction, op) -> bytes

    def __enter__(self) -> "TrafficCounter":
        _active.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _active.remove(self)

    def bytes(self, phase: Phase | None = None, direction: Direction | None = None) -> int:
        """Bytes sent, optionally restricted to one phase and / or grid direction."""
        return sum(
            n for (p, d, _), n in self.counts.items()
            if phase in (None, p) and direction in (None, d)
        )

    @property
    def total_bytes(self) -> int:
        return self.bytes()


def _record(phase: Phase, direction: Direction, op: str, nbytes: int) -> None:
    for counter in _active:
        counter.counts[(phase, direction, op)] += nbytes


def _blocking(op: str, group: dist.ProcessGroup | None, phase: Phase, direction: Direction,
              sent: int, per_link: int, run: Callable[[], object]) -> None:
    """Count `sent` bytes of `op`, run it, and (under emulated links) return no sooner than
    the links would carry `per_link` bytes."""
    _record(phase, direction, op, sent)
    done_at = _done_at(op, group, per_link)
    run()
    _wait_until(done_at)


def all_gather(
    t: torch.Tensor, group: dist.ProcessGroup | None, phase: Phase, direction: Direction
) -> torch.Tensor:
    """[m, ...] on each of n ranks -> [n * m, ...], in group-rank order."""
    out, pending = all_gather_async(t, group, phase, direction)
    pending.wait()
    return out


def all_gather_stacked(
    parts: Sequence[torch.Tensor], group: dist.ProcessGroup | None, phase: Phase,
    direction: Direction,
) -> Sequence[Sequence[torch.Tensor]]:
    """Tensors of one dtype (shapes may differ), gathered in one collective: result[r][i] is group
    rank r's parts[i]. A group of one gets its own parts back, uncopied."""
    out, pending = all_gather_stacked_async(parts, group, phase, direction)
    pending.wait()
    return out


def reduce_scatter(
    t: torch.Tensor, group: dist.ProcessGroup | None, phase: Phase, direction: Direction
) -> torch.Tensor:
    """[n * m, ...] on each rank -> this rank's [m, ...] piece of the sum over ranks."""
    n = dist.get_world_size(group)
    if n == 1:
        return t
    t = t.contiguous()
    out = t.new_empty((t.shape[0] // n, *t.shape[1:]))
    reduce = _collective("reduce_scatter_single", "reduce_scatter_tensor")
    _blocking("reduce_scatter", group, phase, direction, (n - 1) * out.nbytes, out.nbytes,
              lambda: reduce(out, t, op=dist.ReduceOp.SUM, group=group))
    return out


def all_to_all(
    t: torch.Tensor, group: dist.ProcessGroup | None, phase: Phase, direction: Direction
) -> torch.Tensor:
    """[n * m, ...]: piece k goes to group rank k; returns the n pieces received, in order."""
    n = dist.get_world_size(group)
    if n == 1:
        return t
    t = t.contiguous()
    out = torch.empty_like(t)
    _blocking("all_to_all", group, phase, direction, t.nbytes * (n - 1) // n, t.nbytes // n,
              lambda: dist.all_to_all_single(out, t, group=group))
    return out


class Pending:
    """Handles of collectives in flight; `wait()` returns once all have finished (and,
    under emulated links, not before the links would have carried the bytes)."""

    def __init__(self, works: list, done_at: float | None = None) -> None:
        self.works = [w for w in works if w is not None]
        self.done_at = done_at

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works = []
        _wait_until(self.done_at)
        self.done_at = None


def all_gather_async(
    t: torch.Tensor, group: dist.ProcessGroup | None, phase: Phase, direction: Direction
) -> tuple[torch.Tensor, Pending]:
    """Like `all_gather`, started in the background: read the result after `wait()`."""
    n = dist.get_world_size(group)
    if n == 1:
        return t, Pending([])
    t = t.contiguous()
    out = t.new_empty((n * t.shape[0], *t.shape[1:]))
    _record(phase, direction, "all_gather", (n - 1) * t.nbytes)
    done_at = _done_at("all_gather", group, t.nbytes)
    gather = _collective("all_gather_single", "all_gather_into_tensor")
    return out, Pending([gather(out, t, group=group, async_op=True)], done_at)


def all_gather_stacked_async(
    parts: Sequence[torch.Tensor], group: dist.ProcessGroup | None, phase: Phase,
    direction: Direction,
) -> tuple[Sequence[Sequence[torch.Tensor]], Pending]:
    """Like `all_gather_stacked`, started in the background: read the result after `wait()`.
    The parts share a dtype; their shapes may differ (K and V of different head dims): each
    rank's parts lie back to back in its slot of one flat buffer (`flat.py`)."""
    n = dist.get_world_size(group)
    if n == 1:
        return [tuple(parts)], Pending([])
    # this rank's parts are written straight into its slot of the result, which is the
    # collective's input: no stacked copy of them is made (nor held while the gather runs)
    shapes = [p.shape for p in parts]
    out = parts[0].new_empty((n, flat_size(shapes)))
    mine = pack(parts, out[dist.get_rank(group)])
    _record(phase, direction, "all_gather", (n - 1) * mine.nbytes)
    done_at = _done_at("all_gather", group, mine.nbytes)
    gather = _collective("all_gather_single", "all_gather_into_tensor")
    pending = Pending([gather(out.view(-1), mine, group=group, async_op=True)], done_at)
    return [views(out[r], shapes) for r in range(n)], pending


def ring_exchange(
    send: torch.Tensor | Sequence[torch.Tensor],
    recv: torch.Tensor | Sequence[torch.Tensor],
    next_rank: int,
    prev_rank: int,
    group: dist.ProcessGroup | None,
    phase: Phase,
    direction: Direction,
) -> Pending:
    """Send `send` (a tensor or several) to global rank next_rank while receiving `recv`
    (the same shapes) from prev_rank."""
    sends = [send] if isinstance(send, torch.Tensor) else list(send)
    recvs = [recv] if isinstance(recv, torch.Tensor) else list(recv)
    ops = []
    for out_t, in_t in zip(sends, recvs, strict=True):
        _record(phase, direction, "ring", out_t.nbytes)
        ops.append(dist.P2POp(dist.isend, out_t.contiguous(), next_rank, group=group))
        ops.append(dist.P2POp(dist.irecv, in_t, prev_rank, group=group))
    done_at = _done_at("ring", group, sum(t.nbytes for t in sends), next_rank)
    return Pending(dist.batch_isend_irecv(ops), done_at)


def exchange(
    sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]],
    phase: Phase, direction: Direction,
) -> Pending:
    """Point-to-point sends and receives, (global peer rank, tensor) each, started together;
    tensors without elements are skipped (both sides know the sizes). Bytes: each send's."""
    ops = []
    for peer, t in sends:
        if t.numel():
            _record(phase, direction, "p2p", t.nbytes)
            ops.append(dist.P2POp(dist.isend, t.contiguous(), peer))
    for peer, t in recvs:
        if t.numel():
            ops.append(dist.P2POp(dist.irecv, t, peer))
    return Pending(dist.batch_isend_irecv(ops) if ops else [])
