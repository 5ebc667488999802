"""Bytes each CP rank sends for one mesh attention layer (forward and backward).

Counting convention (also used by the byte counters in `comm.py`): for a collective over
n ranks, all_gather of an m-byte input sends (n-1)*m, reduce_scatter to an m-byte output
sends (n-1)*m, all_to_all of an M-byte input sends M*(n-1)/n (its own piece stays).

Per rank (i, j) of an R x C grid, with q = s*b*hq*d (local Q chunk, elements), o =
s*b*hq*dv (local O or dO chunk; dv = V's head dim, d unless multi-latent attention gives V
its own), kv = s*b*hkv*(d + dv) (local K and V), l = b*hq*s (one lse / D value per query
row), e = bytes per element of the input dtype, fp32 = 4:

    forward : row all-gather Q            (C-1) * q  * e
              column all-gather K, V      (R-1) * kv * e
              row all-to-all partial O     (C-1) * o  * e   (streamed_q: fp32, below)
              row all-to-all partial lse   (C-1) * l  * 4
    backward: row all-gather Q, dO        (C-1) * (q + o) * e
              row all-gather lse, D       (C-1) * 2l * 4
              column all-gather K, V      (R-1) * kv * e
              row dQ partials             (C-1) * q  * 4   (a ring of C-1 hops)
              column reduce-scatter dK,dV (R-1) * kv * e   (fp32: * 4)

In elements (o = q) this is docs/design.md's 5 (C-1) q + 3 (R-1) kv plus the small lse / D
terms.
By default (grad_reduce_dtype="mixed", `mesh_attention`'s default and this module's) dK, dV
travel in the input dtype, as in Transformer Engine's ring, and dQ in fp32 (twice its
element size with bf16 inputs); "fp32" sends both in fp32, "input" both in the input dtype
(`layer_plan.GradDtype`).
The streamed_q schedule replaces the partial-O all-to-all by a ring in which each chunk's
partial output is merged hop by hop; it travels in fp32 (out_bytes = 4), since rounding the
running merge to bf16 at every hop would lose precision as C grows.

With a heads dimension (A x R x C = P, `heads.py`), each rank first sends and receives an
all-to-all over its A-rank heads group, in the input dtype, (A-1)/A of each tensor:

    forward : Q, K, V in, O out           (A-1)/A * (q + o + f kv) * e
    backward: dO in, dQ, dK, dV out       (A-1)/A * (q + o + f kv) * e

and then runs the R x C mesh over P/A ranks with the same q and f kv elements per rank,
where f = A / gcd(A, hkv) counts K/V heads repeated so that each head slice has its own
(`layer_plan.kv_repeats`). Corners: A = 1 is the mesh; (A, P/A, 1) is a2a+p2p; (P, 1, 1) is a2a.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..layer_plan import (
    FP32_BYTES,
    AttentionShape,
    MeshPlan,
    heads_shape,
    mesh_shapes,
)
from .plan import resolve_plan


@dataclass(frozen=True)
class Traffic:
    """Bytes one rank sends, split by pass and by grid direction."""

    forward_row: int
    forward_col: int
    backward_row: int
    backward_col: int
    forward_heads: int = 0
    backward_heads: int = 0
    # of which the partials reduced over a group (the rest are the chunks themselves): the
    # partial outputs and lse sent to their owners, the dQ and the dK, dV partials
    forward_row_partials: int = 0
    backward_row_partials: int = 0
    backward_col_partials: int = 0

    @property
    def forward(self) -> int:
        return self.forward_row + self.forward_col + self.forward_heads

    @property
    def backward(self) -> int:
        return self.backward_row + self.backward_col + self.backward_heads

    @property
    def total(self) -> int:
        return self.forward + self.backward


def mesh_traffic(
    shape: AttentionShape, rows: int | MeshPlan, cols: int | None = None,
    grad_bytes: int | None = None, out_bytes: int | None = None,
    dkv_grad_bytes: int | None = None,
) -> Traffic:
    """Bytes sent per rank by mesh attention, forward and backward.

    mesh_traffic(shape, plan): the plan's grid (with its heads all-to-all, `grid_traffic`),
    gradient and partial-output dtypes.
    mesh_traffic(shape, rows, cols): what `mesh_attention` sends on a rows x cols grid with
    its default arguments (grad_reduce_dtype "mixed", the "streamed" schedule resolved for
    the shape: `plan.resolve_plan(shape, rows, cols)`); the byte counters equal it.
    grad_bytes: bytes per element of the dQ reduction, dkv_grad_bytes of the dK, dV
    reduction, out_bytes of the partial outputs (`Schedule.partial_out_bytes`). A value
    left None takes that default, but dkv_grad_bytes given grad_bytes alone is grad_bytes.
    """
    if isinstance(rows, MeshPlan):
        return _plan_traffic(shape, rows)
    if cols is None:
        raise TypeError("mesh_traffic takes (shape, plan) or (shape, rows, cols)")
    e = shape.dtype_bytes
    if grad_bytes is None or out_bytes is None:
        default = resolve_plan(shape, rows, cols)  # mesh_attention's defaults
        if grad_bytes is None:
            grad_bytes = default.dq_bytes(e)
            dkv_grad_bytes = default.dkv_bytes(e) if dkv_grad_bytes is None else dkv_grad_bytes
        if out_bytes is None:
            out_bytes = default.partial_out_bytes(e)
    g_kv = grad_bytes if dkv_grad_bytes is None else dkv_grad_bytes
    return _mesh_bytes(shape, rows, cols, grad_bytes, out_bytes, g_kv)


def _plan_traffic(shape: AttentionShape, plan: MeshPlan) -> Traffic:
    """`mesh_traffic` of a resolved plan."""
    e = shape.dtype_bytes
    return grid_traffic(shape, plan.heads, plan.rows, plan.cols, plan.dq_bytes(e),
                        plan.partial_out_bytes(e), plan.dkv_bytes(e))


def _mesh_bytes(shape: AttentionShape, rows: int, cols: int, grad_bytes: int, out_bytes: int,
                dkv_grad_bytes: int) -> Traffic:
    """The module docstring's formula with every dtype given."""
    q, kv, lse = shape.local_elements(rows * cols)
    o = shape.out_elements(rows * cols)
    e = shape.dtype_bytes
    return Traffic(
        forward_row=(cols - 1) * (q * e + o * out_bytes + lse * FP32_BYTES),
        forward_col=(rows - 1) * kv * e,
        backward_row=(cols - 1) * ((q + o) * e + 2 * lse * FP32_BYTES + q * grad_bytes),
        backward_col=(rows - 1) * (kv * e + kv * dkv_grad_bytes),
        forward_row_partials=(cols - 1) * (o * out_bytes + lse * FP32_BYTES),
        backward_row_partials=(cols - 1) * q * grad_bytes,
        backward_col_partials=(rows - 1) * kv * dkv_grad_bytes,
    )


def grid_traffic(
    shape: AttentionShape, heads: int, rows: int, cols: int, grad_bytes: int | None = None,
    out_bytes: int | None = None, dkv_grad_bytes: int | None = None,
) -> Traffic:
    """Bytes sent per rank on a heads x rows x cols grid: the all-to-all of Q, K, V, O (and
    their gradients) over A ranks plus `mesh_traffic` of the R x C mesh on `heads_shape`
    (dtypes left None: `mesh_attention`'s defaults, as in `mesh_traffic`)."""
    if heads == 1:
        return mesh_traffic(shape, rows, cols, grad_bytes, out_bytes, dkv_grad_bytes)
    inner = heads_shape(shape, heads)
    mesh = mesh_traffic(inner, rows, cols, grad_bytes, out_bytes, dkv_grad_bytes)
    q, kv, _ = inner.local_elements(rows * cols)
    o = inner.out_elements(rows * cols)
    a2a = (q + o + kv) * shape.dtype_bytes * (heads - 1) // heads
    return replace(mesh, forward_heads=a2a, backward_heads=a2a)


def best_mesh_shape(shape: AttentionShape, cp_size: int) -> tuple[int, int]:
    """The grid with the least traffic per rank with `mesh_attention`'s defaults
    (`mesh_traffic`); ties go to more rows (GQA-friendly)."""
    return min(mesh_shapes(cp_size), key=lambda rc: (mesh_traffic(shape, *rc).total, -rc[0]))
