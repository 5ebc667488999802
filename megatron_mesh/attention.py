"""Mesh attention: exact attention over a CP group laid out as an A x R x C grid.

With A > 1 an all-to-all over the heads group first gives each rank 1/A of the heads for
A times the tokens (`heads.py`); the R x C mesh then runs on those.

Rank (i, j) computes the R * C rank-blocks of its tile: the Q chunks of its row against
the K/V chunks of its column, one kernel call each (`layout.block_for`). Partial outputs
go back to their owners and merge by log-sum-exp; backward reduces dQ over the row and
dK, dV over the column, in the dtypes of `plan.GradDtype` (by default dQ in fp32, dK, dV in
the input dtype). The schedules move the same bytes (streamed_q: partial
outputs in fp32):
  "gathered": all-gather the tile's Q and K/V, then compute (`gathered.py`);
  "streamed_kv": K/V travel around the column ring, overlapped with compute (`streamed_kv.py`);
  "streamed_q": Q travel around the row ring, overlapped with compute (`streamed_q.py`);
  "streamed": whichever of the two rings holds less memory for the shape, resolved once
  into a `plan.MeshPlan` before anything runs (`plan.resolve_plan`).
"""
from __future__ import annotations

import torch

from . import gathered, heads, streamed_kv, streamed_q
from .checks import check_inputs, check_same_shapes
from .dtypes import GradDtypes
from .grid import MeshGrid
from .kernels import TileKernel, get_kernel
from .plan import resolve_plan
from .values import DEFAULT_GRAD_DTYPE, DEFAULT_SCHEDULE, AttentionShape, GradDtype, MeshPlan, Schedule

_SCHEDULES = {Schedule.GATHERED: gathered, Schedule.STREAMED_KV: streamed_kv,
              Schedule.STREAMED_Q: streamed_q}


def layer_shape(q: torch.Tensor, k: torch.Tensor, grid: MeshGrid) -> AttentionShape:
    """The layer these local q [s, b, hq, d], k [s, b, hkv, d] are one rank's share of."""
    s, b, hq, d = q.shape
    return AttentionShape(s * grid.cp_size, b, hq, k.shape[2], d, q.element_size())


def plan_for(q: torch.Tensor, k: torch.Tensor, grid: MeshGrid,
             schedule: str | Schedule = DEFAULT_SCHEDULE,
             grad_reduce_dtype: str = DEFAULT_GRAD_DTYPE) -> MeshPlan:
    """The plan that runs for these q, k on this grid (`plan.resolve_plan`)."""
    return resolve_plan(layer_shape(q, k, grid), grid.rows, grid.cols, schedule,
                        grad_reduce_dtype, heads=grid.heads)


def grad_dtypes(grads: GradDtype | str, dtype: torch.dtype) -> GradDtypes:
    """The torch dtypes of the dQ and dK, dV exchanges of `grads` for inputs of `dtype`."""
    grads = GradDtype(grads)
    return GradDtypes(torch.float32 if grads.dq_in_fp32 else dtype,
                      torch.float32 if grads.dkv_in_fp32 else dtype)


def resolve_schedule(schedule: str, q: torch.Tensor, k: torch.Tensor, grid: MeshGrid) -> str:
    """The schedule that runs, by name: "streamed" becomes the ring with less extra memory
    for these q [s, b, hq, d] and k [s, b, hkv, d] on this grid."""
    return plan_for(q, k, grid, schedule).schedule.value


class MeshAttentionFunction(torch.autograd.Function):
    """Autograd over a schedule's forward / backward; saves only local tensors and the lse."""

    @staticmethod
    def forward(ctx, q, k, v, grid, causal, scale, kernel, schedule, grads):
        out, lse = _SCHEDULES[schedule].forward(q, k, v, grid, causal, scale, kernel)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (grid, causal, scale, kernel, grads)
        ctx.schedule = schedule
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _SCHEDULES[ctx.schedule].backward(dout, q, k, v, out, lse, *ctx.args)
        return dq, dk, dv, None, None, None, None, None, None


def mesh_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grid: MeshGrid,
    causal: bool = True,
    softmax_scale: float | None = None,
    backend: str | TileKernel = "auto",
    schedule: str = DEFAULT_SCHEDULE,
    grad_reduce_dtype: str = DEFAULT_GRAD_DTYPE,
) -> torch.Tensor:
    """Exact attention of this rank's zigzag share over the whole CP sequence.

    q [s, b, hq, d], k / v [s, b, hkv, d] (Megatron's sbhd; s = S / P, sub-chunks r and
    2P-1-r of 2P for CP rank r) -> out [s, b, hq, d] in q's dtype, differentiable in q, k, v.
    Only the hkv heads travel; GQA / MQA are handled inside the tile kernels (with a heads
    dimension A, K/V heads are repeated to lcm(A, hkv) for the all-to-all).
    backend: tile kernels, 'auto' | 'torch' | 'cudnn' | 'te' (`kernels.get_kernel`), or a
    `TileKernel` object;
    schedule: 'streamed' (the ring of
    'streamed_kv' / 'streamed_q' with less memory for the shape) | 'streamed_kv' | 'streamed_q'
    | 'gathered';
    grad_reduce_dtype: the dtypes the gradient partials travel in: 'mixed' (default: dK, dV in
    the input dtype, as Transformer Engine's ring sends them, dQ in fp32), 'fp32' (all) or
    'input' (all in the input dtype); each rank sums its own blocks in fp32 either way.
    """
    check_inputs(q, k, v, grid, softmax_scale, backend, schedule, grad_reduce_dtype, causal)
    check_same_shapes(q, k, grid)
    plan = plan_for(q, k, grid, schedule, grad_reduce_dtype)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    kernel: TileKernel = get_kernel(backend, q.device, q.dtype, q.shape[-1])
    if grid.heads > 1:
        q, k, v = heads.scatter_heads(q, k, v, grid)
    out = MeshAttentionFunction.apply(
        q, k, v, grid, bool(causal), float(scale), kernel, plan.schedule,
        grad_dtypes(plan.grad_dtype, q.dtype),
    )
    return heads.gather_heads(out, grid) if grid.heads > 1 else out
