"""The sparse schedule of sliding windows: each rank receives only the rows its tile's
blocks use, whatever schedule was asked for.

Under a window most rank-blocks are empty and the others use a band of rows
(`layout.block_for`). Rank M = (i, j) needs, of row member x's Q (and in backward dO, lse,
D), the query rows of its blocks (x, y) over its column's y; of column member y's K/V, the
key rows of its blocks (x, y) over its row's x (`needed_rows`). Each owner sends exactly
those rows, point to point; partial outputs and gradients go back for the same rows only.
Ranks that share no row send nothing. So the bytes per rank grow with the window, not
with S: with a window of at most a sub-chunk the ring corner (P x 1) exchanges `left` rows
with each of its two zigzag neighbours. Received rows are laid into buffers of the whole
chunk (zeros elsewhere), as in the gathered schedule; the rows in flight grow with the
window (`window_extra_memory`)."""
from __future__ import annotations

import functools
from fractions import Fraction

import torch

from ..common.caches import per_documents
from ..dtypes import FP32_GRADS, GradDtypes
from ..kernels import TileKernel
from ..layer_plan import (
    COLUMN,
    DEFAULT_GRAD_DTYPE,
    FP32_BYTES,
    ROW,
    AttentionShape,
    GradDtype,
    GridShape,
    MeshPlan,
    heads_shape,
)
from ..masks.document_placement import DocumentPlacement
from ..masks.layout import AttentionMask, block_for
from ..masks.placed import mesh_placement
from ..masks.window import window_of
from ..models.memory import extra_memory
from ..models.traffic import Traffic
from ..runtime import comm
from ..runtime.grid import MeshGrid
from .blocks import backward_block, forward_block, kv_grad_buffer, kv_grads, split_kv_grads
from .delta import out_with_delta
from .merge import empty_accumulators, merge_into


# per shape without documents; with them, for the last few micro-batches only (`caches.py`)
@per_documents(lambda mask, *_: mask.packing)
def needed_rows(mask: AttentionMask, rows: int, cols: int, local_len: int, mesh_rank: int,
                owner: int, side: str) -> tuple[int, ...]:
    """The local rows of `owner`'s chunk that rank `mesh_rank` of a rows x cols mesh uses:
    side 'q' (owner in its row: query rows of its blocks (owner, y) over its column) or
    'kv' (owner in its column: key rows of its blocks (x, owner) over its row)."""
    i, j = divmod(mesh_rank, cols)
    used = torch.zeros(local_len, dtype=torch.bool)
    for other in ([r * cols + j for r in range(rows)] if side == "q"
                  else [i * cols + c for c in range(cols)]):
        x, y = (owner, other) if side == "q" else (other, owner)
        blk = block_for(x, y, local_len, mask)
        if not blk.empty:
            used[blk.q_rows if side == "q" else blk.kv_rows] = True
    return tuple(used.nonzero().flatten().tolist())


def _index(rows: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64, device=device)


class _Peers:
    """This rank's row and column peers and the rows exchanged with each."""

    def __init__(self, grid: MeshGrid, mask: AttentionMask, local_len: int,
                 device: torch.device) -> None:
        me, r, c = grid.mesh_rank, grid.rows, grid.cols
        need = functools.partial(needed_rows, mask, r, c, local_len)
        ranks = grid.mesh_ranks
        # (slot, global rank, rows of theirs I use, rows of mine they use)
        self.row = [(j, ranks[x], _index(need(me, x, "q"), device),
                     _index(need(x, me, "q"), device))
                    for j, x in enumerate(grid.row_mesh_ranks) if x != me]
        self.col = [(i, ranks[y], _index(need(me, y, "kv"), device),
                     _index(need(y, me, "kv"), device))
                    for i, y in enumerate(grid.col_mesh_ranks) if y != me]


def _gather_rows(mine: list[torch.Tensor], peers, n: int, slot_of_me: int, phase, direction):
    """Start gathering: buffers [n, *t.shape] per tensor of `mine`, this rank's whole
    tensors in its slot (zeros elsewhere), and `land()`, which waits for the exchange and
    lays each peer's used rows into its slot. Until then the rows sent and the receive
    buffers are held (by `land`); the caller computes what needs none of them meanwhile."""
    bufs = [t.new_zeros(n, *t.shape) for t in mine]
    for buf, t in zip(bufs, mine):
        buf[slot_of_me].copy_(t)
    sends, recvs, lands = [], [], []
    for slot, peer, theirs, ours in peers:
        for buf, t in zip(bufs, mine):
            sends.append((peer, t.index_select(0, ours)))
            got = t.new_empty(len(theirs), *t.shape[1:])
            recvs.append((peer, got))
            lands.append((buf[slot], theirs, got))
    held = [comm.exchange(sends, recvs, phase, direction), sends, recvs]

    def land() -> None:
        held[0].wait()
        for dest, theirs, got in lands:
            dest.index_copy_(0, theirs, got)
        held.clear()  # the rows sent and received go once laid in
        lands.clear()

    return bufs, land


def _return_rows(parts: list[torch.Tensor], peers, phase, direction, dtype=None):
    """Send each peer (slot, rank, rows) the rows of parts[slot] it owns; returns
    [(rows, received tensors of mine)] to fold in."""
    sends, recvs = [], []
    for slot, peer, theirs, ours in peers:
        sent = parts[slot].index_select(0, theirs)
        sends.append((peer, sent if dtype is None else sent.to(dtype)))
        got = sends[-1][1].new_empty(len(ours), *sent.shape[1:])
        recvs.append((peer, got))
    comm.exchange(sends, recvs, phase, direction).wait()
    return [(ours, got) for (_, _, _, ours), (_, got) in zip(peers, recvs)]


def forward(q, k, v, grid: MeshGrid, mask: AttentionMask, scale: float, kernel: TileKernel):
    """q [s, b, hq, d], k [s, b, hkv, d], v [s, b, hkv, dv] -> (out [s, b, hq, dv],
    lse [b, hq, s]) of this rank's rows in fp32 (`attention` finishes them)."""
    s, b, hq, _ = q.shape
    dv = v.shape[-1]
    peers = _Peers(grid, mask, s, q.device)
    (q_row,), land_q = _gather_rows([q], peers.row, grid.cols, grid.col_index, "forward", ROW)
    (k_col, v_col), land_kv = _gather_rows([k, v], peers.col, grid.rows, grid.row_index,
                                           "forward", COLUMN)
    me, own = grid.mesh_rank, (grid.col_index, grid.row_index)
    # this rank's own block needs no rows of anyone's: it runs while the rows travel
    accs = {grid.col_index: empty_accumulators(s, b, hq, dv, q.device)}
    forward_block(kernel, q, k, v, me, me, mask, scale, *accs[grid.col_index])
    land_q()
    land_kv()
    for j, x in enumerate(grid.row_mesh_ranks):
        if j not in accs:
            accs[j] = empty_accumulators(s, b, hq, dv, q.device)
        out_acc, lse_acc = accs[j]
        for i, y in enumerate(grid.col_mesh_ranks):
            if (j, i) != own:
                forward_block(kernel, q_row[j], k_col[i], v_col[i], x, y, mask, scale,
                              out_acc, lse_acc)
        del out_acc, lse_acc
    accs = [accs[j] for j in range(grid.cols)]
    del q_row, k_col, v_col
    own_out, own_lse = accs[grid.col_index]
    outs = [a[0].to(q.dtype) for a in accs]
    lses = [a[1].permute(2, 0, 1) for a in accs]  # [s, b, hq]: rows first
    del accs  # e < 4: the other rows' fp32 outputs, copied into outs
    got_out = _return_rows(outs, peers.row, "forward", ROW)
    got_lse = _return_rows(lses, peers.row, "forward", ROW)
    del outs, lses  # sent: only this rank's accumulators and the received rows are held
    for (rows, out), (_, lse) in zip(got_out, got_lse):
        if len(rows):
            acc_o, acc_l = own_out.index_select(0, rows), own_lse.index_select(-1, rows)
            merge_into(acc_o, acc_l, out, lse.permute(1, 2, 0))
            own_out.index_copy_(0, rows, acc_o)
            own_lse.index_copy_(-1, rows, acc_l)
            del acc_o, acc_l  # before the next row's are taken out
    return own_out, own_lse


def backward(dout, q, k, v, out, lse, delta, grid: MeshGrid, mask: AttentionMask, scale: float,
             kernel: TileKernel, grad_dtypes: GradDtypes = FP32_GRADS):
    """Gradients dq [s, b, hq, d], dk [s, b, hkv, d], dv [s, b, hkv, dv] in the inputs'
    dtypes; partials summed in fp32 and sent back (only the used rows) in grad_dtypes."""
    s = q.shape[0]
    dout = dout.contiguous()
    peers = _Peers(grid, mask, s, q.device)
    stats = torch.stack([lse, delta]).permute(3, 0, 1, 2)  # [s, 2, b, hq]
    (q_row, do_row, st_row), land_q = _gather_rows([q, dout, stats.contiguous()], peers.row,
                                                   grid.cols, grid.col_index, "backward", ROW)
    (k_col, v_col), land_kv = _gather_rows([k, v], peers.col, grid.rows, grid.row_index,
                                           "backward", COLUMN)
    dq_part = torch.zeros(grid.cols, *q.shape, dtype=torch.float32, device=q.device)
    dkv_part = kv_grad_buffer(k, v, grid.rows)
    me, own = grid.mesh_rank, (grid.col_index, grid.row_index)
    # this rank's own block needs no rows of anyone's: it runs while the rows travel
    backward_block(kernel, dout, q, out, lse, k, v, me, me, mask, scale,
                   dq_part[grid.col_index], kv_grads(dkv_part[grid.row_index], k, v))
    land_q()
    land_kv()
    for j, x in enumerate(grid.row_mesh_ranks):
        lse_x, delta_x = st_row[j].permute(1, 2, 3, 0)
        out_x = out if j == grid.col_index else out_with_delta(do_row[j], delta_x)
        for i, y in enumerate(grid.col_mesh_ranks):
            if (j, i) != own:
                backward_block(kernel, do_row[j], q_row[j], out_x, lse_x, k_col[i], v_col[i],
                               x, y, mask, scale, dq_part[j], kv_grads(dkv_part[i], k, v))
        del out_x  # a stand-in output goes before the next one is made
    del q_row, do_row, st_row, k_col, v_col
    dq = dq_part[grid.col_index]
    for rows, got in _return_rows(list(dq_part), peers.row, "backward", ROW, grad_dtypes.dq):
        dq.index_add_(0, rows, got.float())
    dks = [kv_grads(dkv_part[i], k, v) for i in range(grid.rows)]
    dk, dvv = dks[grid.row_index]
    for n, own in enumerate((dk, dvv)):
        for rows, got in _return_rows([d[n] for d in dks], peers.col, "backward", COLUMN,
                                      grad_dtypes.dkv):
            own.index_add_(0, rows, got.float())
    return (dq.to(q.dtype), *split_kv_grads(dkv_part[grid.row_index], k, v))


def window_traffic(
    shape: AttentionShape, heads: int, rows: int, cols: int, window: tuple[int, int],
    causal: bool = True, mesh_rank: int | None = None, grad_bytes: int = FP32_BYTES,
    dkv_grad_bytes: int | None = None, documents=None,
) -> Traffic:
    """Bytes one rank sends under a sliding window (`windowed.py`; `sparse_traffic` with
    the window's mask). `mesh_rank` None: the most any rank of the mesh sends (total)."""
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
    [(Q rows, K/V rows) of each non-empty block of the other rows' queries]; the same of
    its own queries' blocks over the other column members' K/V), the input of
    `memory.extra_memory(..., windowed=...)`."""
    mesh = rows * cols
    local = seq_len // mesh
    mask = AttentionMask(causal, None, mesh, window_of(window, causal))

    def share(me: int, owner: int, side: str) -> Fraction:
        return Fraction(len(needed_rows(mask, rows, cols, local, me, owner, side)), local)

    out = []
    for me in range(mesh):
        i, j = divmod(me, cols)
        row = [i * cols + x for x in range(cols) if i * cols + x != me]
        col = [y * cols + j for y in range(rows) if y * cols + j != me]
        blocks = [block_for(x, y * cols + j, local, mask) for x in row for y in range(rows)]
        mine = [block_for(me, y, local, mask) for y in col]
        out.append((sum((share(me, x, "q") for x in row), Fraction(0)),
                    sum((share(x, me, "q") for x in row), Fraction(0)),
                    sum((share(me, y, "kv") for y in col), Fraction(0)),
                    sum((share(y, me, "kv") for y in col), Fraction(0)),
                    [(Fraction(_row_count(b.q_rows, local), local),
                      Fraction(_row_count(b.kv_rows, local), local))
                     for b in blocks if not b.empty],
                    [(Fraction(_row_count(b.q_rows, local), local),
                      Fraction(_row_count(b.kv_rows, local), local))
                     for b in mine if not b.empty]))
    return out


def _row_count(rows, local: int) -> int:
    """How many rows a block's slice or index tensor takes."""
    return len(range(local)[rows]) if isinstance(rows, slice) else rows.numel()


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
    documents that span ranks (`windowed.sparse_traffic`), plus the heads all-to-all.
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
