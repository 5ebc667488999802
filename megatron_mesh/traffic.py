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
              row reduce-scatter dQ       (C-1) * q  * 4
              column reduce-scatter dK,dV (R-1) * kv * e   (fp32: * 4)

In elements (o = q) this is docs/design.md's 5 (C-1) q + 3 (R-1) kv plus the small lse / D
terms.
By default (grad_reduce_dtype="mixed") dK, dV travel in the input dtype, as in Transformer
Engine's ring, and dQ in fp32 (twice its element size with bf16 inputs); "fp32" sends both in
fp32, "input" both in the input dtype (`plan.GradDtype`).
The streamed_q schedule replaces the partial-O all-to-all by a ring in which each chunk's
partial output is merged hop by hop; it travels in fp32 (out_bytes = 4), since rounding the
running merge to bf16 at every hop would lose precision as C grows.

With a heads dimension (A x R x C = P, `heads.py`), each rank first sends and receives an
all-to-all over its A-rank heads group, in the input dtype, (A-1)/A of each tensor:

    forward : Q, K, V in, O out           (A-1)/A * (q + o + f kv) * e
    backward: dO in, dQ, dK, dV out       (A-1)/A * (q + o + f kv) * e

and then runs the R x C mesh over P/A ranks with the same q and f kv elements per rank,
where f = A / gcd(A, hkv) counts K/V heads repeated so that each head slice has its own
(`heads.kv_repeats`). Corners: A = 1 is the mesh; (A, P/A, 1) is a2a+p2p; (P, 1, 1) is a2a.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .dtypes import FP32_BYTES
from .plan import GradDtype, MeshPlan, Schedule, shape_text


@dataclass(frozen=True)
class AttentionShape:
    """One attention layer's problem on a CP group; `seq_len` is the whole sequence S."""

    seq_len: int
    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    v_head_dim: int | None = None  # V's own head dim (multi-latent attention); None: head_dim

    @property
    def dv(self) -> int:
        """V's head dim (that of O, dO and dV too)."""
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    def local_elements(self, cp_size: int) -> tuple[int, int, int]:
        """(q, kv, l) element counts of one rank's share, as in the module docstring:
        kv = |K| + |V|, each with its own head dim."""
        s = self.seq_len // cp_size
        q = s * self.batch * self.q_heads * self.head_dim
        kv = s * self.batch * self.kv_heads * (self.head_dim + self.dv)
        lse = s * self.batch * self.q_heads
        return q, kv, lse

    def out_elements(self, cp_size: int) -> int:
        """o: elements of one rank's O (or dO) chunk, q with V's head dim."""
        return self.seq_len // cp_size * self.batch * self.q_heads * self.dv


@dataclass(frozen=True)
class Traffic:
    """Bytes one rank sends, split by pass and by grid direction."""

    forward_row: int
    forward_col: int
    backward_row: int
    backward_col: int
    forward_heads: int = 0
    backward_heads: int = 0

    @property
    def forward(self) -> int:
        return self.forward_row + self.forward_col + self.forward_heads

    @property
    def backward(self) -> int:
        return self.backward_row + self.backward_col + self.backward_heads

    @property
    def total(self) -> int:
        return self.forward + self.backward


def grad_bytes(grad_reduce_dtype: str, dtype_bytes: int) -> tuple[int, int]:
    """Bytes per element of the (dQ, dK / dV) exchanges for a `GradDtype` name."""
    grads = GradDtype(grad_reduce_dtype)
    return grads.dq_bytes(dtype_bytes), grads.dkv_bytes(dtype_bytes)


def partial_out_bytes(schedule: str, dtype_bytes: int) -> int:
    """Bytes per element of the partial outputs a schedule sends over the row
    (`Schedule.partial_out_bytes`)."""
    return Schedule(schedule).partial_out_bytes(dtype_bytes)


def mesh_traffic(
    shape: AttentionShape, rows: int | MeshPlan, cols: int | None = None,
    grad_bytes: int = FP32_BYTES, out_bytes: int | None = None,
    dkv_grad_bytes: int | None = None,
) -> Traffic:
    """Bytes sent per rank by mesh attention, forward and backward.

    mesh_traffic(shape, plan): the plan's grid (with its heads all-to-all, `grid_traffic`),
    gradient and partial-output dtypes.
    mesh_traffic(shape, rows, cols, grad_bytes, out_bytes, dkv_grad_bytes): a rows x cols
    grid; grad_bytes: bytes per element of the dQ reduction (fp32 by default), dkv_grad_bytes
    of the dK, dV reduction (grad_bytes when None); out_bytes: of the partial outputs (the
    input dtype's by default; `partial_out_bytes`).
    """
    if isinstance(rows, MeshPlan):
        plan = rows
        return grid_traffic(shape, plan.heads, plan.rows, plan.cols,
                            plan.dq_bytes(shape.dtype_bytes),
                            plan.partial_out_bytes(shape.dtype_bytes),
                            plan.dkv_bytes(shape.dtype_bytes))
    if cols is None:
        raise TypeError("mesh_traffic takes (shape, plan) or (shape, rows, cols)")
    q, kv, lse = shape.local_elements(rows * cols)
    o = shape.out_elements(rows * cols)
    e = shape.dtype_bytes
    o_e = e if out_bytes is None else out_bytes
    g_kv = grad_bytes if dkv_grad_bytes is None else dkv_grad_bytes
    return Traffic(
        forward_row=(cols - 1) * (q * e + o * o_e + lse * FP32_BYTES),
        forward_col=(rows - 1) * kv * e,
        backward_row=(cols - 1) * ((q + o) * e + 2 * lse * FP32_BYTES + q * grad_bytes),
        backward_col=(rows - 1) * (kv * e + kv * g_kv),
    )


def heads_shape(shape: AttentionShape, heads: int) -> AttentionShape:
    """The problem the R x C mesh solves after the all-to-all: 1/A of the query heads and
    lcm(A, hkv)/A K/V heads (repeated when A does not divide hkv), the whole sequence."""
    kv_heads = shape.kv_heads * heads // math.gcd(heads, shape.kv_heads)
    return AttentionShape(shape.seq_len, shape.batch, shape.q_heads // heads, kv_heads // heads,
                          shape.head_dim, shape.dtype_bytes, shape.v_head_dim)


def grid_traffic(
    shape: AttentionShape, heads: int, rows: int, cols: int, grad_bytes: int = FP32_BYTES,
    out_bytes: int | None = None, dkv_grad_bytes: int | None = None,
) -> Traffic:
    """Bytes sent per rank on a heads x rows x cols grid: the all-to-all of Q, K, V, O (and
    their gradients) over A ranks plus `mesh_traffic` of the R x C mesh on `heads_shape`."""
    if heads == 1:
        return mesh_traffic(shape, rows, cols, grad_bytes, out_bytes, dkv_grad_bytes)
    inner = heads_shape(shape, heads)
    mesh = mesh_traffic(inner, rows, cols, grad_bytes, out_bytes, dkv_grad_bytes)
    q, kv, _ = inner.local_elements(rows * cols)
    o = inner.out_elements(rows * cols)
    a2a = (q + o + kv) * shape.dtype_bytes * (heads - 1) // heads
    return Traffic(mesh.forward_row, mesh.forward_col, mesh.backward_row, mesh.backward_col,
                   forward_heads=a2a, backward_heads=a2a)


def grid_shapes(cp_size: int) -> list[tuple[int, int, int]]:
    """Every heads x rows x cols factorization of cp_size: A ascending, then as
    `mesh_shapes` (P/A x 1 down to 1 x P/A)."""
    return [(a, r, c) for a in range(1, cp_size + 1) if cp_size % a == 0
            for r, c in mesh_shapes(cp_size // a)]


def mesh_shapes(cp_size: int) -> list[tuple[int, int]]:
    """Every rows x cols factorization of cp_size, from cp_size x 1 down to 1 x cp_size."""
    return [(cp_size // c, c) for c in range(1, cp_size + 1) if cp_size % c == 0]


def shapes_text(cp_size: int, heads: bool = False) -> str:
    """The valid shapes of a CP group, in one order everywhere: '4x1, 2x2, 1x4' for 4
    (`mesh_shapes`); with heads, every 'AxRxC' of `grid_shapes` ('RxC' when A = 1)."""
    if not heads:
        return ", ".join(f"{r}x{c}" for r, c in mesh_shapes(cp_size))
    return ", ".join(shape_text(a, r, c) for a, r, c in grid_shapes(cp_size))


def best_mesh_shape(shape: AttentionShape, cp_size: int) -> tuple[int, int]:
    """The grid with the least traffic per rank; ties go to more rows (GQA-friendly)."""
    return min(mesh_shapes(cp_size), key=lambda rc: (mesh_traffic(shape, *rc).total, -rc[0]))


def window_traffic(
    shape: AttentionShape, heads: int, rows: int, cols: int, window: tuple[int, int],
    causal: bool = True, mesh_rank: int | None = None, grad_bytes: int = FP32_BYTES,
    dkv_grad_bytes: int | None = None, documents=None,
) -> Traffic:
    """Bytes one rank sends under a sliding window (`windowed.py`): of each row member x
    the query rows n_q its blocks use, of each column member y the key rows n_kv:

        forward : row  sum_x n_q(x, me) (Q row) e + n_q(me, x) (O row e + lse row 4)
                  col  sum_y n_kv(y, me) (K/V row) e
        backward: row  sum_x n_q(x, me) ((Q + dO row) e + 2 lse row 4) + n_q(me, x) Q row g_q
                  col  sum_y n_kv(y, me) K/V row e + n_kv(me, y) K/V row g_kv

    (n(a, b): rows of b's chunk that rank a uses), plus the heads all-to-all of
    `grid_traffic`. `mesh_rank` None: the most any rank of the mesh sends (total)."""
    from .layout import AttentionMask
    from .window import window_of
    from .windowed import needed_rows

    if mesh_rank is None:
        return max((window_traffic(shape, heads, rows, cols, window, causal, m, grad_bytes,
                                   dkv_grad_bytes, documents) for m in range(rows * cols)),
                   key=lambda t: t.total)
    inner = heads_shape(shape, heads) if heads > 1 else shape
    mesh = rows * cols
    local = inner.seq_len // mesh
    mask = AttentionMask(causal, documents, mesh, window_of(window, causal))
    b, e = inner.batch, inner.dtype_bytes
    q_row, o_row = b * inner.q_heads * inner.head_dim, b * inner.q_heads * inner.dv
    l_row, kv_row = b * inner.q_heads, b * inner.kv_heads * (inner.head_dim + inner.dv)
    g_kv = grad_bytes if dkv_grad_bytes is None else dkv_grad_bytes
    n = lambda a, o, side: len(needed_rows(mask, rows, cols, local, a, o, side))  # noqa: E731
    i, j = divmod(mesh_rank, cols)
    row = [i * cols + c for c in range(cols) if i * cols + c != mesh_rank]
    col = [r * cols + j for r in range(rows) if r * cols + j != mesh_rank]
    fr = sum(n(x, mesh_rank, "q") * q_row * e + n(mesh_rank, x, "q") * (o_row * e + l_row * 4)
             for x in row)
    fc = sum(n(y, mesh_rank, "kv") * kv_row * e for y in col)
    br = sum(n(x, mesh_rank, "q") * ((q_row + o_row) * e + 2 * l_row * 4)
             + n(mesh_rank, x, "q") * q_row * grad_bytes for x in row)
    bc = sum(n(y, mesh_rank, "kv") * kv_row * e + n(mesh_rank, y, "kv") * kv_row * g_kv
             for y in col)
    a2a = 0
    if heads > 1:
        q, kv, _ = inner.local_elements(mesh)
        a2a = (q + inner.out_elements(mesh) + kv) * shape.dtype_bytes * (heads - 1) // heads
    return Traffic(fr, fc, br, bc, forward_heads=a2a, backward_heads=a2a)
