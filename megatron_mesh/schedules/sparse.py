"""The sparse exchange: each rank receives only the rows its tile's blocks use, whatever
schedule was asked for. It runs every mask whose blocks leave rows unused: sliding windows,
placed documents and the slices a user gives (`layer_plan.Runner.SPARSE`).

Under such a mask many rank-blocks are empty and the others use some of their rows
(`layout.block_for`). Rank M = (i, j) needs, of row member x's Q (and in backward dO, lse,
D), the query rows of its blocks (x, y) over its column's y; of column member y's K/V, the
key rows of its blocks (x, y) over its row's x (`masks.needed_rows`). Each owner sends
exactly those rows, point to point; partial outputs and gradients go back for the same rows
only. Ranks that share no row send nothing. So under a window the bytes per rank grow with
the window, not with S: with a window of at most a sub-chunk the ring corner (P x 1)
exchanges `left` rows with each of its two zigzag neighbours. Received rows are laid into
buffers of the whole chunk (zeros elsewhere), as in the gathered schedule. Its bytes and
memory: `cost_models/sparse.py`."""
from __future__ import annotations

import functools

import torch

from ..calls.layout import AttentionMask
from ..calls.needed_rows import needed_rows
from ..common.merge import empty_accumulators, merge_into
from ..dtypes import FP32_GRADS, GradDtypes
from ..kernels import TileKernel
from ..layer_plan import COLUMN, ROW
from ..runtime import comm
from ..runtime.grid import MeshGrid
from .blocks import backward_tile, forward_tile, kv_grad_buffer, kv_grads, split_kv_grads
from .chunks import column_grad_keys, column_keys, diagonal_backward, diagonal_forward
from .delta import out_with_delta


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
    me = grid.mesh_rank
    # this rank's own block needs no rows of anyone's: it runs while the rows travel
    accs = {grid.col_index: empty_accumulators(s, b, hq, dv, q.device)}
    diagonal_forward(kernel, q, k, v, grid, mask, scale, *accs[grid.col_index])
    land_q()
    land_kv()
    column = column_keys(grid, list(zip(k_col, v_col)))
    for j, x in enumerate(grid.row_mesh_ranks):
        if j not in accs:
            accs[j] = empty_accumulators(s, b, hq, dv, q.device)
        # the query chunk against the column in few calls (`groups.py`), the own block done
        forward_tile(kernel, [(x, q_row[j], *accs[j])], column, mask, scale, skip={(me, me)})
    del column
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
    me = grid.mesh_rank
    # this rank's own block needs no rows of anyone's: it runs while the rows travel
    diagonal_backward(kernel, dout, q, out, lse, k, v, grid, mask, scale,
                      dq_part[grid.col_index], dkv_part[grid.row_index])
    land_q()
    land_kv()
    column = column_grad_keys(grid, list(zip(k_col, v_col)), dkv_part, k, v)
    for j, x in enumerate(grid.row_mesh_ranks):
        lse_x, delta_x = st_row[j].permute(1, 2, 3, 0)
        out_x = out if j == grid.col_index else out_with_delta(do_row[j], delta_x)
        backward_tile(kernel, [(x, do_row[j], q_row[j], out_x, lse_x, dq_part[j])], column,
                      mask, scale, skip={(me, me)})
        del out_x  # a stand-in output goes before the next one is made
    del column
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
