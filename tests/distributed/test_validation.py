"""Bad input raises ValueError naming the value, on every rank, before any collective:
after the errors a good call still runs (no rank was left inside a collective)."""
from __future__ import annotations

import datetime
import math
import os

import torch

import megatron_mesh as mm

from dist_utils import run_distributed
from reference import Case, Failure, assert_no_failures, case_id, errors, full_inputs, mesh_result


def bad_calls(grid: mm.MeshGrid) -> dict[str, tuple]:
    q, k = torch.randn(4, 1, 4, 16), torch.randn(4, 1, 2, 16)
    thd = (torch.randn(16, 4, 16), torch.randn(16, 2, 16), torch.randn(16, 2, 16))
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
        "has d = 0": (q[..., :0], k[..., :0], k[..., :0], {}),
        "has dv = 0": (q, k, k[..., :0], {}),
        "has b = 0": (q[:, :0], k[:, :0], k[:, :0], {}),
        "holds 16.5: cumulative lengths must be integers": (
            *thd, {"cu_seqlens": [0, 16.5, 32]}),
        "pass cu_seqlens_padded=None with it": (
            *thd, {"cu_seqlens": mm.Documents.from_cu_seqlens([0, 16, 32]),
                   "cu_seqlens_padded": [0, 16, 32]}),
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
    os.environ["MESH_GROUP_TOKENS"] = "lots"  # the grouped calls' cap: read before the gathers
    try:
        with mm.TrafficCounter() as counter:
            mm.mesh_attention(q, q, q, grid)
        problems.append(Failure("bad input: MESH_GROUP_TOKENS='lots'", "accepted"))
    except ValueError as e:
        if "MESH_GROUP_TOKENS='lots' is not a positive integer" not in str(e):
            problems.append(Failure("bad input: MESH_GROUP_TOKENS", f"unclear error: {e}"))
        if counter.total_bytes:
            problems.append(Failure("bad input: MESH_GROUP_TOKENS",
                                    f"raised after {counter.total_bytes} bytes were sent"))
    finally:
        del os.environ["MESH_GROUP_TOKENS"]
    mm.mesh_attention(q, q, q, grid).sum().backward()  # collectives still line up
    problems += group_tokens_disagreement(rank, grid, q)
    return problems + shape_disagreements(rank, grid, [])


def group_tokens_disagreement(rank: int, grid: mm.MeshGrid, q: torch.Tensor) -> list[Failure]:
    """MESH_GROUP_TOKENS 8 on rank 1, unset on rank 0: every rank raises naming the variable
    and both values; then a call with it unset everywhere runs."""
    if rank == 1:
        os.environ["MESH_GROUP_TOKENS"] = "8"
    problems = []
    try:
        mm.mesh_attention(q, q, q, grid).sum().backward()
        problems.append(Failure("MESH_GROUP_TOKENS differs", f"rank {rank}: accepted"))
    except ValueError as e:
        mine, other = ("8", "unset") if rank == 1 else ("unset", "8")
        text = f"MESH_GROUP_TOKENS {mine} here (CP rank {rank}), {other} on CP rank {1 - rank}"
        if text not in str(e):
            problems.append(Failure("MESH_GROUP_TOKENS differs",
                                    f"rank {rank}: {str(e)!r} does not say {text!r}"))
    finally:
        os.environ.pop("MESH_GROUP_TOKENS", None)
    mm.mesh_attention(q, q, q, grid).sum().backward()
    return problems


def shape_disagreements(rank: int, grid: mm.MeshGrid, odd_ranks: list[int]) -> list[Failure]:
    """Ranks in `odd_ranks` pass s = 8, the others s = 4: every rank must raise naming both;
    then equal shapes run."""
    odd = rank in odd_ranks if odd_ranks else rank == 1
    case = case_id(f"shapes differ on ranks {odd_ranks or [1]}", grid)
    q = torch.randn(8 if odd else 4, 1, 4, 16)
    problems = []
    try:
        mm.mesh_attention(q, q, q, grid)
        problems.append(Failure(case, f"rank {rank}: different shapes were accepted"))
    except ValueError as e:
        for text in ("q [4, 1, 4, 16] k/v [4, 1, 4, 16] float32", "q [8, 1, 4, 16]",
                     f"{grid.shape_text} grid pass different arguments"):
            if text not in str(e):
                problems.append(Failure(case, f"rank {rank}: {str(e)!r} does not say {text!r}"))
    for s in (4, 4, 8, 4):  # after the refusal, agreed shapes (changing) run exactly
        same = Case(s * grid.cp_size, 1, 4, 4, 16, causal=True, seed=s)
        x = full_inputs(same)
        problems += errors(same, mesh_result(same, x, grid, grid.cp_rank), grid,
                           grid.cp_rank, x)
    return problems


SCALE = 0.25
NEXT_SCALE = math.nextafter(SCALE, 1.0)  # the next float: one bit apart


def disagreement_cases(odd: bool) -> dict[str, tuple[dict, tuple[str, ...]]]:
    """name -> (this rank's keyword changes to a good call, texts every rank's error holds,
    besides the odd CP rank); `odd`: this rank is the one that differs."""
    w = (2, 0)
    return {
        "causal": ({"causal": not odd}, ("causal", "True", "False")),
        "softmax_scale": ({"softmax_scale": NEXT_SCALE if odd else SCALE},
                          ("softmax_scale", f"{SCALE!r} ", repr(NEXT_SCALE))),
        "schedule": ({"schedule": "streamed_q" if odd else "streamed_kv"},
                     ("schedule", "'streamed_kv'", "'streamed_q'")),
        "gathered vs streamed": ({"schedule": "gathered" if odd else "streamed_kv"},
                                 ("schedule", "'streamed_kv'", "'gathered'")),
        "window_exchange": ({"window_size": w,
                             "window_exchange": "gathered" if odd else "sparse"},
                            ("window_exchange", "'sparse'", "'gathered'")),
        "grad_reduce_dtype": ({"grad_reduce_dtype": "fp32" if odd else "input"},
                              ("grad_reduce_dtype", "'input'", "'fp32'")),
        "window": ({"window_size": (3, 0) if odd else w}, ("window_size", "(2, 0)", "(3, 0)")),
        "window rejected on one rank": ({"window_size": (2, 1) if odd else w},
                                        ("window_size=(2, 1) with causal=True", "0 or -1")),
        "local length 7 on one rank": ({"s": 7 if odd else 8},
                                       ("sequence length 28 must be divisible by 2 * CP = 8",)),
        "shape changed after an agreed call": ({"s": 16 if odd else 8},
                                               ("shapes", "q [8, 1, 4, 16]", "q [16, 1, 4, 16]")),
        "bf16 on one rank": ({"dtype": torch.bfloat16 if odd else torch.float32},
                             ("shapes", "float32", "bfloat16")),
        # a rank whose inputs need no gradient would skip the backward's collectives
        "no backward on one rank": ({"grad": not odd},
                                    ("backward", "to run (inputs need gradients)", "none")),
    }


def good_call(grid: mm.MeshGrid, s: int = 8, dtype: torch.dtype = torch.float32,
              grad: bool = True, **options) -> torch.Tensor:
    """Forward (and backward, when the inputs need gradients) of one call on [s, 1, 4, 16]
    inputs (the same on every rank)."""
    g = torch.Generator().manual_seed(s)
    q, k, v = (torch.randn(s, 1, 4, 16, generator=g).to(dtype).requires_grad_(grad)
               for _ in range(3))
    out = mm.mesh_attention(q, k, v, grid, **options)
    if grad:
        out.float().sum().backward()
    return out.detach()


def disagreements(rank: int, grid: mm.MeshGrid, odd_rank: int) -> list[Failure]:
    """After an agreed call, each way of passing different arguments on one rank raises
    ValueError on EVERY rank naming both values (or the rejection), with no hang; a good
    call then still runs and is the same as before (no rank was left in a collective)."""
    problems = []
    before = good_call(grid, causal=True, softmax_scale=SCALE)
    for name, (changes, texts) in disagreement_cases(rank == odd_rank).items():
        case = case_id(f"{name} differs on CP rank {odd_rank}", grid)
        options = {"causal": True, "softmax_scale": SCALE, **changes}
        try:
            good_call(grid, **options)
            problems.append(Failure(case, f"rank {rank}: accepted"))
        except ValueError as e:
            problems += [Failure(case, f"rank {rank}: {str(e)!r} does not say {text!r}")
                         for text in (*texts, f"CP rank {odd_rank}") if text not in str(e)]
    case = case_id(f"cu_seqlens differ on CP rank {odd_rank}", grid)
    thd = torch.randn(8, 4, 16)  # 32 packed tokens over 4 ranks
    try:
        mm.mesh_attention(thd, thd, thd, grid,
                          cu_seqlens=[0, 8, 32] if rank == odd_rank else [0, 16, 32])
        problems.append(Failure(case, f"rank {rank}: accepted"))
    except ValueError as e:
        problems += [Failure(case, f"rank {rank}: {str(e)!r} does not say {text!r}")
                     for text in ("documents", "cu_seqlens [0, 16, 32]", "cu_seqlens [0, 8, 32]",
                                  f"CP rank {odd_rank}") if text not in str(e)]
    after = good_call(grid, causal=True, softmax_scale=SCALE)
    if not torch.equal(before, after):
        problems.append(Failure(case_id("after the disagreements", grid), "output changed"))
    return problems


def worker4(rank: int, world: int) -> list[Failure]:
    """Only one rank disagrees: in a 2x2 mesh the row and column of the odd rank see it
    directly, the rank diagonal to it only through the CP-wide agreement."""
    timeout = datetime.timedelta(seconds=60)
    problems = shape_disagreements(rank, mm.MeshGrid.build(rows=2, cols=2), [2])
    problems += shape_disagreements(rank, mm.MeshGrid.build(rows=2, cols=1, heads=2), [3])
    for heads, rows, cols in ((1, 1, 4), (1, 2, 2), (1, 4, 1), (2, 1, 2)):
        grid = mm.MeshGrid.build(rows=rows, cols=cols, heads=heads, timeout=timeout)
        problems += disagreements(rank, grid, odd_rank=3 if rows == 2 else 1)
    return problems


def test_bad_input_fails_before_any_collective() -> None:
    assert_no_failures(run_distributed(worker, 2))


def test_different_shapes_on_ranks_of_one_grid_fail_on_every_rank() -> None:
    assert_no_failures(run_distributed(worker4, 4, timeout_s=60, job_timeout_s=600))
