"""Band pieces of a tile cut into square blocks: which blocks they leave empty, fill, or
touch in part, and the pairs of the partial blocks only (a block mask's build, no tensor
of the tile's rows x keys).

A band piece keeps tile row I and key J iff q0 <= I < q1, k0 <= J < k1 and
lo <= J - I <= hi (`masks/seen.keeps` on tile positions). A kernel call's slices, read in
its own rows (`TileSlices`), become pieces through the map of its rows to tile positions:
each run of rows the map sends to consecutive positions is the slice shifted
(`call_pieces`); rows the map drops (-1) keep nothing. Everything is index arithmetic on
arrays of pieces, runs and blocks; only the blocks a piece touches in part are made, as
`block` x `block` bools. A slice gives one piece per row run it spans and key run its band
meets there: a call's rows come in runs (documents, gathered ranges, a window's kept rows),
so pieces are about as many as slices; rows kept one by one at random would multiply them.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ..masks.seen import Bounds, keeps
from .part_arrays import PartArrays
from .tile_slices import DOCUMENTS, TileSlices

RowMap = int | torch.Tensor  # a call's rows at positions start + i, or int64 [rows] (-1: dropped)
BATCH = 32  # pieces made at once (one transient bool of BATCH x block x block)
_KEY = 1 << 40  # a call's number times this plus a row: runs of all calls in one order


Pieces = PartArrays
"""n band pieces in a tile's positions: `part_arrays.PartArrays` of int64 [n] CPU tensors,
rows [q0, q1) x keys [k0, k1), lo <= key - row <= hi (bounds that limit nothing held at the
rectangle's reach)."""


def slice_table(slices: TileSlices | None, shape: tuple[int, int], causal: bool
                ) -> torch.Tensor:
    """int64 [slices, 6] (q0, q1, k0, k1, lo, hi) of a call of `shape` in its own rows: its
    slices, else all pairs or causal at the bottom right; unbounded lo / hi held at
    -(sq + 1) / sk + 1 (beyond any key - row of the call)."""
    sq, sk = shape
    if slices is None:
        return torch.tensor([[0, sq, 0, sk, -(sq + 1), sk - sq if causal else sk + 1]])
    if slices.form == DOCUMENTS:
        cu_q = torch.from_numpy(np.asarray(slices.cu_q_array, dtype=np.int64))
        cu_kv = torch.from_numpy(np.asarray(slices.cu_kv_array, dtype=np.int64))
        hi = cu_kv[1:] - cu_q[1:] if slices.causal else torch.full_like(cu_q[1:], sk + 1)
        return torch.stack([cu_q[:-1], cu_q[1:], cu_kv[:-1], cu_kv[1:],
                            torch.full_like(hi, -(sq + 1)), hi], 1)
    return torch.tensor([(q0, q1, k0, k1, -(sq + 1) if lo is None else lo,
                          sk + 1 if hi is None else hi)
                         for q0, q1, k0, k1, lo, hi in slices.slices],
                        dtype=torch.int64).reshape(-1, 6)


def row_runs(rows: RowMap, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The runs of a call's `count` rows that `rows` sends to consecutive positions: rows
    [a, b) at positions a + shift .. b + shift, int64 [runs] each (`rows` an int: row i at
    rows + i; else int64 [count] positions, -1 where dropped)."""
    if isinstance(rows, int):
        n = 1 if count > 0 else 0
        return (torch.zeros(n, dtype=torch.int64), torch.full((n,), count, dtype=torch.int64),
                torch.full((n,), rows, dtype=torch.int64))
    t = rows.to("cpu", torch.int64)
    valid = t >= 0
    apart = t[1:] != t[:-1] + 1  # row i + 1 does not follow row i
    start, end = valid.clone(), valid.clone()
    start[1:] &= apart | ~valid[:-1]
    end[:-1] &= apart | ~valid[1:]
    a = start.nonzero().flatten()
    return a, end.nonzero().flatten() + 1, t[a] - a


def call_pieces(tables: Sequence[torch.Tensor], q_runs: Sequence[tuple],
                kv_runs: Sequence[tuple]) -> Pieces:
    """The pieces, in tile positions, of calls n = 0, 1, ...: call n's slices `tables[n]`
    ([m, 6], `slice_table`) through its rows' runs `q_runs[n]` and keys' `kv_runs[n]`
    (`row_runs`): each slice against each pair of a row run and a key run its band meets."""
    if not tables:
        return Pieces(*torch.zeros(6, 0, dtype=torch.int64))
    table = torch.cat(list(tables))
    call = _ids([len(t) for t in tables])
    q0, q1, k0, k1, lo, hi = table.unbind(1)
    # each slice against the row runs that meet its rows
    at, run = _meeting(call, q0, q1, q_runs)
    a, b, shift_q = (torch.cat([r[i] for r in q_runs]) for i in range(3))
    call, lo, hi = call[at], lo[at], hi[at]
    ia, ib, shift_q = q0[at].maximum(a[run]), q1[at].minimum(b[run]), shift_q[run]
    ka, kb = k0[at].maximum(ia + lo), k1[at].minimum(ib + hi)  # keys those rows may see
    # ... and against the key runs that meet those keys
    at, run = _meeting(call, ka, kb, kv_runs)
    a, b, shift_k = (torch.cat([r[i] for r in kv_runs]) for i in range(3))
    ia, ib, lo, hi, shift_q = ia[at], ib[at], lo[at], hi[at], shift_q[at]
    ja, jb, shift_k = ka[at].maximum(a[run]), kb[at].minimum(b[run]), shift_k[run]
    d = shift_k - shift_q
    return Pieces(ia + shift_q, ib + shift_q, ja + shift_k, jb + shift_k, lo + d, hi + d)


def _ids(counts: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """int64 [sum counts]: n repeated counts[n] times."""
    counts = torch.as_tensor(counts, dtype=torch.int64)
    return torch.repeat_interleave(torch.arange(len(counts)), counts)


def _expand(first: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(which n, first[n] + k) for k = 0 .. count[n] - 1, int64 [sum count] each."""
    count = count.clamp(min=0)
    at = _ids(count)
    begin = torch.cumsum(count, 0) - count
    return at, first[at] + torch.arange(len(at)) - begin[at]


def _meeting(call: torch.Tensor, start: torch.Tensor, end: torch.Tensor,
             runs: Sequence[tuple]) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, r) for each range n = [start[n], end[n]) of call call[n] and each run r of that
    call's `runs` (concatenated over calls, each call's sorted) that meets it."""
    owner = _ids([len(r[0]) for r in runs])
    a = torch.cat([r[0] for r in runs]) + owner * _KEY
    b = torch.cat([r[1] for r in runs]) + owner * _KEY
    first = torch.searchsorted(b, call * _KEY + start, right=True)
    last = torch.searchsorted(a, call * _KEY + end)
    return _expand(first, torch.where(end > start, last - first, 0))


def block_kinds(pieces: Pieces, shape: tuple[int, int], block: int, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The union of `pieces` over a tile of `shape` (sq, sk) in blocks of `block` x `block`
    (the last ones padded with pairs kept by none), on `device`: kinds int32 [q blocks, kv
    blocks] (0 empty, 1 full, 2 + n the n-th partial block, numbered row by row) and
    partial bool [`bucket`(2 + partial blocks), block, block] (entry 0 keeps none, entry 1
    all, then the partial blocks). Made: the blocks some piece touches in part and none
    fills, `BATCH` pieces at a time, straight into `partial` (copied once more only where
    some of them turn out full)."""
    sq, sk = shape
    outside = (pieces.q0 < 0) | (pieces.q1 > sq) | (pieces.k0 < 0) | (pieces.k1 > sk)
    if bool(outside.any()):
        n = int(outside.nonzero()[0])
        raise ValueError(f"piece {n} (rows {int(pieces.q0[n])}..{int(pieces.q1[n])}, keys "
                         f"{int(pieces.k0[n])}..{int(pieces.k1[n])}) is outside the tile "
                         f"{sq} x {sk}: rows and keys must lie in [0, sq) and [0, sk)")
    nq, nk = -(-sq // block), -(-sk // block)
    pieces = pieces.take((pieces.q1 > pieces.q0) & (pieces.k1 > pieces.k0)
                         & (pieces.lo <= pieces.hi))  # those that keep some pair
    # each piece against the block rows it spans, and there the block columns its band meets
    at, row = _expand(pieces.q0 // block, (pieces.q1 - 1) // block - pieces.q0 // block + 1)
    p = pieces.take(at)
    top = row * block
    ka = p.k0.maximum(p.q0.maximum(top) + p.lo)
    kb = p.k1.minimum(p.q1.minimum(top + block) + p.hi)
    meets = kb > ka
    p, row, ka, kb = p.take(meets), row[meets], ka[meets], kb[meets]
    at, col = _expand(ka // block, (kb - 1) // block - ka // block + 1)
    p, row = p.take(at), row[at]
    r0, c0 = row * block, col * block
    fills = ((p.q0 <= r0) & (p.q1 >= r0 + block) & (p.k0 <= c0) & (p.k1 >= c0 + block)
             & (r0 + block <= sq) & (c0 + block <= sk)
             & (c0 - r0 - (block - 1) >= p.lo) & (c0 - r0 + block - 1 <= p.hi))
    cell = row * nk + col
    full = torch.zeros(nq * nk, dtype=torch.bool)
    full[cell[fills]] = True
    touched = torch.zeros(nq * nk, dtype=torch.bool)
    touched[cell] = True
    made_ids = (touched & ~full).nonzero().flatten()  # row by row
    slot = torch.full((nq * nk,), -1, dtype=torch.int64)
    slot[made_ids] = torch.arange(len(made_ids))
    part = ~fills & (slot[cell] >= 0)
    p, r0, c0, cell = p.take(part), r0[part], c0[part], cell[part]
    local = torch.stack([(p.q0 - r0).clamp(0, block), (p.q1 - r0).clamp(0, block),
                         (p.k0 - c0).clamp(0, block), (p.k1 - c0).clamp(0, block),
                         (p.lo - c0 + r0).clamp(-block, block),
                         (p.hi - c0 + r0).clamp(-block, block)], 1)
    slots = slot[cell]
    filled, empty = _filled(slots, local, len(made_ids), block)
    kinds = full.to(torch.int32)
    kinds[made_ids[filled]] = 1
    partial = ~filled & ~empty
    count = int(partial.sum())
    kinds[made_ids[partial]] = 2 + torch.arange(count, dtype=torch.int32)
    renumber = torch.cumsum(partial, 0) - 1
    keep = partial[slots]
    return (kinds.view(nq, nk).to(device),
            _made(renumber[slots[keep]], local[keep], count, block, device))


def _filled(slots: torch.Tensor, local: torch.Tensor, count: int, block: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """bool [count] twice: which blocks the pieces local[n] (`_made`) in block slots[n]
    fill together, and which they leave empty (pieces of no pairs). A block whose pieces
    hold fewer pairs than it has is not filled; the others (pieces meeting or overlapping
    there) are made on the CPU, `BATCH` blocks at a time, and read."""
    rows = torch.arange(block)
    r0, r1, c0, c1, lo, hi = local[:, :, None].unbind(1)  # [n, 1] each
    width = ((c1.minimum(rows + hi + 1) - c0.maximum(rows + lo)).clamp(min=0)
             * ((rows >= r0) & (rows < r1)))  # [n, block]: each row's pairs
    pairs = torch.zeros(count, dtype=torch.int64).index_add_(0, slots, width.sum(1))
    filled = torch.zeros(count, dtype=torch.bool)
    maybe = (pairs >= block * block).nonzero().flatten()
    order = torch.sort(slots, stable=True).indices
    slots, local = slots[order], local[order]
    for n in range(0, len(maybe), BATCH):
        group = maybe[n:n + BATCH]
        at = torch.cat([torch.arange(a, b) for a, b in zip(
            torch.searchsorted(slots, group).tolist(),
            torch.searchsorted(slots, group, right=True).tolist())])
        made = _made(torch.searchsorted(group, slots[at]), local[at], len(group), block,
                     torch.device("cpu"))
        filled[group] = made[2:2 + len(group)].view(len(group), -1).all(1)
    return filled, pairs == 0


def bucket(n: int) -> int:
    """The least power of two >= n (a compiled kernel sees few shapes of partial blocks)."""
    return 1 << (n - 1).bit_length()


def _made(slots: torch.Tensor, local: torch.Tensor, count: int, block: int,
          device: torch.device) -> torch.Tensor:
    """bool [`bucket`(2 + count), block, block] on `device`: entry 0 none, entry 1 all, and
    entry 2 + slots[n] ORs the piece local[n] (rows [r0, r1) x keys [c0, c1),
    lo <= key - row <= hi, in the block's own rows and keys)."""
    made = torch.zeros(bucket(2 + count), block, block, dtype=torch.bool, device=device)
    made[1] = True
    if not len(slots):
        return made
    order = torch.sort(slots, stable=True).indices
    slots, local = slots[order], local[order]
    first = torch.searchsorted(slots, slots)  # each one's rank among its block's pieces
    rank = torch.arange(len(slots)) - first
    i = torch.arange(block, dtype=torch.int16, device=device)
    for r in range(int(rank.max()) + 1):  # one piece a block at a time: unique slots
        chosen = (rank == r).nonzero().flatten()
        for n in range(0, len(chosen), BATCH):
            at = chosen[n:n + BATCH]
            bounds = local[at].to(device, torch.int16)[:, :, None, None].unbind(1)
            if r == 0:  # each block's first piece: blocks in a row, still empty
                first = int(slots[at[0]]) + 2
                _keep(made[first:first + len(at)], i, *bounds)
            else:
                made[slots[at].to(device) + 2] |= _keep(
                    torch.empty(len(at), block, block, dtype=torch.bool, device=device),
                    i, *bounds)
    return made


def _keep(out: torch.Tensor, i: torch.Tensor, r0, r1, c0, c1, lo, hi) -> torch.Tensor:
    """out [n, block, block] = the pieces' pairs (bounds [n, 1, 1] each, in the block's
    rows i and keys i: `masks.seen.keeps`)."""
    return keeps(Bounds(r0, r1, c0, c1, lo, hi), i[:, None], i, out=out)


__all__ = ["BATCH", "Pieces", "block_kinds", "bucket", "call_pieces", "row_runs", "slice_table"]
