"""The bytes and memory of the sparse exchange (`schedules/sparse.py`): each rank sends
only the rows some block of a peer uses (`masks.needed_rows`), under a sliding window, a
document placement or any slice mask (`sparse_traffic` of the mask; `window_traffic` and
`placement_traffic` build it), and holds the rows in flight (`window_extra_memory`)."""
from __future__ import annotations

from fractions import Fraction

from ..calls.groups import group_calls
from ..calls.layout import AttentionMask, block_for
from ..calls.needed_rows import needed_rows
from ..layer_plan import (
    DEFAULT_GRAD_DTYPE,
    FP32_BYTES,
    AttentionShape,
    GradDtype,
    GridShape,
    MeshPlan,
    heads_shape,
)
from ..masks.document_placement import DocumentPlacement
from ..masks.placed_documents import mesh_placement
from ..masks.window import window_of
from .memory import extra_memory
from .tile_calls import group_tokens, grouping
from .traffic import Traffic


def window_traffic(
    shape: AttentionShape, heads: int, rows: int, cols: int, window: tuple[int, int],
    causal: bool = True, mesh_rank: int | None = None, grad_bytes: int = FP32_BYTES,
    dkv_grad_bytes: int | None = None, documents=None,
) -> Traffic:
    """Bytes one rank sends under a sliding window (`sparse_traffic` with the window's
    mask). `mesh_rank` None: the most any rank of the mesh sends (total)."""
    mask = AttentionMask(causal, documents, rows * cols, window_of(window, causal))
    return sparse_traffic(shape, heads, rows, cols, mask, mesh_rank, grad_bytes,
                          dkv_grad_bytes)


def sparse_traffic(
    shape: AttentionShape, heads: int, rows: int, cols: int, mask: AttentionMask,
    mesh_rank: int | None = None, grad_bytes: int = FP32_BYTES,
    dkv_grad_bytes: int | None = None,
) -> Traffic:
    """Bytes one rank sends in the sparse exchange of `mask` (a window, placed documents):
    of each row member x the query rows n_q its blocks use, of each column member y the
    key rows n_kv:

        forward : row  sum_x n_q(x, me) (Q row) e + n_q(me, x) (O row e + lse row 4)
                  col  sum_y n_kv(y, me) (K/V row) e
        backward: row  sum_x n_q(x, me) ((Q + dO row) e + 2 lse row 4) + n_q(me, x) Q row g_q
                  col  sum_y n_kv(y, me) K/V row e + n_kv(me, y) K/V row g_kv

    (n(a, b): rows of b's chunk that rank a uses), plus the heads all-to-all of
    `grid_traffic`. `mesh_rank` None: the most any rank of the mesh sends (total)."""
    if mesh_rank is None:
        return max((sparse_traffic(shape, heads, rows, cols, mask, m, grad_bytes,
                                   dkv_grad_bytes) for m in range(rows * cols)),
                   key=lambda t: t.total)
    inner = heads_shape(shape, heads) if heads > 1 else shape
    mesh = rows * cols
    local = inner.seq_len // mesh
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


def exchanged_rows(seq_len: int, rows: int, cols: int, window: tuple[int, int],
                   causal: bool) -> list[tuple]:
    """Per rank of a rows x cols mesh over `seq_len` tokens under `window`, the rows it
    exchanges, in chunks (Fractions): (Q rows received, sent, K/V rows received, sent;
    per other row member in row order, the Q rows received from it and the kernel calls of
    its queries against the column; the calls of this rank's own queries against the other
    column members' K/V; how many row members come before this rank), each call (Q rows,
    K/V rows, Q pieces, K/V pieces) as the tiles group them on the CPU
    (`calls.groups.group_calls`): the input of `memory.extra_memory(..., windowed=...)`."""
    mesh = rows * cols
    local = seq_len // mesh
    mask = AttentionMask(causal, None, mesh, window_of(window, causal))

    def share(me: int, owner: int, side: str) -> Fraction:
        return Fraction(len(needed_rows(mask, rows, cols, local, me, owner, side)), local)

    def calls(x: int, column: list[int], skip: int | None) -> list[tuple]:
        blocks = [(0, n, block_for(x, y, local, mask)) for n, y in enumerate(column)
                  if y != skip]
        made = group_calls([b for b in blocks if not b[2].empty], False, grouping(),
                           group_tokens())
        return [(Fraction(sum(p.size for p in c.q), local),
                 Fraction(sum(p.size for p in c.kv), local), len(c.q), len(c.kv))
                for c in made]

    out = []
    for me in range(mesh):
        i, j = divmod(me, cols)
        row = [i * cols + x for x in range(cols) if i * cols + x != me]
        column = [y * cols + j for y in range(rows)]
        col = [y for y in column if y != me]
        out.append((sum((share(me, x, "q") for x in row), Fraction(0)),
                    sum((share(x, me, "q") for x in row), Fraction(0)),
                    sum((share(me, y, "kv") for y in col), Fraction(0)),
                    sum((share(y, me, "kv") for y in col), Fraction(0)),
                    [(share(me, x, "q"), calls(x, column, None)) for x in row],
                    calls(me, column, me), j))
    return out


def window_extra_memory(shape: AttentionShape, plan: MeshPlan, window: tuple[int, int],
                        causal: bool = True) -> dict[str, int]:
    """{'forward', 'backward'} extra bytes of the sparse exchange under `window` on the
    rank holding most (`memory.extra_memory` with the rows `exchanged_rows` counts)."""
    moved = exchanged_rows(shape.seq_len, plan.rows, plan.cols, window, causal)
    return extra_memory(shape, plan, windowed=moved)


def placement_traffic(shape: AttentionShape, placement: DocumentPlacement, rows: int,
                      cols: int, heads: int = 1, causal: bool = True,
                      window_size: tuple[int, int] | None = None,
                      grad_reduce_dtype: str = DEFAULT_GRAD_DTYPE,
                      cp_rank: int | None = None) -> Traffic:
    """Bytes CP rank `cp_rank` sends (None: the most any rank sends) when `mesh_attention`
    runs `placement` on an heads x rows x cols grid: the sparse exchange of the rows of
    documents that span ranks (`sparse_traffic`), plus the heads all-to-all.
    `shape`: the whole packed sequence (seq_len = placement.total, batch 1)."""
    if shape.seq_len != placement.total or shape.batch != 1:
        raise ValueError(f"shape has {shape.seq_len} tokens in a batch of {shape.batch}; the "
                         f"placement covers {placement.total} tokens of one packed sequence")
    GridShape(heads, rows, cols).check_cp_size(placement.cp_size)
    grads = GradDtype(grad_reduce_dtype)
    dq_bytes = FP32_BYTES if grads.dq_in_fp32 else shape.dtype_bytes
    dkv_bytes = FP32_BYTES if grads.dkv_in_fp32 else shape.dtype_bytes
    mask = AttentionMask(causal, None, rows * cols, window_of(window_size, causal),
                         mesh_placement(placement, heads))
    mesh_rank = None if cp_rank is None else cp_rank // heads
    return sparse_traffic(shape, heads, rows, cols, mask, mesh_rank, dq_bytes, dkv_bytes)
