"""Bad input raises ValueError naming the value, on every rank, before any collective:
after the errors a good call still runs (no rank was left inside a collective)."""
from __future__ import annotations

import torch

import megatron_mesh as mm

from dist_utils import run_distributed


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


def worker(rank: int, world: int) -> list[str]:
    problems = []
    try:
        mm.MeshGrid.build(rows=3, cols=1)
        problems.append("3x1 on 2 ranks was accepted")
    except ValueError as e:
        if "3x1" not in str(e) or "valid shapes: 2x1, 1x2" not in str(e):
            problems.append(f"unclear grid error: {e}")
    try:
        mm.MeshGrid.build_many([[0, 1], [1, 0]], rows=2, cols=1)
        problems.append("overlapping CP groups were accepted")
    except ValueError as e:
        if "rank 1" not in str(e):
            problems.append(f"unclear CP-group error: {e}")
    grid = mm.MeshGrid.build(rows=2, cols=1)
    for expected, (q, k, v, kw) in bad_calls(grid).items():
        g = kw.pop("grid", grid)
        try:
            mm.mesh_attention(q, k, v, g, **kw)
            problems.append(f"accepted bad input ({expected})")
        except ValueError as e:
            if expected not in str(e):
                problems.append(f"message {str(e)!r} does not say {expected!r}")
    q = torch.randn(4, 1, 2, 16, requires_grad=True)
    mm.mesh_attention(q, q, q, grid).sum().backward()  # collectives still line up
    return problems


def test_bad_input_fails_before_any_collective() -> None:
    problems = sum(run_distributed(worker, 2), [])
    assert not problems, "\n".join(problems)
