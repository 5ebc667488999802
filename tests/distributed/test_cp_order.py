"""A CP group given in any order (`MeshGrid.build_many`, global ranks in CP order, e.g.
[1, 0, 2, 3]) is exact: torch numbers a group's ranks by ascending global rank, while the
mesh reads the pieces of its collectives in CP order (`grid.group_order`)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

import megatron_mesh as mm

from dist_utils import run_distributed
from reference import Case, Failure, assert_no_failures, check_cases

# (heads, rows, cols), schedule: every collective of every schedule over a permuted group
GRIDS = [((1, 1, 4), "gathered"), ((1, 2, 2), "streamed_kv"), ((4, 1, 1), "streamed_kv"),
         ((1, 2, 2), "streamed_q"), ((1, 2, 2), "gathered"), ((1, 4, 1), "gathered"),
         ((2, 1, 2), "streamed_q")]
ORDERS = [[[1, 0, 2, 3]], [[3, 1, 0, 2]], [[0, 1, 2, 3]]]


def window_failures(grid: mm.MeshGrid, order: list[list[int]]) -> list[Failure]:
    """A sliding window (5, 0) on S = 32, both window exchanges (the sparse one sends rows
    point to point by global rank), against SDPA with the mask built here."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(32, 1, h, 8, generator=g) for h in (4, 2, 2))
    i = torch.arange(32)
    seen = (i[None] <= i[:, None]) & (i[None] >= i[:, None] - 5)
    ref = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)),
                                         attn_mask=seen, enable_gqa=True).permute(2, 0, 1, 3)
    share = lambda t: mm.zigzag_split(t, grid.cp_size)[grid.cp_rank]  # noqa: E731
    bad = []
    for exchange in ("sparse", "gathered"):
        got = mm.mesh_attention(share(q), share(k), share(v), grid, window_size=(5, 0),
                                window_exchange=exchange)
        err = (got - share(ref)).abs().max().item()
        if err > 1e-5:
            bad.append(Failure(f"order {order} {grid.shape_text} window {exchange}",
                               f"max error {err:.3g}"))
    return bad


def worker(rank: int, world: int) -> list[Failure]:
    problems = []
    for order in ORDERS:
        for (heads, rows, cols), schedule in GRIDS:
            grid = mm.MeshGrid.build_many(order, rows=rows, cols=cols, heads=heads)
            if grid.cp_rank != order[0].index(rank):
                problems.append(Failure(f"{order}", f"rank {rank} got CP rank {grid.cp_rank}"))
            cases = [Case(16, 1, 4, 2, 8, True, schedule=schedule, seed=3),
                     Case(16, 2, 4, 4, 8, False, schedule=schedule, seed=4)]
            problems += [Failure(f"order {order} {f.case}", f.message)
                         for f in check_cases(grid, cases)]
            if schedule != "streamed_q":
                problems += window_failures(grid, order)
    # two CP groups, each out of order
    grid = mm.MeshGrid.build_many([[2, 0], [3, 1]], rows=1, cols=2)
    for schedule in ("gathered", "streamed_kv"):
        problems += [Failure(f"order [[2, 0], [3, 1]] {f.case}", f.message)
                     for f in check_cases(grid, [Case(16, 1, 2, 2, 8, True, schedule=schedule)])]
    return problems


def test_cp_groups_in_any_order_are_exact() -> None:
    assert_no_failures(run_distributed(worker, 4))
