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

import inspect
from dataclasses import dataclass, field

import torch

from . import agreement, gathered, heads, streamed_kv, streamed_q, windowed
from .agreement import CallSignature
from .checks import check_inputs
from .documents import Documents
from .dtypes import GradDtypes
from .grid import MeshGrid
from .kernels import TileKernel, get_kernel, is_kernel, takes_documents
from .layout import AttentionMask
from .plan import resolve_plan
from .values import (
    DEFAULT_GRAD_DTYPE,
    DEFAULT_SCHEDULE,
    AttentionShape,
    GradDtype,
    MeshPlan,
    Schedule,
    one_of,
)
from .window import Window, window_of

_SCHEDULES = {Schedule.GATHERED: gathered, Schedule.STREAMED_KV: streamed_kv,
              Schedule.STREAMED_Q: streamed_q}


def layer_shape(q: torch.Tensor, k: torch.Tensor, grid: MeshGrid,
                v: torch.Tensor | None = None) -> AttentionShape:
    """The layer these local q [s, b, hq, d], k [s, b, hkv, d] (and v [s, b, hkv, dv],
    dv = d when not given) are one rank's share of."""
    s, b, hq, d = q.shape
    dv = None if v is None or v.shape[-1] == d else v.shape[-1]
    return AttentionShape(s * grid.cp_size, b, hq, k.shape[2], d, q.element_size(),
                          v_head_dim=dv)


def plan_for(q: torch.Tensor, k: torch.Tensor, grid: MeshGrid,
             schedule: str | Schedule = DEFAULT_SCHEDULE,
             grad_reduce_dtype: str = DEFAULT_GRAD_DTYPE,
             v: torch.Tensor | None = None) -> MeshPlan:
    """The plan that runs for these q, k (, v) on this grid (`plan.resolve_plan`)."""
    return resolve_plan(layer_shape(q, k, grid, v), grid.rows, grid.cols, schedule,
                        grad_reduce_dtype, heads=grid.heads)


def grad_dtypes(grads: GradDtype | str, dtype: torch.dtype) -> GradDtypes:
    """The torch dtypes of the dQ and dK, dV exchanges of `grads` for inputs of `dtype`."""
    grads = GradDtype(grads)
    return GradDtypes(torch.float32 if grads.dq_in_fp32 else dtype,
                      torch.float32 if grads.dkv_in_fp32 else dtype)


WINDOW_EXCHANGES = ("sparse", "gathered")


def _schedule(schedule: Schedule, mask: AttentionMask, window_exchange: str = "sparse"):
    """The module that runs: under a sliding window the sparse exchange of `windowed` (it
    moves only the rows the blocks use), or with window_exchange 'gathered' the gathered
    schedule (whole chunks, as Transformer Engine's all_gather does under a window); else
    the plan's schedule."""
    if mask.window is None:
        return _SCHEDULES[schedule]
    return windowed if window_exchange == "sparse" else gathered


class MeshAttentionFunction(torch.autograd.Function):
    """Autograd over a schedule's forward / backward; saves only local tensors and the lse."""

    @staticmethod
    def forward(ctx, q, k, v, grid, mask, scale, kernel, schedule, grads,
                window_exchange="sparse"):
        runner = _schedule(schedule, mask, window_exchange)
        out, lse = runner.forward(q, k, v, grid, mask, scale, kernel)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (grid, mask, scale, kernel, grads)
        ctx.runner = runner
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.runner.backward(dout, q, k, v, out, lse, *ctx.args)
        return dq, dk, dv, None, None, None, None, None, None, None


@dataclass(frozen=True)
class MeshAttention:
    """One layer's mesh attention, decided once: its grid, plan (shape, schedule, gradient
    dtypes), tile kernel, mask kind and softmax scale. Calling it runs the layer on local
    tensors of the shape it was built for; nothing on that path re-derives a decision.
    `build` makes one from the layer's first inputs (`mesh_attention` does, per call)."""

    grid: MeshGrid
    plan: MeshPlan
    kernel: TileKernel
    causal: bool
    softmax_scale: float
    signature: tuple = field(repr=False)  # (q shape, k shape, dtype, device) it was built for
    window: Window | None = None  # the sliding window (`window.window_of`), None: none
    window_exchange: str = "sparse"  # under a window: 'sparse' rows or 'gathered' chunks

    @classmethod
    def build(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: MeshGrid,
              causal: bool = True, softmax_scale: float | None = None,
              backend: str | TileKernel = "auto", schedule: str = DEFAULT_SCHEDULE,
              grad_reduce_dtype: str = DEFAULT_GRAD_DTYPE, packed: bool = False,
              window_size: tuple[int, int] | None = None,
              window_exchange: str = "sparse") -> MeshAttention:
        """Check q, k, v [s, b, h, d] and the options (ValueError, before any collective)
        and decide the layer's plan and kernel (`packed`: for packed documents;
        `window_size`: a sliding window, `window.window_of`; `window_exchange`: what
        travels under it, `mesh_attention`)."""
        check_inputs(q, k, v, grid, softmax_scale, backend, schedule, grad_reduce_dtype, causal)
        one_of("window_exchange", window_exchange, WINDOW_EXCHANGES)
        window = window_of(window_size, causal)
        if window is not None:
            backend = window_backend(backend)
        plan = plan_for(q, k, grid, schedule, grad_reduce_dtype, v)
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        kernel = get_kernel(backend, q.device, q.dtype, q.shape[-1], documents=packed,
                            v_head_dim=v.shape[-1])
        return cls(grid, plan, kernel, bool(causal), float(scale), _signature(q, k, v), window,
                   window_exchange)

    def matches(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None) -> bool:
        """Whether q, k (, v) have the shapes, dtype and device this layer was built for."""
        return _signature(q, k, v) == self.signature

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 documents: Documents | None = None) -> torch.Tensor:
        """q [s, b, hq, d], k [s, b, hkv, d], v [s, b, hkv, dv] -> out [s, b, hq, dv]; with
        `documents` (packed sequences, b = 1) the local tensors are this rank's THD share.
        Collective: every rank of the grid first agrees on the call (`agreement.agree`:
        ValueError on every rank unless all pass the same shapes, documents and options)."""
        grid = self.grid
        try:
            self.check_call(q, k, v, documents)
            signature = self.call_signature(q, k, v, documents)
        except Exception as error:  # noqa: BLE001 - every rank must hear of it
            agreement.refuse(grid, error)
        agreement.agree(grid, signature)
        mask = AttentionMask(self.causal, documents, grid.rows * grid.cols, self.window)
        if grid.heads > 1:
            q, k, v = heads.scatter_heads(q, k, v, grid, documents)
        out = MeshAttentionFunction.apply(
            q, k, v, grid, mask, self.softmax_scale, self.kernel, self.plan.schedule,
            grad_dtypes(self.plan.grad_dtype, q.dtype), self.window_exchange,
        )
        return heads.gather_heads(out, grid, documents) if grid.heads > 1 else out

    def check_call(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   documents: Documents | None = None) -> None:
        """ValueError unless q, k, v (and `documents`) fit this layer; local, no collective."""
        if not self.matches(q, k, v) or v.shape[:3] != k.shape[:3]:
            raise ValueError(
                f"this MeshAttention was built for {self.signature[:2]} (q, k shapes) and V "
                f"head dim {self.signature[4]}, got {tuple(q.shape)}, {tuple(k.shape)}, "
                f"v {tuple(v.shape)}; build one per shape")
        if documents is not None and not takes_documents(self.kernel):
            raise ValueError("this MeshAttention was built without packed documents "
                             "(MeshAttention.build(..., packed=True) takes them)")
        if documents is not None:
            documents.check_cp(self.grid.cp_size, q.shape[0])

    def call_signature(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       documents: Documents | None = None) -> CallSignature:
        """What every rank of the grid must pass alike for this call (`agreement.py`)."""
        window = None if self.window is None else (self.window.left, self.window.right)
        return CallSignature(
            tuple(q.shape), tuple(k.shape), v.shape[-1], q.dtype, documents, self.causal,
            self.softmax_scale, self.plan.schedule.value, GradDtype(self.plan.grad_dtype).value,
            window, self.window_exchange, (self.grid.heads, self.grid.rows, self.grid.cols))


def _signature(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None) -> tuple:
    dv = k.shape[-1] if v is None else v.shape[-1]
    return tuple(q.shape), tuple(k.shape), q.dtype, q.device, dv


def window_backend(backend: str | TileKernel) -> str | TileKernel:
    """The backend that runs sliding-window tiles (a `mask` keyword): torch's ops for
    'auto'; a named backend or kernel object without them is a ValueError."""
    if backend == "auto":
        return "torch"
    if is_kernel(backend):
        if "mask" not in inspect.signature(backend.forward).parameters:
            raise ValueError(f"the tile kernel {getattr(backend, 'name', backend)!r} takes no "
                             "sliding-window mask; use backend='torch' or 'auto'")
        return backend
    if backend != "torch":
        raise ValueError(f"backend={backend!r} does not take sliding windows (window_size); "
                         "use backend='torch' or 'auto'")
    return backend


def packed_documents(cu_seqlens: torch.Tensor | list[int] | Documents | None,
                     cu_seqlens_padded: torch.Tensor | list[int] | None = None
                     ) -> Documents | None:
    """The `Documents` of Megatron's cumulative lengths (None without them); a `Documents`
    value is taken as it is. Reads the tensors once (a device-to-host copy on a GPU): a
    caller that runs many layers on one packed batch resolves it once and passes the value."""
    if cu_seqlens is None:
        if cu_seqlens_padded is not None:
            raise ValueError("cu_seqlens_padded was given without cu_seqlens")
        return None
    if isinstance(cu_seqlens, Documents):
        if cu_seqlens_padded is not None:
            raise ValueError("cu_seqlens is a Documents value, which holds the padded lengths "
                             f"already (cu_padded {list(cu_seqlens.cu_padded)}); pass "
                             "cu_seqlens_padded=None with it, or both as cumulative lengths")
        return cu_seqlens
    return Documents.from_cu_seqlens(cu_seqlens, cu_seqlens_padded)


def as_sbhd(documents: Documents | None, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """THD tensors [t, h, d] as [t, 1, h, d] with packed documents (ValueError unless 3-D);
    the tensors as they are without."""
    if documents is None:
        return tensors
    for name, t in zip("qkv", tensors):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"with cu_seqlens (packed documents), {name} must be 3-D "
                             f"[t, h, d] (THD), got {shape}")
    return tuple(t.unsqueeze(1) for t in tensors)


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
    cu_seqlens: torch.Tensor | Documents | None = None,
    cu_seqlens_padded: torch.Tensor | None = None,
    window_size: tuple[int, int] | None = None,
    window_exchange: str = "sparse",
) -> torch.Tensor:
    """Exact attention of this rank's zigzag share over the whole CP sequence.

    q [s, b, hq, d], k [s, b, hkv, d], v [s, b, hkv, dv] (Megatron's sbhd; s = S / P,
    sub-chunks r and 2P-1-r of 2P for CP rank r; dv = d, or V's own head dim as in
    multi-latent attention) -> out [s, b, hq, dv] in q's dtype, differentiable in q, k, v.
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
    cu_seqlens: packed documents (THD). q [t, hq, d], k / v [t, hkv, d] hold this rank's
    share in Transformer Engine's CP layout (`documents.py`: pieces r and 2P-1-r of every
    document); cu_seqlens is the int32 [n + 1] cumulative document lengths of the WHOLE
    packed sequence, the same on every rank; cu_seqlens_padded (optional) the padded ones,
    each a multiple of 2P (without it the lengths themselves must be). Attention never
    crosses a document; padding tokens get output 0 and zero gradients. A `Documents`
    value may stand for both (resolved once by the caller).
    window_size: a sliding window (left, right) as Transformer Engine and flash-attention
    define it: query i sees keys i - left .. i + right of the whole sequence (of its
    document when packed), -1 unbounded; with causal=True right is 0 or -1 (both mean 0).
    Blocks with no pair inside the window are not computed (`window.py`).
    window_exchange: under a window, 'sparse' (default: each rank receives only the rows its
    blocks use, `windowed.py`, whatever the schedule) or 'gathered' (the gathered schedule's
    whole chunks: on a P x 1 grid what Transformer Engine's all_gather moves under a window,
    O(S) bytes; for comparison).
    """
    if not isinstance(grid, MeshGrid):  # no group to tell the other ranks
        raise ValueError(f"grid must be a MeshGrid (from MeshGrid.build), got "
                         f"{type(grid).__name__}")
    try:  # local checks; a rejection is told to every rank of the grid (`agreement.py`)
        documents = packed_documents(cu_seqlens, cu_seqlens_padded)
        q, k, v = as_sbhd(documents, q, k, v)
        layer = MeshAttention.build(q, k, v, grid, causal, softmax_scale, backend, schedule,
                                    grad_reduce_dtype, packed=documents is not None,
                                    window_size=window_size, window_exchange=window_exchange)
    except Exception as error:  # noqa: BLE001 - every rank must hear of it
        agreement.refuse(grid, error)
    out = layer(q, k, v, documents)
    return out if documents is None else out.squeeze(1)
