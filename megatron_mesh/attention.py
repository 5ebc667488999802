"""Mesh attention: exact attention over a CP group laid out as an A x R x C grid.

With A > 1 an all-to-all over the heads group first gives each rank 1/A of the heads for
A times the tokens (`heads.py`); the R x C mesh then runs on those.

Rank (i, j) computes the R * C rank-blocks of its tile: the Q chunks of its row against
the K/V chunks of its column (`layout.block_for`), in few kernel calls
(`blocks.forward_tile`). Partial outputs go back to their owners and merge by log-sum-exp;
backward reduces dQ over the row and dK, dV over the column, in the dtypes of
`layer_plan.GradDtype` (by default dQ in fp32, dK, dV in the input dtype). The schedules
move the same bytes (streamed_q: partial outputs in fp32):
  "gathered": all-gather the tile's Q and K/V, then compute (`gathered.py`);
  "streamed_kv": K/V travel around the column ring, overlapped with compute (`streamed_kv.py`);
  "streamed_q": Q travel around the row ring, overlapped with compute (`streamed_q.py`);
  "streamed": whichever of the two rings holds less memory for the shape, resolved once
  into a `layer_plan.MeshPlan` before anything runs (`cost_models.plan.resolve_plan`).
Masks that leave rows unused (windows, placed documents, slice masks) run the sparse
exchange instead, whatever the schedule (`schedules/sparse.py`).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable

import torch

from .calls.layout import AttentionMask
from .checks import check_inputs
from .cost_models.plan import resolve_plan
from .cost_models.sparse import sparse_traffic
from .cost_models.tile_calls import env_group_tokens
from .cost_models.traffic import mesh_traffic
from .dtypes import GradDtypes
from .kernels import WINDOWS, TileKernel, backend_for, caps_of, get_kernel
from .layer_plan import (
    DEFAULT_GRAD_DTYPE,
    DEFAULT_SCHEDULE,
    AttentionShape,
    Exchange,
    GradDtype,
    MeshPlan,
    Runner,
    Schedule,
    one_of,
)
from .masks.document_placement import DocumentPlacement
from .masks.documents import Documents
from .masks.mask import Mask, packed_documents, resolve_mask
from .masks.placed_documents import check_placement, check_placement_documents, mesh_placement
from .masks.sink import add_sink, check_offset, sink_grad
from .masks.slices import SliceMask
from .masks.window import Window
from .runtime import agreement, heads
from .runtime.agreement import CallSignature
from .runtime.grid import MeshGrid
from .schedules import gathered, sparse, streamed_kv, streamed_q
from .schedules.delta import attention_delta

RUNNERS = {Runner.GATHERED: gathered, Runner.STREAMED_KV: streamed_kv,
           Runner.STREAMED_Q: streamed_q, Runner.SPARSE: sparse}  # what `MeshPlan.runner` names


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
             v: torch.Tensor | None = None, exchange: Exchange = Exchange.DENSE) -> MeshPlan:
    """The plan that runs for these q, k (, v) on this grid (`plan.resolve_plan`)."""
    return resolve_plan(layer_shape(q, k, grid, v), grid.rows, grid.cols, schedule,
                        grad_reduce_dtype, heads=grid.heads, exchange=exchange)


def grad_dtypes(grads: GradDtype | str, dtype: torch.dtype) -> GradDtypes:
    """The torch dtypes of the dQ and dK, dV exchanges of `grads` for inputs of `dtype`."""
    grads = GradDtype(grads)
    return GradDtypes(torch.float32 if grads.dq_in_fp32 else dtype,
                      torch.float32 if grads.dkv_in_fp32 else dtype)


WINDOW_EXCHANGES = ("sparse", "gathered")
# a mask given as slices takes the sparse exchange where the rank sending most sends at most
# this share of the dense exchange's bytes
SPARSE_PAYS = 0.5


# the decisions kept: a few layers' shapes and masks (a run's masks change per micro-batch)
SPARSE_PAYS_KEPT = 64
_PAYS: OrderedDict[tuple, bool] = OrderedDict()


def pays_key(mask: Mask) -> tuple:
    """What of `mask` decides `sparse_pays`, as a few ints whatever its size: causal, the
    window's sides, and the digests its documents, placement and slices carry (made once
    with each value, the ones the ranks agree on)."""
    window = None if mask.window is None else (mask.window.left, mask.window.right)
    return (mask.causal, window,
            None if mask.documents is None else mask.documents.agreement_key(),
            None if mask.placement is None else mask.placement.agreement_key(),
            None if mask.slices is None else mask.slices.key)


def sparse_pays(shape: AttentionShape, plan: MeshPlan, mask: Mask) -> bool:
    """Whether the sparse exchange of `mask` (only the rows its blocks use) sends at most
    `SPARSE_PAYS` of the bytes of the dense `plan`, on the rank sending most
    (`cost_models.sparse.sparse_traffic` against `traffic.mesh_traffic`). Kept per shape,
    plan and `pays_key` (the last `SPARSE_PAYS_KEPT`): a layer of a shape and mask seen
    before reads it."""
    key = (shape, plan, pays_key(mask))
    found = _PAYS.get(key)
    if found is not None:
        _PAYS.move_to_end(key)
        return found
    e = shape.dtype_bytes
    slices = AttentionMask(mask.causal, mask.documents, plan.rows * plan.cols, mask.window,
                           None, mask.slices)
    moved = sparse_traffic(shape, plan.heads, plan.rows, plan.cols, slices, None,
                           plan.dq_bytes(e), plan.dkv_bytes(e))
    found = _PAYS[key] = moved.total <= SPARSE_PAYS * mesh_traffic(shape, plan).total
    while len(_PAYS) > SPARSE_PAYS_KEPT:
        _PAYS.popitem(last=False)
    return found


def sparse_plan(schedule: str | Schedule, window_exchange: str, sparse_mask: bool
                ) -> tuple[str | Schedule, Exchange]:
    """(schedule, exchange) of a layer whose mask may leave rows unused (`sparse_mask`: a
    sliding window, placed documents): the sparse exchange (only the rows the blocks use
    travel, whatever the schedule), or with window_exchange 'gathered' the gathered
    schedule's whole chunks (what Transformer Engine's all_gather moves under a window)."""
    one_of("window_exchange", window_exchange, WINDOW_EXCHANGES)
    if not sparse_mask:
        return schedule, Exchange.DENSE
    if window_exchange == "gathered":
        return Schedule.GATHERED, Exchange.DENSE
    return schedule, Exchange.SPARSE


def finish_rows(out: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype,
                softmax_offset: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The one finish point of every runner: its rows' fp32 out [s, b, hq, dv] and lse
    [b, hq, s], merged over the whole sequence, become the layer's output in `dtype`.
    Owner-side steps run here, once per row: the sink's extra logit (`sink.add_sink`)."""
    if softmax_offset is not None:
        out, lse = add_sink(out, lse, softmax_offset)
    return out.to(dtype), lse


class MeshAttentionFunction(torch.autograd.Function):
    """Autograd over a runner's forward / backward (`RUNNERS[plan.runner]`); saves only
    local tensors and the lse."""

    @staticmethod
    def forward(ctx, q, k, v, softmax_offset, grid, mask, scale, kernel, runner: Runner, grads):
        runner = RUNNERS[runner]
        out, lse = finish_rows(*runner.forward(q, k, v, grid, mask, scale, kernel), q.dtype,
                               softmax_offset)
        ctx.save_for_backward(q, k, v, out, lse, softmax_offset)
        ctx.args = (grid, mask, scale, kernel, grads)
        ctx.runner = runner
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, offset = ctx.saved_tensors
        dout = dout.contiguous()
        delta = attention_delta(dout, out)  # D = rowsum(dO * O) [b, hq, s], formed once
        dq, dk, dv = ctx.runner.backward(dout, q, k, v, out, lse, delta, *ctx.args)
        d_offset = None
        if offset is not None and ctx.needs_input_grad[3]:
            d_offset = sink_grad(delta, lse, offset)
        return dq, dk, dv, d_offset, None, None, None, None, None, None


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
    placed: bool = False  # built for placed documents (`DocumentPlacement`)
    mask: SliceMask | None = None  # a user's slices (`slices.py`), with the rest; None: none

    @classmethod
    def build(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: MeshGrid,
              causal: bool | None = None, softmax_scale: float | None = None,
              backend: str | TileKernel = "auto", schedule: str = DEFAULT_SCHEDULE,
              grad_reduce_dtype: str = DEFAULT_GRAD_DTYPE, packed: bool = False,
              window_size: tuple[int, int] | None = None,
              window_exchange: str = "sparse", placed: bool = False,
              mask: Mask | SliceMask | Iterable | None = None) -> MeshAttention:
        """Check q, k, v [s, b, h, d] and the options (ValueError, before any collective)
        and decide the layer's plan and kernel (`packed`: for packed documents;
        `window_size`: a sliding window, `window.window_of`; `window_exchange`: what
        travels under it, `mesh_attention`; `placed`: for placed documents; `mask`: the
        call's `Mask` (or slices), `mesh_attention`: its documents say packed / placed, the
        calls pass them)."""
        value = resolve_mask(mask, causal, None, None, window_size)
        packed, placed = packed or value.packing is not None, placed or value.placement is not None
        causal, window, user = value.causal, value.window, value.slices
        check_inputs(q, k, v, grid, softmax_scale, backend, schedule, grad_reduce_dtype, causal)
        if window is not None or user is not None:
            backend = window_backend(backend)
        sparse = window is not None or placed
        if user is not None:
            user.check_length(q.shape[0] * grid.cp_size)
        if user is not None and not sparse:
            sparse = window_exchange == "gathered" or (window_exchange == "sparse" and sparse_pays(
                layer_shape(q, k, grid, v), plan_for(q, k, grid, schedule, grad_reduce_dtype, v),
                value))
        schedule, exchange = sparse_plan(schedule, window_exchange, sparse)
        plan = plan_for(q, k, grid, schedule, grad_reduce_dtype, v, exchange)
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        kernel = get_kernel(backend, q.device, q.dtype, q.shape[-1], documents=packed or placed,
                            v_head_dim=v.shape[-1])
        return cls(grid, plan, kernel, bool(causal), float(scale), _signature(q, k, v), window,
                   bool(placed), user)

    def matches(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None) -> bool:
        """Whether q, k (, v) have the shapes, dtype and device this layer was built for."""
        return _signature(q, k, v) == self.signature

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 documents: Documents | None = None,
                 placement: DocumentPlacement | None = None,
                 softmax_offset: torch.Tensor | None = None) -> torch.Tensor:
        """q [s, b, hq, d], k [s, b, hkv, d], v [s, b, hkv, dv] -> out [s, b, hq, dv]; with
        `documents` (packed sequences, b = 1) the local tensors are this rank's THD share,
        with `placement` its rows of the placed documents (`placement.token_indices`);
        `softmax_offset` [hq] fp32: each head's sink logit (`sink.py`). Collective: every
        rank of the grid first agrees on the call (`agreement.agree`: ValueError on every
        rank unless all pass the same shapes, documents and options)."""
        grid = self.grid
        try:
            self.check_call(q, k, v, documents, placement, softmax_offset)
            signature = self.call_signature(q, k, v, documents, placement, softmax_offset)
        except Exception as error:  # noqa: BLE001 - every rank must hear of it
            agreement.refuse(grid, error)
        agreement.agree(grid, signature)
        packed = documents if placement is None else placement
        mask = AttentionMask(self.causal, documents, grid.rows * grid.cols, self.window,
                             None if placement is None else mesh_placement(placement, grid.heads),
                             self.mask)
        if grid.heads > 1:
            q, k, v = heads.scatter_heads(q, k, v, grid, packed)
            if softmax_offset is not None:  # this rank's head slice
                softmax_offset = softmax_offset.view(grid.heads, -1)[grid.head_index]
        out = MeshAttentionFunction.apply(
            q, k, v, softmax_offset, grid, mask, self.softmax_scale, self.kernel,
            self.plan.runner, grad_dtypes(self.plan.grad_reduce_dtype, q.dtype),
        )
        return heads.gather_heads(out, grid, packed) if grid.heads > 1 else out

    def check_call(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   documents: Documents | None = None,
                   placement: DocumentPlacement | None = None,
                   softmax_offset: torch.Tensor | None = None) -> None:
        """ValueError unless q, k, v (and `documents`, `placement`, `softmax_offset`) fit
        this layer; local, no collective."""
        if not self.matches(q, k, v) or v.shape[:3] != k.shape[:3]:
            raise ValueError(
                f"this MeshAttention was built for {self.signature[:2]} (q, k shapes) and V "
                f"head dim {self.signature[4]}, got {tuple(q.shape)}, {tuple(k.shape)}, "
                f"v {tuple(v.shape)}; build one per shape")
        if documents is not None and placement is not None:
            raise ValueError("pass packed documents as cu_seqlens (Transformer Engine's THD "
                             "layout) or as a placement, not both")
        packed = documents if placement is None else placement
        if packed is not None and not caps_of(self.kernel).documents:
            raise ValueError("this MeshAttention was built without packed documents "
                             "(MeshAttention.build(..., packed=True) takes them)")
        if (placement is not None) != self.placed:
            raise ValueError(f"this MeshAttention was built {'for' if self.placed else 'without'}"
                             " placed documents (MeshAttention.build(..., placed=True) takes "
                             "a placement, every call)")
        if documents is not None:
            documents.check_cp(self.grid.cp_size, q.shape[0])
        if placement is not None:
            check_placement(placement, self.grid.cp_size, q.shape[0], q.shape[1])
        check_offset(softmax_offset, q.shape[2])

    def call_signature(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       documents: Documents | None = None,
                       placement: DocumentPlacement | None = None,
                       softmax_offset: torch.Tensor | None = None) -> CallSignature:
        """What every rank of the grid must pass alike for this call (`agreement.py`)."""
        window = None if self.window is None else (self.window.left, self.window.right)
        plan = self.plan
        return CallSignature(
            tuple(q.shape), tuple(k.shape), v.shape[-1], q.dtype,
            documents if placement is None else placement, self.causal, self.softmax_scale,
            plan.schedule.value, GradDtype(plan.grad_reduce_dtype).value, window,
            plan.exchange.value,
            (self.grid.heads, self.grid.rows, self.grid.cols), softmax_offset is not None,
            torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                            for t in (q, k, v, softmax_offset)),
            self.mask, env_group_tokens())


def _signature(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None) -> tuple:
    dv = k.shape[-1] if v is None else v.shape[-1]
    return tuple(q.shape), tuple(k.shape), q.dtype, q.device, dv


def window_backend(backend: str | TileKernel) -> str | TileKernel:
    """The backend that runs sliding-window tiles (caps `tile_mask`, `kernels.backend_for`):
    torch's ops for 'auto'; a named backend or kernel object whose caps lack them is a
    ValueError."""
    return backend_for(backend, WINDOWS)


def as_sbhd(documents: Documents | DocumentPlacement | None, *tensors: torch.Tensor
            ) -> tuple[torch.Tensor, ...]:
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
    causal: bool | None = None,
    softmax_scale: float | None = None,
    backend: str | TileKernel = "auto",
    schedule: str = DEFAULT_SCHEDULE,
    grad_reduce_dtype: str = DEFAULT_GRAD_DTYPE,
    cu_seqlens: torch.Tensor | Documents | None = None,
    cu_seqlens_padded: torch.Tensor | None = None,
    window_size: tuple[int, int] | None = None,
    window_exchange: str = "sparse",
    placement: DocumentPlacement | None = None,
    softmax_offset: torch.Tensor | None = None,
    mask: Mask | SliceMask | Iterable | None = None,
) -> torch.Tensor:
    """Exact attention of this rank's zigzag share over the whole CP sequence.

    q [s, b, hq, d], k [s, b, hkv, d], v [s, b, hkv, dv] (sbhd; s = S / P: sub-chunks r and
    2P-1-r of 2P for CP rank r; hq a multiple of hkv; dv = d, or V's own as in MLA) -> out
    [s, b, hq, dv] in q's dtype, differentiable in q, k, v (and softmax_offset). With
    cu_seqlens or placement the tensors are THD: q [t, hq, d], k / v [t, hkv, d | dv].

    What each query sees is one `Mask` (`masks/mask.py`): `mask`, a `Mask` (e.g.
    `documents_mask(cu_seqlens) & sliding_window_mask(128)`), a `SliceMask` or its list of
    (q_start, q_end, k_start, k_end, 'full' | 'causal'). The keywords build the same value
    and compose with it (`resolve_mask`):
      causal: True (the default without a mask) or False; not with a mask;
      cu_seqlens: packed documents, int32 [n + 1] cumulative lengths of the whole packed
        sequence (cu_seqlens_padded: the padded ones; or one `Documents`), each rank holding
        Transformer Engine's CP share (`documents_mask`);
      placement: a `DocumentPlacement` (`place_documents`), the tensors at
        `placement.token_indices(cp_rank)`;
      window_size (left, right), flash-attention's sliding window (-1 unbounded)
        (`sliding_window_mask`).
    A mask with documents holds the tensors in their layout (THD); its slices are over the
    packed sequence's positions (padded for THD). All of these are the same on every rank.
    backend: 'auto' | 'torch' | 'cudnn' | 'te' or a `TileKernel`; schedule: 'streamed'
    (default) | 'streamed_kv' | 'streamed_q' | 'gathered'; grad_reduce_dtype: 'mixed'
    (default) | 'fp32' | 'input'; window_exchange: 'sparse' (default) | 'gathered';
    softmax_offset: attention sinks, float32 [hq].

    Refused, with a ValueError on every rank before any collective: bad shapes, dtypes and
    names; a mask with causal, or with other documents than its own; ranks that pass different
    arguments (the agreement names both values). More: README.md "The API", docs/design.md
    "Masks", docs/schedules.md.
    """
    if not isinstance(grid, MeshGrid):  # no group to tell the other ranks
        raise ValueError(f"grid must be a MeshGrid (from MeshGrid.build), got "
                         f"{type(grid).__name__}")
    try:  # local checks; a rejection is told to every rank of the grid (`agreement.py`)
        if placement is not None:
            documents = None
            check_placement_documents(placement, cu_seqlens, cu_seqlens_padded)
        else:
            documents = packed_documents(cu_seqlens, cu_seqlens_padded)
        value = resolve_mask(mask, causal, documents, placement, window_size)
        documents, placement = value.documents, value.placement
        q, k, v = as_sbhd(value.packing, q, k, v)
        packed = value.packing is not None
        layer = MeshAttention.build(q, k, v, grid, None, softmax_scale, backend, schedule,
                                    grad_reduce_dtype, packed=packed,
                                    window_exchange=window_exchange,
                                    placed=placement is not None, mask=value)
    except Exception as error:  # noqa: BLE001 - every rank must hear of it
        agreement.refuse(grid, error)
    out = layer(q, k, v, documents, placement, softmax_offset)
    return out.squeeze(1) if packed else out
