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
exchanges `left` rows with each of its two zigzag neighbours.

Memory follows the rows too: a peer's rows are received packed (`kept_rows.KeptRows`: the
blocks' calls read them there), its partial outputs and gradients are accumulated packed
and sent back as they are; this rank's own chunk is used in place, never copied. So a rank
holds its own accumulators plus the rows it exchanges, not whole chunks of its row and
column. Its bytes and memory: `cost_models/sparse.py`, `cost_models/memory.py`."""
from __future__ import annotations

import functools
from typing import Callable, Sequence

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
from .chunks import diagonal_backward, diagonal_forward
from .delta import out_with_delta
from .kept_rows import KeptRows


class _Peer:
    """A row or column peer: its slot (column index in the row, row index in the column),
    global rank, the rows of its chunk this rank uses (`kept`, and as an index tensor) and
    the rows of this rank's chunk it uses (`ours`)."""

    def __init__(self, slot: int, rank: int, theirs: tuple[int, ...], ours: tuple[int, ...],
                 local_len: int, device: torch.device) -> None:
        self.slot, self.rank = slot, rank
        self.kept = KeptRows(theirs, local_len)
        self.ours = torch.tensor(ours, dtype=torch.int64, device=device)


class _Peers:
    """This rank's row and column peers and the rows exchanged with each."""

    def __init__(self, grid: MeshGrid, mask: AttentionMask, local_len: int,
                 device: torch.device) -> None:
        me, r, c = grid.mesh_rank, grid.rows, grid.cols
        need = functools.partial(needed_rows, mask, r, c, local_len)
        ranks = grid.mesh_ranks
        self.row = [_Peer(j, ranks[x], need(me, x, "q"), need(x, me, "q"), local_len, device)
                    for j, x in enumerate(grid.row_mesh_ranks) if x != me]
        self.col = [_Peer(i, ranks[y], need(me, y, "kv"), need(y, me, "kv"), local_len, device)
                    for i, y in enumerate(grid.col_mesh_ranks) if y != me]

    @staticmethod
    def kept(peers: Sequence[_Peer], n: int) -> list[KeptRows | None]:
        """Per slot of n, the peer's `KeptRows` (None: this rank's own whole chunk)."""
        out: list[KeptRows | None] = [None] * n
        for p in peers:
            out[p.slot] = p.kept
        return out


def _sized(t: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """An empty tensor like t with n rows along dim."""
    shape = list(t.shape)
    shape[dim] = n
    return t.new_empty(shape)


def _start_rows(mine: Sequence[torch.Tensor], dims: Sequence[int], peers: Sequence[_Peer],
                phase, direction):
    """Start sending each peer the rows of `mine` it uses (along dims) and receiving, packed,
    the rows of its chunk this rank uses: ({slot: received tensors}, land), land() waiting
    for both and letting the rows sent go. The received tensors are valid after land()."""
    sends, recvs, got = [], [], {}
    for p in peers:
        got[p.slot] = [_sized(t, dim, len(p.kept)) for t, dim in zip(mine, dims)]
        for t, dim, buf in zip(mine, dims, got[p.slot]):
            sends.append((p.rank, t.index_select(dim, p.ours)))
            recvs.append((p.rank, buf))
    held = [comm.exchange(sends, recvs, phase, direction)]
    sends.clear()  # the exchange holds the rows sent until it ends

    def land() -> None:
        held.pop().wait()

    return got, land


def _return_rows(parts: dict[int, torch.Tensor], make: Callable[[int], torch.Tensor],
                 peers: Sequence[_Peer], phase, direction) -> list[tuple]:
    """Send each peer its packed rows parts[slot] (taken out of `parts`, let go once sent)
    and receive the rows of mine it holds into make(n rows); returns [(rows of mine,
    received)], one per peer, to fold in and let go one at a time."""
    sends, recvs = [], []
    for p in peers:
        sends.append((p.rank, parts.pop(p.slot)))
        recvs.append((p.rank, make(len(p.ours))))
    comm.exchange(sends, recvs, phase, direction).wait()
    sends.clear()
    return [(p.ours, got) for p, (_, got) in zip(peers, recvs)]


def forward(q, k, v, grid: MeshGrid, mask: AttentionMask, scale: float, kernel: TileKernel):
    """q [s, b, hq, d], k [s, b, hkv, d], v [s, b, hkv, dv] -> (out [s, b, hq, dv],
    lse [b, hq, s]) of this rank's rows in fp32 (`attention` finishes them)."""
    s, b, hq, _ = q.shape
    dv = v.shape[-1]
    peers = _Peers(grid, mask, s, q.device)
    q_got, land_q = _start_rows([q], (0,), peers.row, "forward", ROW)
    kv_got, land_kv = _start_rows([k, v], (0, 0), peers.col, "forward", COLUMN)
    me = grid.mesh_rank
    # this rank's own block needs no rows of anyone's: it runs while the rows travel
    own_out, own_lse = empty_accumulators(s, b, hq, dv, q.device)
    diagonal_forward(kernel, q, k, v, grid, mask, scale, own_out, own_lse)
    land_q()
    land_kv()
    keys = [(y, *kv_got[i]) if i in kv_got else (y, k, v)
            for i, y in enumerate(grid.col_mesh_ranks)]
    kv_kept = _Peers.kept(peers.col, grid.rows)
    q_kept = _Peers.kept(peers.row, grid.cols)
    accs = {}
    for j, x in enumerate(grid.row_mesh_ranks):
        if j == grid.col_index:
            chunk = (x, q, own_out, own_lse)
        else:  # the peer's rows, packed
            accs[j] = empty_accumulators(len(q_kept[j]), b, hq, dv, q.device)
            chunk = (x, q_got[j][0], *accs[j])
        # the query chunk against the column in few calls (`groups.py`), the own block done
        forward_tile(kernel, [chunk], keys, mask, scale, skip={(me, me)},
                     q_kept=[q_kept[j]], kv_kept=kv_kept)
        del chunk
    del keys, q_got, kv_got
    sends, recvs = [], []
    for p in peers.row:  # each fp32 output goes as soon as it is in the input dtype
        out, lse_p = accs.pop(p.slot)
        sends += [(p.rank, out.to(q.dtype)), (p.rank, lse_p)]
        recvs.append((p.ours, q.new_empty(len(p.ours), b, hq, dv),
                      own_lse.new_empty(b, hq, len(p.ours))))
        del out, lse_p
    comm.exchange(sends, [(p.rank, t) for p, (_, *got) in zip(peers.row, recvs) for t in got],
                  "forward", ROW).wait()
    sends.clear()  # sent: only this rank's accumulators and the received rows are held
    while recvs:  # the received rows merged one peer at a time, each let go once merged
        rows, out, lse_p = recvs.pop(0)
        if len(rows):
            acc_o, acc_l = own_out.index_select(0, rows), own_lse.index_select(-1, rows)
            merge_into(acc_o, acc_l, out, lse_p)
            own_out.index_copy_(0, rows, acc_o)
            own_lse.index_copy_(-1, rows, acc_l)
            del acc_o, acc_l
        del rows, out, lse_p
    return own_out, own_lse


def backward(dout, q, k, v, out, lse, delta, grid: MeshGrid, mask: AttentionMask, scale: float,
             kernel: TileKernel, grad_dtypes: GradDtypes = FP32_GRADS):
    """Gradients dq [s, b, hq, d], dk [s, b, hkv, d], dv [s, b, hkv, dv] in the inputs'
    dtypes; partials summed in fp32 and sent back (only the used rows) in grad_dtypes."""
    dout = dout.contiguous()
    peers = _Peers(grid, mask, q.shape[0], q.device)
    q_got, land_q = _start_rows([q, dout, lse, delta], (0, 0, -1, -1), peers.row, "backward",
                                ROW)
    kv_got, land_kv = _start_rows([k, v], (0, 0), peers.col, "backward", COLUMN)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkv = kv_grad_buffer(k, v)
    me = grid.mesh_rank
    # this rank's own block needs no rows of anyone's: it runs while the rows travel
    diagonal_backward(kernel, dout, q, out, lse, k, v, grid, mask, scale, dq, dkv)
    land_q()
    land_kv()
    dkv_got = {i: kv_grad_buffer(*got) for i, got in kv_got.items()}
    keys = [(y, *kv_got[i], kv_grads(dkv_got[i], *kv_got[i])) if i in kv_got
            else (y, k, v, kv_grads(dkv, k, v)) for i, y in enumerate(grid.col_mesh_ranks)]
    kv_kept = _Peers.kept(peers.col, grid.rows)
    q_kept = _Peers.kept(peers.row, grid.cols)
    dq_got = {}
    for j, x in enumerate(grid.row_mesh_ranks):
        if j == grid.col_index:
            chunk = (x, dout, q, out, lse, dq)
        else:  # the peer's rows, packed, with a stand-in output of their D
            q_x, do_x, lse_x, delta_x = q_got.pop(j)
            dq_got[j] = torch.zeros(q_x.shape, dtype=torch.float32, device=q.device)
            chunk = (x, do_x, q_x, out_with_delta(do_x, delta_x), lse_x, dq_got[j])
            del q_x, do_x, lse_x, delta_x
        backward_tile(kernel, [chunk], keys, mask, scale, skip={(me, me)},
                      q_kept=[q_kept[j]], kv_kept=kv_kept)
        del chunk  # a peer's rows and stand-in output go before the next are taken
    del keys, kv_got
    # the dQ rows back, each peer's in grad_dtypes.dq (the fp32 partials let go once copied)
    sent = {j: t.to(grad_dtypes.dq) for j, t in dq_got.items()}
    dq_got.clear()
    got = _return_rows(sent, lambda n: dq.new_empty(n, *q.shape[1:], dtype=grad_dtypes.dq),
                       peers.row, "backward", ROW)
    while got:
        rows, part = got.pop(0)
        dq.index_add_(0, rows, part.float())
        del rows, part
    # then the dK, dV rows, flat [rows x (K row + V row)] as `blocks.kv_grad_buffer` holds them
    sent = {i: t.to(grad_dtypes.dkv) for i, t in dkv_got.items()}
    dkv_got.clear()
    row_size = (k[0].numel() + v[0].numel())
    got = _return_rows(sent, lambda n: dkv.new_empty(n * row_size, dtype=grad_dtypes.dkv),
                       peers.col, "backward", COLUMN)
    dk, dvv = kv_grads(dkv, k, v)
    while got:
        rows, part = got.pop(0)
        n = len(rows)
        part_k, part_v = kv_grads(part, k[:n], v[:n])
        dk.index_add_(0, rows, part_k.float())
        dvv.index_add_(0, rows, part_v.float())
        del rows, part, part_k, part_v
    return (dq.to(q.dtype), *split_kv_grads(dkv, k, v))
