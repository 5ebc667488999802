"""Bad input raises ValueError naming the value, on every rank, before any collective:
after the errors a good call still runs (no rank was left inside a collective)."""
from __future__ import annotations

import torch

import megatron_mesh as mm
from megatron_mesh import checks

from dist_utils import run_distributed
from reference import Failure, assert_no_failures, case_id


def bad_calls(grid: mm.MeshGrid) -> dict[str, tuple]:
    q, k = torch.randn(4, 1, 4, 16), torch.randn(4, 1, 2, 16)
    return {
        "4-D": (torch.randn(4, 4, 16), k, k, {}),
        "multiple of k/v heads 3": (q, torch.randn(4, 1, 3, 16), torch.randn(4, 1, 3, 16), {}),
        "divisible by 2 * CP = 4": (torch.randn(3, 1, 4, 16), torch.randn(3, 1, 2, 16),
                                    torch.randn(3, 1, 2, 16), {}),
        "dtypes differ": (q, k.half(), k.half(), {}),
        "must agree in s, b and d": (q, torch.randn(4, 1, 2, 32), torch.randn(4, 1, 2, 32), {}),
        "v shape": (q, k, torch.randn(4, 1, 1, 16), {}),
        "is not one of float32": (q.double(), k.double(), k.double(), {}),
        "softmax_scale=-1.0": (q, k, k, {"softmax_scale": -1.0}),
        "softmax_scale='0.1'": (q, k, k, {"softmax_scale": "0.1"}),
        "softmax_scale=nan": (q, k, k, {"softmax_scale": float("nan")}),
        "causal='no'": (q, k, k, {"causal": "no"}),
        "q is a meta tensor": (q.to("meta"), k, k, {}),
        "backend='cudnn'": (q, k, k, {"backend": "cudnn"}),
        "schedule='ring'": (q, k, k, {"schedule": "ring"}),
        "grad_reduce_dtype='bf16'": (q, k, k, {"grad_reduce_dtype": "bf16"}),
        "grid must be a MeshGrid": (q, k, k, {"grid": "2x1"}),
    }


def worker(rank: int, world: int) -> list[Failure]:
    problems = []
    try:
        mm.MeshGrid.build(rows=3, cols=1)
        problems.append(Failure("grid 3x1 on 2 ranks", "accepted"))
    except ValueError as e:
        if "3x1" not in str(e) or "valid shapes: 2x1, 1x2" not in str(e):
            problems.append(Failure("grid 3x1 on 2 ranks", f"unclear error: {e}"))
    try:
        mm.MeshGrid.build_many([[0, 1], [1, 0]], rows=2, cols=1)
        problems.append(Failure("overlapping CP groups", "accepted"))
    except ValueError as e:
        if "rank 1" not in str(e):
            problems.append(Failure("overlapping CP groups", f"unclear error: {e}"))
    grid = mm.MeshGrid.build(rows=2, cols=1)
    for expected, (q, k, v, kw) in bad_calls(grid).items():
        g = kw.pop("grid", grid)
        try:
            mm.mesh_attention(q, k, v, g, **kw)
            problems.append(Failure(f"bad input: {expected}", "accepted"))
        except ValueError as e:
            if expected not in str(e):
                problems.append(Failure(f"bad input: {expected}",
                                        f"message {str(e)!r} does not say it"))
    q = torch.randn(4, 1, 2, 16, requires_grad=True)
    mm.mesh_attention(q, q, q, grid).sum().backward()  # collectives still line up
    return problems + shape_disagreements(rank, grid, [])


def shape_disagreements(rank: int, grid: mm.MeshGrid, odd_ranks: list[int]) -> list[Failure]:
    """Ranks in `odd_ranks` pass s = 8, the others s = 4: every rank must raise naming both;
    then equal shapes run, and the shape check's gather runs once per new shape, not per call."""
    odd = rank in odd_ranks if odd_ranks else rank == 1
    case = case_id(f"shapes differ on ranks {odd_ranks or [1]}", grid)
    q = torch.randn(8 if odd else 4, 1, 4, 16)
    problems = []
    try:
        mm.mesh_attention(q, q, q, grid)
        problems.append(Failure(case, f"rank {rank}: different shapes were accepted"))
    except ValueError as e:
        for text in ("q [4, 1, 4, 16] k/v [4, 1, 4, 16] float32", "q [8, 1, 4, 16]",
                     f"{grid.shape_text} grid pass different shapes"):
            if text not in str(e):
                problems.append(Failure(case, f"rank {rank}: {str(e)!r} does not say {text!r}"))
    gathers = []
    real = checks._gather_signatures
    checks._gather_signatures = lambda *a: gathers.append(1) or real(*a)
    try:
        for s in (4, 4, 4, 8, 8, 4):
            q = torch.randn(s, 1, 4, 16, requires_grad=True)
            mm.mesh_attention(q, q, q, grid).sum().backward()
    finally:
        checks._gather_signatures = real
    per_shape = sum(1 for n in (grid.rows, grid.cols, grid.heads) if n > 1)
    if len(gathers) != 2 * per_shape:  # s = 4 and s = 8, once each (s = 4 failed before)
        problems.append(Failure(case, f"rank {rank}: {len(gathers)} shape gathers for 2 new "
                                "shapes"))
    return problems


def worker4(rank: int, world: int) -> list[Failure]:
    """Only one rank disagrees: in a 2x2 mesh the row and column of the odd rank see it
    directly, the rank diagonal to it only through the second gather."""
    problems = shape_disagreements(rank, mm.MeshGrid.build(rows=2, cols=2), [2])
    return problems + shape_disagreements(rank, mm.MeshGrid.build(rows=2, cols=1, heads=2), [3])


def test_bad_input_fails_before_any_collective() -> None:
    assert_no_failures(run_distributed(worker, 2))


def test_different_shapes_on_ranks_of_one_grid_fail_on_every_rank() -> None:
    assert_no_failures(run_distributed(worker4, 4))
