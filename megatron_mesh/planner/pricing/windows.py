"""Sliding windows in closed form: the (query, key) pairs a window keeps, and the bytes of
the mesh's sparse exchange (`megatron_mesh.schedules.sparse`) per rank.

`cost_models.sparse.window_traffic` counts the rows each rank needs by building every block's mask
(exact, but O(S^2) work per shape); the planner prices dozens of shapes at S = 1M, so it
counts them here from sub-chunk positions. In the zigzag layout of M ranks, sub-chunk u
holds positions [u h, (u + 1) h), h = S / 2M, and rank r holds sub-chunks r and 2M-1-r.
A query sub-chunk u against a key sub-chunk v (window (L, R'), R' = 0 when causal, -1 =
unbounded) uses:

    v == u: every row;  v < u: its first min(h, max(0, L - (u-v-1) h)) query rows;
    v > u:  its last min(h, max(0, R' - (v-u-1) h)) query rows

and the key side mirrors it (L and R' swapped). The rows of u a set of sub-chunks uses are
the union of a prefix (nearest member below) and a suffix (nearest member above). Tested
equal to `window_traffic` (tests/unit/test_planner_window.py).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from megatron_mesh.cost_models.traffic import Traffic
from megatron_mesh.layer_plan import AttentionShape, heads_shape
from megatron_mesh.masks.window import Window

PARTS = (  # (phase, group, tensors) of the sparse exchange, in the planner's table order
    ("forward", "row", "Q"),
    ("forward", "row", "partial O, lse"),
    ("forward", "column", "K,V"),
    ("backward", "row", "Q,dO, lse,D"),
    ("backward", "row", "dQ"),
    ("backward", "column", "K,V"),
    ("backward", "column", "dK,dV"),
)


def _reach(side: int) -> float:
    return math.inf if side < 0 else side


def kept_pairs(seq_length: int, window: Window, causal: bool) -> int:
    """(query, key) pairs of one sequence of S tokens that the window keeps: query i sees
    keys max(0, i - L) .. min(S - 1, i + R) (R = 0 when causal):
    S + sum_i min(i, L) + sum_i min(S - 1 - i, R)."""
    s = seq_length
    left = s - 1 if window.left < 0 else min(window.left, s - 1)
    right = 0 if causal else (s - 1 if window.right < 0 else min(window.right, s - 1))

    def below(n: int) -> int:  # sum over i of min(i, n), i = 0 .. s-1
        return n * (n + 1) // 2 + (s - 1 - n) * n

    return s + below(left) + below(right)


def _needs(members: list[int], count: int, h: int, from_below: float,
           from_above: float) -> np.ndarray:
    """int [count]: rows of each sub-chunk 0 .. count-1 that some sub-chunk of `members`
    uses: all h for a member, else a prefix reached from the nearest member below and a
    suffix from the nearest member above (`from_below` / `from_above`: the window's reach
    that way, inf when unbounded)."""
    m = np.array(sorted(members), dtype=np.float64)
    u = np.arange(count, dtype=np.float64)
    at = np.searchsorted(m, u)  # first member >= u
    inside = m[np.minimum(at, len(m) - 1)] == u
    below = np.where(at > 0, m[np.maximum(at - 1, 0)], -math.inf)
    above_at = at + inside
    above = np.where(above_at < len(m), m[np.minimum(above_at, len(m) - 1)], math.inf)

    def reach(side: float, gap: np.ndarray) -> np.ndarray:  # inf - inf: no member that way
        with np.errstate(invalid="ignore"):
            return np.nan_to_num(np.clip(side - (gap - 1) * h, 0, h), nan=0.0)

    rows = np.minimum(reach(from_below, u - below) + reach(from_above, above - u), h)
    return np.where(inside, h, rows).astype(np.int64)


@dataclass(frozen=True)
class RowCounts:
    """Rows of one mesh rank's chunk that another uses (`calls.needed_rows`):
    q[j, o] query rows of rank o's chunk that the ranks of column j use (o in their row),
    kv[i, o] key rows of rank o's chunk that the ranks of row i use (o in their column)."""

    rows: int
    cols: int
    q: np.ndarray  # int64 [cols, mesh]
    kv: np.ndarray  # int64 [rows, mesh]


@functools.lru_cache(maxsize=256)
def row_counts(seq_length: int, rows: int, cols: int, window: Window, causal: bool
               ) -> RowCounts:
    """The `RowCounts` of a rows x cols mesh over a zigzag sequence of `seq_length`."""
    mesh = rows * cols
    h = seq_length // (2 * mesh)
    left, right = _reach(window.left), 0 if causal else _reach(window.right)
    subs = lambda ranks: [u for r in ranks for u in (r, 2 * mesh - 1 - r)]  # noqa: E731
    both = lambda need: need[:, :mesh] + need[:, mesh:][:, ::-1]  # noqa: E731
    # a query sub-chunk sees keys below it as far as L, above it as far as R'; a key
    # sub-chunk is seen by queries above it as far as L, below it as far as R'
    q = np.stack([_needs(subs(range(j, mesh, cols)), 2 * mesh, h, left, right)
                     for j in range(cols)])
    kv = np.stack([_needs(subs(range(i * cols, (i + 1) * cols)), 2 * mesh, h, right, left)
                      for i in range(rows)])
    return RowCounts(rows, cols, both(q), both(kv))


@dataclass(frozen=True)
class RowSizes:
    """Bytes of one row (token) of each exchanged tensor of the mesh's inner problem."""

    q: int  # Q row, input dtype
    o: int  # O / dO row, input dtype
    lse: int  # one fp32 value per query head
    kv: int  # K and V rows, input dtype
    dq: int  # dQ row in its exchange dtype
    dkv: int  # dK, dV rows in their exchange dtype

    @classmethod
    def of(cls, inner: AttentionShape, dq_bytes: int, dkv_bytes: int) -> RowSizes:
        b, e = inner.batch, inner.dtype_bytes
        q, o = b * inner.q_heads * inner.head_dim, b * inner.q_heads * inner.dv
        kv = b * inner.kv_heads * (inner.head_dim + inner.dv)
        return cls(q * e, o * e, b * inner.q_heads * 4, kv * e, q * dq_bytes, kv * dkv_bytes)


def peer_bytes(counts: RowCounts, sizes: RowSizes) -> tuple[np.ndarray, ...]:
    """(row parts int64 [4, mesh, cols], column parts [3, mesh, rows], row peers [mesh,
    cols], column peers [mesh, rows]): the bytes of each part of `PARTS` (`ROW_PARTS`,
    `COL_PARTS`) mesh rank m sends the k-th member of its row / column (0 to itself), and
    those members' mesh ranks."""
    r, c = counts.rows, counts.cols
    mesh = r * c
    me = np.arange(mesh)
    i, j = me // c, me % c
    row_peer = i[:, None] * c + np.arange(c)[None, :]  # [mesh, cols]
    col_peer = np.arange(r)[None, :] * c + j[:, None]  # [mesh, rows]
    not_me = lambda peer: peer != me[:, None]  # noqa: E731
    q_in = counts.q.T * not_me(row_peer)  # rows of mine that row peer j' uses
    q_out = counts.q[j[:, None], row_peer] * not_me(row_peer)  # rows of peer x's chunk I use
    kv_in = counts.kv.T * not_me(col_peer)
    kv_out = counts.kv[i[:, None], col_peer] * not_me(col_peer)
    row_parts = np.stack([q_in * sizes.q, q_out * (sizes.o + sizes.lse),
                             q_in * (sizes.q + sizes.o + 2 * sizes.lse), q_out * sizes.dq])
    col_parts = np.stack([kv_in * sizes.kv, kv_in * sizes.kv, kv_out * sizes.dkv])
    return row_parts, col_parts, row_peer, col_peer


ROW_PARTS, COL_PARTS = (0, 1, 3, 4), (2, 5, 6)  # where each lands in PARTS


def part_totals(row_parts: np.ndarray, col_parts: np.ndarray) -> np.ndarray:
    """int64 [len(PARTS), mesh]: bytes of each part per mesh rank."""
    out = np.zeros((len(PARTS), row_parts.shape[1]), dtype=np.int64)
    out[list(ROW_PARTS)] = row_parts.sum(-1)
    out[list(COL_PARTS)] = col_parts.sum(-1)
    return out


def heads_bytes(shape: AttentionShape, heads: int, cp_size: int) -> int:
    """Bytes one rank sends in each pass's heads all-to-all (`traffic.grid_traffic`)."""
    if heads == 1:
        return 0
    inner = heads_shape(shape, heads)
    mesh = cp_size // heads
    q, kv, _ = inner.local_elements(mesh)
    return (q + inner.out_elements(mesh) + kv) * shape.dtype_bytes * (heads - 1) // heads


def inner_shape(shape: AttentionShape, heads: int) -> AttentionShape:
    """The problem the R x C mesh solves after a heads all-to-all of size `heads`."""
    return heads_shape(shape, heads) if heads > 1 else shape


def sparse_traffic(shape: AttentionShape, heads: int, rows: int, cols: int, window: Window,
                   causal: bool, dq_bytes: int, dkv_bytes: int) -> Traffic:
    """`cost_models.sparse.window_traffic` of the rank that sends most, in closed form, with the
    partials (partial O and lse, dQ, dK and dV) split out as `mesh_traffic` does."""
    inner = inner_shape(shape, heads)
    counts = row_counts(inner.seq_len, rows, cols, window, causal)
    totals = part_totals(*peer_bytes(counts, RowSizes.of(inner, dq_bytes, dkv_bytes))[:2])
    p = totals[:, int(totals.sum(0).argmax())].tolist()  # argmax: the first of the most
    a2a = heads_bytes(shape, heads, heads * rows * cols)
    return Traffic(p[0] + p[1], p[2], p[3] + p[4], p[5] + p[6], a2a, a2a,
                   forward_row_partials=p[1], backward_row_partials=p[4],
                   backward_col_partials=p[6])
