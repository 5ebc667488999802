"""The planner's kernel calls of a mesh fold the causal diagonal exactly where the kernel
does (`kernels.backend_folds_diagonal`, the tiles' own `folds_diagonal` rule): torch's kernel
in fp16 / bf16 (CUDA's flash op), not in fp32 (the memory-efficient op), cuDNN's never."""
from __future__ import annotations

import pytest
import torch

from megatron_mesh.cost_models.tile_calls import backward_calls, forward_calls
from megatron_mesh.kernels import TorchFlashKernel, backend_folds_diagonal
from megatron_mesh.kernels.base import folds_diagonal
from megatron_mesh.planner import Workload
from megatron_mesh.planner.pricing.tiles import mesh_calls

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("backend", ["torch", "cudnn", "te", None])
def test_mesh_calls_fold_the_diagonal_where_the_kernel_does(backend, dtype) -> None:
    rows, cols = 4, 1
    workload = Workload(seq_length=8192, num_heads=8, num_kv_heads=8, head_dim=64,
                        dtype=dtype, mesh_schedule="gathered")
    # torch's flash op and TE ("causal_bottom_right") in fp16 / bf16; not cuDNN's top-left
    folds = (backend or "torch") in ("torch", "te") and dtype != "fp32"
    q = torch.empty(64, 1, 8, 64, dtype=DTYPES[dtype], device="meta")  # not the CPU
    if (backend or "torch") == "torch":
        assert folds_diagonal(TorchFlashKernel(), q) is folds  # the tiles' own rule
    assert backend_folds_diagonal(backend or "torch", DTYPES[dtype]) is folds
    got = mesh_calls(workload, rows * cols, rows, cols, backend=backend)
    schedule = workload.mesh_plan(rows, cols).schedule
    kw = dict(bottom_right=folds)  # chunks of 2K tokens: no call is cut by a token cap
    assert (got.forward, got.backward) == (
        forward_calls(rows, cols, True, schedule, **kw),
        backward_calls(rows, cols, True, schedule, **kw))
    # the grid is one where folding changes the count: the test tells the two apart
    other = dict(bottom_right=not folds)
    assert (got.forward, got.backward) != (
        forward_calls(rows, cols, True, schedule, **other),
        backward_calls(rows, cols, True, schedule, **other))


def test_backend_folds_diagonal_names_the_valid_backends() -> None:
    with pytest.raises(ValueError, match="backend='flash' is not one of torch, cudnn, te"):
        backend_folds_diagonal("flash", torch.bfloat16)
