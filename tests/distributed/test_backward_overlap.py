"""Backward overlaps its transfers with blocks, proved by the order of events, not by time.

An observer of `comm` records every transfer as it starts and as the caller waits for it
(`Observer.waited`), and the real tile kernel, wrapped, records each backward block it
computes (its calls, grouped as `cost_models.tile_calls` counts them). On 2 x 2, 4 x 2, 2 x 4 and
2 x 2 x 2 grids, with every schedule, each chunk
transfer of backward over the row or the column (the gathers of Q, dO, lse, D and K, V;
the rings' hops) and each dQ transfer over the row (the dQ partials' hops) must have at
least one block computed between its start and its wait. A blocking collective has none.
"""
from __future__ import annotations

import pytest
import torch

import megatron_mesh as mm
from megatron_mesh.cost_models.tile_calls import backward_calls
from megatron_mesh.kernels import TileKernel, get_kernel
from megatron_mesh.runtime import comm

from dist_utils import run_distributed
from reference import CONCRETE_SCHEDULES

Event = tuple[str, object]  # ("start" | "wait", Transfer) or ("block", None)


class EventLog(comm.Observing):
    """Transfers started and waited for, in order, while the context is open."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def observe(self, transfer: comm.Transfer) -> None:
        self.events.append(("start", transfer))

    def waited(self, transfer: comm.Transfer) -> None:
        self.events.append(("wait", transfer))


class LoggedKernel:
    """A real tile kernel whose backward calls are recorded in `log` as blocks."""

    def __init__(self, inner: TileKernel, log: EventLog) -> None:
        self.inner, self.log, self.name = inner, log, inner.name

    def forward(self, *args, **kwargs):
        return self.inner.forward(*args, **kwargs)

    def backward(self, *args, **kwargs):
        grads = self.inner.backward(*args, **kwargs)
        self.log.events.append(("block", None))
        return grads


def spans(events: list[Event]) -> list[tuple[str, str, bool, int | None]]:
    """(direction, op, partial, blocks between start and wait; None if never waited) of
    every transfer started in `events`, matched by identity."""
    out = []
    for n, (kind, transfer) in enumerate(events):
        if kind != "start":
            continue
        waits = [m for m in range(n + 1, len(events))
                 if events[m][0] == "wait" and events[m][1] is transfer]
        blocks = (sum(e[0] == "block" for e in events[n + 1:waits[0]]) if waits else None)
        out.append((transfer.direction, transfer.op, transfer.partial, blocks))
    return out


def backward_events(grid: mm.MeshGrid, schedule: str) -> list[tuple]:
    """One causal fp32 layer's backward on `grid`: the `spans` of its transfers."""
    g = torch.Generator().manual_seed(grid.cp_rank)
    s, hq, hkv, d = 8, 4, 2, 8  # 8 tokens per rank
    q, k, v = (torch.randn(s, 1, h, d, generator=g).requires_grad_() for h in (hq, hkv, hkv))
    log = EventLog()
    kernel = LoggedKernel(get_kernel("torch", q.device, q.dtype, d), log)
    out = mm.mesh_attention(q, k, v, grid, backend=kernel, schedule=schedule)
    with log:
        out.backward(torch.randn(out.shape, generator=g))
    # every block, once, in the modelled calls (the wrapper declares no caps: no diagonal
    # folded into a bottom-right call)
    assert log.events.count(("block", None)) == backward_calls(
        grid.rows, grid.cols, True, schedule, bottom_right=False, rank=grid.mesh_rank)
    return spans(log.events)


def overlap_worker(rank: int, world: int, shapes: list[tuple[int, int, int]]) -> dict:
    return {(a, r, c, schedule): backward_events(mm.MeshGrid.build(rows=r, cols=c, heads=a),
                                                 schedule)
            for a, r, c in shapes for schedule in CONCRETE_SCHEDULES}


def not_overlapped(per_rank: list[dict]) -> list[str]:
    """Every transfer that must overlap a block and did not, on any rank."""
    bad = []
    for rank, results in enumerate(per_rank):
        for (a, r, c, schedule), found in results.items():
            where = f"rank {rank} {a}x{r}x{c} {schedule}"
            row_partials = [x for x in found if x[0] == "row" and x[2]]
            if not row_partials:
                bad.append(f"{where}: no dQ transfer over the row")
            for direction, op, partial, blocks in found:
                if blocks is None:
                    bad.append(f"{where}: {direction} {op} was never waited for")
                elif direction != "heads" and (direction == "row" or not partial) and blocks < 1:
                    what = "partials" if partial else "chunks"
                    bad.append(f"{where}: {direction} {op} of {what}: no block between its "
                               "start and its wait")
    return bad


@pytest.mark.parametrize("world,shapes", [
    (4, [(1, 2, 2)]),
    (8, [(1, 4, 2), (1, 2, 4), (2, 2, 2)]),
])
def test_backward_computes_blocks_while_its_transfers_travel(world: int, shapes: list) -> None:
    per_rank = run_distributed(overlap_worker, world, shapes)
    assert not not_overlapped(per_rank), "\n".join(not_overlapped(per_rank))
    # the row's chunks arrive by a gather (gathered, streamed_kv) or the Q ring (streamed_q)
    ops = {key: {op for d, op, partial, _ in found if d == "row" and not partial}
           for key, found in per_rank[0].items()}
    for (a, r, c, schedule), row_ops in ops.items():
        assert row_ops == ({"ring"} if schedule == "streamed_q" else {"all_gather"}), row_ops
