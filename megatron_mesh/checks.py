"""The checks of `mesh_attention`'s arguments: every check is local (no collective). A
call's rejection reaches every rank of its grid through `runtime.agreement.refuse`, and
whether the ranks pass the same arguments is `runtime.agreement.agree`'s."""
from __future__ import annotations

import math

import torch

from .cost_models.tile_calls import group_tokens
from .kernels import check_backend
from .layer_plan import DEFAULT_SCHEDULE, check_grad_reduce_dtype, check_heads, check_schedule_name
from .masks.zigzag import check_zigzag_divisible
from .runtime.grid import MeshGrid

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_options(backend: str, schedule: str, grad_reduce_dtype: str) -> None:
    """ValueError unless the tile backend, schedule and gradient dtype are known names and
    the grouped calls' cap in the environment (MESH_GROUP_TOKENS) is a number of tokens."""
    check_backend(backend)
    check_schedule_name(schedule)
    check_grad_reduce_dtype(grad_reduce_dtype)
    group_tokens()


def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grid: MeshGrid,
    softmax_scale: float | None,
    backend: str,
    schedule: str = DEFAULT_SCHEDULE,
    grad_reduce_dtype: str = "fp32",
    causal: bool = True,
) -> None:
    """Raise ValueError naming the bad value and what is valid."""
    if not isinstance(grid, MeshGrid):
        raise ValueError(f"grid must be a MeshGrid (from MeshGrid.build), got {type(grid).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [s, b, h, d], got shape {tuple(t.shape)}")
        if t.is_meta:
            raise ValueError(f"{name} is a meta tensor (no data); pass tensors on a CPU or CUDA device")
        if t.dtype not in DTYPES:
            raise ValueError(f"{name}.dtype={t.dtype} is not one of float32, bfloat16, float16")
    for name, t, dims in (("q", q, "s b hq d"), ("k", k, "s b hkv d"), ("v", v, "s b hkv dv")):
        for dim, n in zip(dims.split(), t.shape):
            if n < 1:
                raise ValueError(f"{name} shape {tuple(t.shape)} [{', '.join(dims.split())}] "
                                 f"has {dim} = {n}; every dimension must be at least 1")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}; they must match")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v devices differ: {q.device}, {k.device}, {v.device}; they must match")
    if k.shape[:3] != v.shape[:3] or v.shape[3] < 1:
        raise ValueError(f"k shape {tuple(k.shape)} and v shape {tuple(v.shape)} must agree in "
                         "s, b and heads ([s, b, hkv, d] vs [s, b, hkv, dv]; V may have its "
                         "own head dim dv)")
    s, b, hq, d = q.shape
    if (k.shape[0], k.shape[1], k.shape[3]) != (s, b, d):
        raise ValueError(
            f"q shape {tuple(q.shape)} and k shape {tuple(k.shape)} must agree in s, b and d "
            "([s, b, hq, d] vs [s, b, hkv, d])"
        )
    hkv = k.shape[2]
    if hkv < 1 or hq % hkv != 0:
        raise ValueError(f"q heads {hq} must be a multiple of k/v heads {hkv}")
    check_heads(grid.heads, hq, hkv)
    if s < 1:
        raise ValueError(f"q has local sequence length {s}; it must be positive")
    check_zigzag_divisible(s * grid.cp_size, grid.cp_size)
    if softmax_scale is not None and (
            isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float))
            or not math.isfinite(softmax_scale) or not softmax_scale > 0):
        raise ValueError(f"softmax_scale={softmax_scale!r} must be a positive finite float or None")
    if not isinstance(causal, bool):
        raise ValueError(f"causal={causal!r} must be True or False")
    check_options(backend, schedule, grad_reduce_dtype)
