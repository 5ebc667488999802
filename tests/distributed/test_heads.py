"""The A x R x C grid (heads all-to-all, then the R x C mesh) against whole-sequence SDPA.

One spawned process group per CP size runs every factorization with A > 1 (a sample at
P = 16) over MHA, GQA and MQA, fp32 / bf16 / fp16, causal or not, b > 1, an explicit
softmax scale, every schedule; each case also checks the bytes sent, counted on the real
collectives, against `traffic.grid_traffic`. Each grid also checks that Q, K, V go out in
one all-to-all and their gradients come back in one (`heads_messages`).
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

import megatron_mesh as mm
from megatron_mesh.layer_plan import grid_shapes
from megatron_mesh.runtime import comm
from megatron_mesh.runtime.heads import scatter_heads

from dist_utils import run_distributed
from reference import (
    CONCRETE_SCHEDULES,
    Case,
    Failure,
    assert_no_failures,
    case_id,
    check_cases,
)


def heads_cases(cp_size: int, q_heads: int) -> list[Case]:
    s = 4 * cp_size  # two rows per zigzag sub-chunk
    h = q_heads
    return [
        Case(s, 2, h, h, 8, causal=True, seed=50),  # MHA
        Case(s, 1, h, 2, 8, causal=False, softmax_scale=0.3, seed=51),  # GQA
        Case(s, 2, h, 1, 8, causal=True, seed=52),  # MQA
        Case(s, 2, h, 2, 16, causal=True, dtype=torch.bfloat16, seed=53),
        Case(s, 1, h, h, 8, causal=False, dtype=torch.float16, seed=54, grad_reduce_dtype="fp32"),
        Case(s, 1, h, 1, 16, causal=True, dtype=torch.bfloat16, seed=55, grad_reduce_dtype="input"),
    ]


def schedule_each(cases: list[Case], offset: int) -> list[Case]:
    """Case i on schedule i + offset of streamed_kv, streamed_q, gathered."""
    n = len(CONCRETE_SCHEDULES)
    return [replace(c, schedule=CONCRETE_SCHEDULES[(i + offset) % n]) for i, c in enumerate(cases)]


class Transfers(comm.Observing):
    """The transfers of this process while the context is open, in order."""

    def __init__(self) -> None:
        self.seen: list[comm.Transfer] = []

    def observe(self, transfer: comm.Transfer) -> None:
        self.seen.append(transfer)

    def heads(self, phase: str) -> list[int]:
        """Bytes sent by each all-to-all of the heads dimension in `phase`."""
        return [t.nbytes for t in self.seen
                if t.direction == "heads" and t.op == "all_to_all" and t.phase == phase]


def heads_messages(grid: mm.MeshGrid) -> list[Failure]:
    """One layer, MQA (K/V heads repeated to A) with V's own head dim: forward sends Q, K, V
    in one all-to-all, then the output in one; backward dO in one, then dQ, dK, dV in one.
    scatter_heads with only q's slice used: dk, dv come back as zeros, in one message."""
    a, s, hq, d, dv = grid.heads, 8, 2 * grid.heads, 8, 4
    g = torch.Generator().manual_seed(grid.cp_rank)
    q, k, v = (torch.randn(s, 1, h, e, generator=g).requires_grad_()
               for h, e in ((hq, d), (1, d), (1, dv)))
    qkv = (a - 1) * (s * hq * d + s * a * (d + dv)) * 4 // a  # K/V heads repeated to A
    out = (a - 1) * s * hq * dv * 4 // a
    with Transfers() as seen:
        y = mm.mesh_attention(q, k, v, grid, schedule="gathered")
        y.backward(torch.randn(y.shape, generator=g))
    bad = []
    for phase, expected in (("forward", [qkv, out]), ("backward", [out, qkv])):
        if seen.heads(phase) != expected:
            bad.append(Failure(case_id(f"heads messages {phase}", grid),
                               f"bytes per all-to-all {seen.heads(phase)}, expected {expected}"))
    q.grad = k.grad = v.grad = None
    with Transfers() as seen:
        qs, _, _ = scatter_heads(q, k, v, grid)
        qs.sum().backward()
    unused = [None if t.grad is None else float(t.grad.abs().sum()) for t in (k, v)]
    if seen.heads("backward") != [qkv] or unused != [0.0, 0.0]:
        bad.append(Failure(case_id("heads messages, dk and dv unused", grid),
                           f"backward all-to-alls {seen.heads('backward')}, expected [{qkv}]; "
                           f"|dk|, |dv| {unused}, expected zeros"))
    return bad


def heads_worker(rank: int, world: int, shapes: list[tuple[int, int, int]],
                 per_shape: int) -> list[Failure]:
    bad = []
    try:
        mm.MeshGrid.build(rows=world, cols=1, heads=2)
        bad.append(Failure(f"P{world} 2x{world}x1 refused", "the grid was accepted"))
    except ValueError as e:
        if "2x" not in str(e) or "valid shapes" not in str(e):
            bad.append(Failure(f"P{world} 2x{world}x1 refused", f"unclear message: {e}"))
    for idx, (heads, rows, cols) in enumerate(shapes):
        grid = mm.MeshGrid.build(rows=rows, cols=cols, heads=heads)
        if (grid.head_index, grid.mesh_rank) != (rank % heads, rank // heads):
            bad.append(Failure(case_id("rank placement", grid), f"rank {rank}: head "
                               f"{grid.head_index} mesh {grid.mesh_rank}"))
        cases = schedule_each(heads_cases(world, max(8, heads)), idx)
        # every shape runs the fp32 MHA case, then `per_shape` more in turn
        picked = [cases[0]] + [cases[1 + (idx * per_shape + k) % (len(cases) - 1)]
                               for k in range(per_shape)]
        bad += check_cases(grid, picked) + (heads_messages(grid) if heads > 1 else [])
    return bad


@pytest.mark.parametrize("cp_size,per_shape", [(4, 5), (8, 2)])
def test_every_heads_shape_matches_sdpa(cp_size: int, per_shape: int) -> None:
    shapes = [s for s in grid_shapes(cp_size) if s[0] > 1]
    assert_no_failures(run_distributed(heads_worker, cp_size, shapes, per_shape))


def test_every_grid_at_sixteen() -> None:
    """Every heads x rows x cols factorization of P = 16 (the 2D meshes, A = 1, included),
    in one spawn of 16 ranks: the fp32 MHA case and one more in turn, each on a schedule
    in turn (exactness and bytes)."""
    assert_no_failures(run_distributed(heads_worker, 16, grid_shapes(16), 1))


def heads_groups_worker(rank: int, world: int) -> list[Failure]:
    """Two CP groups of 4 (strided, DP innermost) as 2x2x1 grids from build_many, and a
    2x1x2 grid over an explicit subgroup built by its members only."""
    groups = [[0, 2, 4, 6], [1, 3, 5, 7]]
    grid = mm.MeshGrid.build_many(groups, rows=2, cols=1, heads=2)
    mine = groups[rank % 2]
    bad = []
    if grid.cp_ranks != tuple(mine) or grid.mesh_ranks != mine[grid.head_index::2]:
        bad.append(Failure(case_id("build_many placement", grid),
                           f"rank {rank}: grid over {grid.cp_ranks}, mesh {grid.mesh_ranks}"))
    if dist.get_process_group_ranks(grid.heads_group) != mine[2 * grid.mesh_rank:][:2]:
        bad.append(Failure(case_id("build_many heads group", grid), f"rank {rank}: heads "
                           f"group {dist.get_process_group_ranks(grid.heads_group)}"))
    bad += check_cases(grid, [Case(16, 1, 4, 2, 8, causal=True, seed=60 + rank % 2)])
    halves = [dist.new_group([0, 1, 2, 3]), dist.new_group([4, 5, 6, 7])]
    grid = mm.MeshGrid.build(rows=1, cols=2, heads=2, group=halves[rank // 4])
    return bad + check_cases(grid, [Case(16, 2, 4, 1, 8, causal=True, seed=62 + rank // 4,
                                         schedule="gathered")])


def test_heads_grids_of_many_cp_groups() -> None:
    assert_no_failures(run_distributed(heads_groups_worker, 8))


def test_heads_must_divide_query_heads() -> None:
    grid = mm.MeshGrid(2, 1, 0, tuple(range(8)), None, None, heads=4)
    q = torch.zeros(4, 1, 6, 8)
    k = torch.zeros(4, 1, 2, 8)
    with pytest.raises(ValueError, match=r"heads=4 .* 6 query heads.*valid sizes: 1, 2, 3, 6"):
        mm.mesh_attention(q, k, k, grid)


def test_kv_repeats_count_only_what_the_slices_need() -> None:
    from megatron_mesh.layer_plan import kv_repeats

    assert [kv_repeats(a, 8) for a in (1, 2, 4, 8, 16)] == [1, 1, 1, 1, 2]
    assert [kv_repeats(a, 1) for a in (1, 2, 4)] == [1, 2, 4]
    assert kv_repeats(6, 4) == 3  # lcm 12 heads: 2 per slice
