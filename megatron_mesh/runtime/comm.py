"""The collectives the mesh uses, along dim 0, with observers and a swappable transport.

Bytes a rank sends, for a group of n ranks: all_gather of an m-byte input (n-1)*m;
reduce_scatter to an m-byte output (n-1)*m; all_to_all of an M-byte input M*(n-1)/n;
ring_exchange of an m-byte tensor m. Groups of one rank skip the collective, send nothing
and copy nothing.

Pieces are in grid order: with `order` (the group rank of each grid position,
`grid.MeshGrid.row_order` and the like; None when they are the same) a collective reads and
writes its pieces by grid position, though torch numbers a group's ranks by ascending global
rank. Only such grids pay a copy of the pieces.

Observers (`observing`): every transfer is shown to each observer in force before it runs,
as a `Transfer` (the `TrafficCounter` counts it; emulated links, `megatron_mesh.emulation`,
return when it would be done, and the call returns no sooner); an observer that has a
`waited(transfer)` method is also told when the caller has waited for the transfer to end
(at once for the blocking calls; at `Pending.wait()` for those started in the background),
so the order of starts, waits and the work between them can be recorded. The transport (`using`)
runs the collectives themselves: torch.distributed's by default (`TorchTransport`); another
(e.g. one that stages every tensor through host memory) plugs in without touching
torch.distributed.
"""
from __future__ import annotations

import contextlib
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterator, Literal, Protocol, Sequence

import torch
import torch.distributed as dist

from .flat import flat_size, pack, views

Phase = Literal["forward", "backward"]
Direction = Literal["row", "column", "heads"]  # `layer_plan.ROW`, `COLUMN`, `HEADS`


@dataclass(frozen=True)
class Transfer:
    """One transfer this rank starts: `nbytes` sent in all (the counting convention above),
    `per_link` bytes to each peer: the global rank `peer` (a ring step) or every other
    member of `group` (a collective; the default group when None)."""

    op: str  # "all_gather", "reduce_scatter", "all_to_all", "ring" or "p2p"
    phase: Phase
    direction: Direction
    nbytes: int
    per_link: int
    group: dist.ProcessGroup | None
    peer: int | None = None
    partial: bool = False  # partial results reduced on the way (outputs, gradients)

    def group_ranks(self) -> list[int]:
        """Global ranks of the group the transfer runs over."""
        return (dist.get_process_group_ranks(self.group) if self.group is not None
                else list(range(dist.get_world_size())))

    def sends(self) -> dict[int, int]:
        """Global rank -> bytes this rank sends it."""
        if self.peer is not None:
            return {self.peer: self.per_link}
        me = dist.get_rank()
        return {r: self.per_link for r in self.group_ranks() if r != me}


class Observer(Protocol):
    """Sees every transfer before it runs; returns the time.monotonic() before which the
    call must not return (emulated links), or None. May also have `waited(transfer)`,
    called once the caller has waited for the transfer (module docstring)."""

    def observe(self, transfer: Transfer) -> float | None:
        ...


class Transport(Protocol):
    """What runs the collectives: out-of-place single-tensor forms and batched p2p.
    Asynchronous calls return a handle with wait() (or None when already done)."""

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor,
                   group: dist.ProcessGroup | None, async_op: bool = False): ...

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor,
                       group: dist.ProcessGroup | None, async_op: bool = False): ...

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor,
                   group: dist.ProcessGroup | None) -> None: ...

    def batch_isend_irecv(self, ops: list[dist.P2POp]) -> list: ...


def _collective(new_name: str, old_name: str):
    """Newer torch names the single-tensor collectives *_single, older *_into_tensor /
    *_tensor; looked up at call time."""
    return getattr(dist, new_name, None) or getattr(dist, old_name)


class TorchTransport:
    """torch.distributed's collectives (the default transport)."""

    def all_gather(self, out, inp, group, async_op=False):
        return _collective("all_gather_single", "all_gather_into_tensor")(
            out, inp, group=group, async_op=async_op)

    def reduce_scatter(self, out, inp, group, async_op=False):
        return _collective("reduce_scatter_single", "reduce_scatter_tensor")(
            out, inp, op=dist.ReduceOp.SUM, group=group, async_op=async_op)

    def all_to_all(self, out, inp, group):
        dist.all_to_all_single(out, inp, group=group)

    def batch_isend_irecv(self, ops):
        return dist.batch_isend_irecv(ops)


_observers: list[Observer] = []
_transport: list[Transport] = [TorchTransport()]  # innermost last


@contextlib.contextmanager
def _pushed(stack: list, item: Any) -> Iterator[Any]:
    """`item` on `stack` within the context."""
    stack.append(item)
    try:
        yield item
    finally:
        stack.remove(item)


def observing(observer: Observer) -> contextlib.AbstractContextManager[Observer]:
    """Within the context, `observer` sees every transfer of this process."""
    return _pushed(_observers, observer)


def using(transport: Transport) -> contextlib.AbstractContextManager[Transport]:
    """Within the context, `transport` runs the mesh's collectives (then the previous one)."""
    return _pushed(_transport, transport)


class Observing:
    """Base of observers used as a context: `with obs:` registers it (`observing`)."""

    def observe(self, transfer: Transfer) -> float | None:
        raise NotImplementedError

    def __enter__(self):
        _observers.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _observers.remove(self)


def _observe(transfer: Transfer) -> float | None:
    """Show `transfer` to every observer: the latest time any of them asks to wait for."""
    done = [t for obs in list(_observers) if (t := obs.observe(transfer)) is not None]
    return max(done) if done else None


def _waited(transfers: Sequence[Transfer]) -> None:
    """Tell the observers that have a `waited` method that `transfers` were waited for."""
    for obs in list(_observers):
        hook = getattr(obs, "waited", None)
        if hook is not None:
            for transfer in transfers:
                hook(transfer)


def _wait_until(done_at: float | None) -> None:
    if done_at is not None:
        time.sleep(max(0.0, done_at - time.monotonic()))


class TrafficCounter(Observing):
    """Counts the bytes this rank sends in mesh collectives while the context is open.

        with TrafficCounter() as tc:
            mesh_attention(q, k, v, grid).backward(dout)
        tc.total_bytes, tc.bytes(phase="forward", direction="row")
    """

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str, str]] = Counter()  # (phase, direction, op) -> bytes

    def observe(self, transfer: Transfer) -> None:
        self.counts[(transfer.phase, transfer.direction, transfer.op)] += transfer.nbytes

    def bytes(self, phase: Phase | None = None, direction: Direction | None = None) -> int:
        """Bytes sent, optionally restricted to one phase and / or grid direction."""
        return sum(
            n for (p, d, _), n in self.counts.items()
            if phase in (None, p) and direction in (None, d)
        )

    @property
    def total_bytes(self) -> int:
        return self.bytes()


def _result(started: tuple[Any, Pending]) -> Any:
    """The result of a collective started in the background (`..._async`), once done."""
    out, pending = started
    pending.wait()
    return out


def all_gather(
    t: torch.Tensor, group: dist.ProcessGroup | None, phase: Phase, direction: Direction,
    order: Sequence[int] | None = None,
) -> torch.Tensor:
    """[m, ...] on each of n ranks -> [n * m, ...], in grid order (`order`, module docstring)."""
    return _result(all_gather_async(t, group, phase, direction, order))


def all_gather_stacked(
    parts: Sequence[torch.Tensor], group: dist.ProcessGroup | None, phase: Phase,
    direction: Direction, order: Sequence[int] | None = None,
) -> Sequence[Sequence[torch.Tensor]]:
    """Tensors of one dtype (shapes may differ), gathered in one collective: result[r][i] is
    parts[i] of the member at grid position r (`order`). A group of one gets its own parts
    back, uncopied."""
    return _result(all_gather_stacked_async(parts, group, phase, direction, order))


def reduce_scatter(
    t: torch.Tensor, group: dist.ProcessGroup | None, phase: Phase, direction: Direction,
    order: Sequence[int] | None = None,
) -> torch.Tensor:
    """[n * m, ...] on each rank, piece p for grid position p (`order`) -> this rank's
    [m, ...] piece of the sum over ranks."""
    return _result(reduce_scatter_async(t, group, phase, direction, order))


def reduce_scatter_async(
    t: torch.Tensor, group: dist.ProcessGroup | None, phase: Phase, direction: Direction,
    order: Sequence[int] | None = None,
) -> tuple[torch.Tensor, "Pending"]:
    """Like `reduce_scatter`, started in the background: read the result after `wait()`
    (t must not be written meanwhile)."""
    n = dist.get_world_size(group)
    if n == 1:
        return t, Pending([])
    t = to_group_order(t.contiguous(), order)
    out = t.new_empty((t.shape[0] // n, *t.shape[1:]))
    transfer = Transfer("reduce_scatter", phase, direction, (n - 1) * out.nbytes, out.nbytes,
                        group, partial=True)
    done_at = _observe(transfer)
    work = _transport[-1].reduce_scatter(out, t, group, async_op=True)
    return out, Pending([work], done_at, [transfer])


def all_to_all(
    t: torch.Tensor, group: dist.ProcessGroup | None, phase: Phase, direction: Direction,
    partial: bool = False, order: Sequence[int] | None = None,
) -> torch.Tensor:
    """[n * m, ...]: piece k goes to the member at grid position k (`order`); returns the n
    pieces received, by grid position. `partial`: partial results (`Transfer.partial`)."""
    n = dist.get_world_size(group)
    if n == 1:
        return t
    t = to_group_order(t.contiguous(), order)
    out = torch.empty_like(t)
    transfer = Transfer("all_to_all", phase, direction, t.nbytes * (n - 1) // n,
                        t.nbytes // n, group, partial=partial)
    done_at = _observe(transfer)
    _transport[-1].all_to_all(out, t, group)
    _wait_until(done_at)
    _waited([transfer])
    return to_grid_order(out, order)


def to_group_order(t: torch.Tensor, order: Sequence[int] | None) -> torch.Tensor:
    """t [n * m, ...] with piece p for grid position p -> piece g for group rank g (a copy;
    t itself when `order` is None)."""
    if order is None:
        return t
    n = len(order)
    by_group = [0] * n
    for position, rank in enumerate(order):
        by_group[rank] = position
    index = torch.tensor(by_group, device=t.device)
    return t.view(n, -1).index_select(0, index).view(t.shape)


def to_grid_order(t: torch.Tensor, order: Sequence[int] | None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of `to_group_order`: piece g of group rank g -> piece p of grid position p
    (into `out` when given)."""
    if order is None:
        return t
    n = len(order)
    index = torch.tensor(list(order), device=t.device)
    if out is None:
        return t.view(n, -1).index_select(0, index).view(t.shape)
    torch.index_select(t.view(n, -1), 0, index, out=out.view(n, -1))
    return out


class Pending:
    """Handles of collectives in flight; `wait()` returns once all have finished (and,
    under emulated links, not before the links would have carried the bytes), then tells
    the observers that `transfers` were waited for (once)."""

    def __init__(self, works: list, done_at: float | None = None,
                 transfers: Sequence[Transfer] = (), then: Sequence = ()) -> None:
        self.works = [w for w in works if w is not None]
        self.done_at = done_at
        self.transfers = list(transfers)
        self.then = list(then)  # callables run once the works are done (reordering)

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works = []
        then, self.then = self.then, []
        for step in then:
            step()
        _wait_until(self.done_at)
        self.done_at = None
        transfers, self.transfers = self.transfers, []
        _waited(transfers)

    @classmethod
    def joined(cls, *pendings: "Pending") -> "Pending":
        """One handle for several (their waits in order, the latest emulated end)."""
        ends = [p.done_at for p in pendings if p.done_at is not None]
        return cls([w for p in pendings for w in p.works], max(ends, default=None),
                   [t for p in pendings for t in p.transfers],
                   [step for p in pendings for step in p.then])


def all_gather_async(
    t: torch.Tensor, group: dist.ProcessGroup | None, phase: Phase, direction: Direction,
    order: Sequence[int] | None = None,
) -> tuple[torch.Tensor, Pending]:
    """Like `all_gather`, started in the background: read the result after `wait()`."""
    n = dist.get_world_size(group)
    if n == 1:
        return t, Pending([])
    t = t.contiguous()
    out = t.new_empty((n * t.shape[0], *t.shape[1:]))
    landing = out if order is None else torch.empty_like(out)  # by group rank, then reordered
    transfer = Transfer("all_gather", phase, direction, (n - 1) * t.nbytes, t.nbytes, group)
    done_at = _observe(transfer)
    then = () if order is None else (lambda: to_grid_order(landing, order, out),)
    return out, Pending([_transport[-1].all_gather(landing, t, group, async_op=True)], done_at,
                        [transfer], then)


def all_gather_stacked_async(
    parts: Sequence[torch.Tensor], group: dist.ProcessGroup | None, phase: Phase,
    direction: Direction, order: Sequence[int] | None = None,
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
    transfer = Transfer("all_gather", phase, direction, (n - 1) * mine.nbytes, mine.nbytes,
                        group)
    done_at = _observe(transfer)
    pending = Pending([_transport[-1].all_gather(out.view(-1), mine, group, async_op=True)],
                      done_at, [transfer])
    slots = range(n) if order is None else order  # group rank of each grid position
    return [views(out[r], shapes) for r in slots], pending


def ring_exchange(
    send: torch.Tensor | Sequence[torch.Tensor],
    recv: torch.Tensor | Sequence[torch.Tensor],
    next_rank: int,
    prev_rank: int,
    group: dist.ProcessGroup | None,
    phase: Phase,
    direction: Direction,
    partial: bool = False,
) -> Pending:
    """Send `send` (a tensor or several) to global rank next_rank while receiving `recv`
    (the same shapes) from prev_rank. `partial`: partial results (`Transfer.partial`)."""
    sends = [send] if isinstance(send, torch.Tensor) else list(send)
    recvs = [recv] if isinstance(recv, torch.Tensor) else list(recv)
    ops = []
    for out_t, in_t in zip(sends, recvs, strict=True):
        ops.append(dist.P2POp(dist.isend, out_t.contiguous(), next_rank, group=group))
        ops.append(dist.P2POp(dist.irecv, in_t, prev_rank, group=group))
    nbytes = sum(t.nbytes for t in sends)
    transfer = Transfer("ring", phase, direction, nbytes, nbytes, group, next_rank, partial)
    done_at = _observe(transfer)
    return Pending(_transport[-1].batch_isend_irecv(ops), done_at, [transfer])


def exchange(
    sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]],
    phase: Phase, direction: Direction,
) -> Pending:
    """Point-to-point sends and receives, (global peer rank, tensor) each, started together;
    tensors without elements are skipped (both sides know the sizes). Bytes: each send's."""
    ops, done, transfers = [], [], []
    for peer, t in sends:
        if t.numel():
            transfers.append(Transfer("p2p", phase, direction, t.nbytes, t.nbytes, None, peer))
            at = _observe(transfers[-1])
            done += [] if at is None else [at]
            ops.append(dist.P2POp(dist.isend, t.contiguous(), peer))
    for peer, t in recvs:
        if t.numel():
            ops.append(dist.P2POp(dist.irecv, t, peer))
    return Pending(_transport[-1].batch_isend_irecv(ops) if ops else [], max(done, default=None),
                   transfers)
