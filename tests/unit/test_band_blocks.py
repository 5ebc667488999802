"""A tile's block mask built straight from its calls' slices (`calls/band_blocks.py`):
calls whose rows land anywhere in the tile (at an offset, kept in part, in any order, some
dropped), slices of every kind (empty ones, bounds at 127 / 128 / 129 of the 128-row
blocks), against the mask of the definition built here; and `masks.seen.keeps` written in
place (`out=`) is `keeps`."""
from __future__ import annotations

import random

import torch

from megatron_mesh.calls.band_blocks import call_pieces, row_runs, slice_table
from megatron_mesh.calls.tile_slices import TileSlices
from megatron_mesh.kernels.flex import BLOCK, TileMask
from megatron_mesh.masks.seen import Bounds, keeps

from reference import seen_of_slices

EDGES = (0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK - 1, 2 * BLOCK, 2 * BLOCK + 1)
BOUNDS = (None, -2 * BLOCK, -BLOCK - 1, -BLOCK, -BLOCK + 1, -1, 0, 1, BLOCK - 1, BLOCK,
          BLOCK + 1, 2 * BLOCK)


def random_slices(rnd: random.Random, sq: int, sk: int) -> tuple:
    """0 to 4 slices of a call of sq x sk, their ends at block edges or anywhere, some
    empty (q0 == q1, k0 == k1, or lo > hi)."""
    def ends(n: int) -> list[int]:
        return sorted(rnd.choice([e for e in EDGES if e <= n] + [n, rnd.randint(0, n)])
                      for _ in range(2))
    return tuple((*ends(sq), *ends(sk), rnd.choice(BOUNDS), rnd.choice(BOUNDS))
                 for _ in range(rnd.randint(0, 4)))


def random_places(rnd: random.Random, count: int, total: int) -> int | torch.Tensor:
    """Where a call's `count` rows lie among a tile's `total`: at an offset (an int), or
    int64 [count] positions (-1: dropped): a few kept in order at random places, or in a
    random order (rows one by one: a piece each), or runs of consecutive positions with
    gaps."""
    kind = rnd.randrange(4)
    if kind == 0 and count <= total:
        return rnd.randint(0, total - count)
    places = torch.full((count,), -1, dtype=torch.int64)
    kept = rnd.sample(range(count), rnd.randint(0, min(count, total, 24)))
    spots = rnd.sample(range(total), len(kept))
    if kind == 1:
        kept, spots = sorted(kept), sorted(spots)
    elif kind == 3:  # consecutive positions, a few rows dropped
        n = min(count, total)
        start = rnd.randint(0, total - n)
        kept = [r for r in range(n) if rnd.random() < 0.8]
        spots = [start + r for r in kept]
    places[torch.tensor(kept, dtype=torch.int64)] = torch.tensor(spots, dtype=torch.int64)
    return places


def test_a_tiles_block_mask_from_calls_placed_anywhere_is_the_definitions() -> None:
    """Up to 3 calls of random slices, each call's rows and keys placed in the tile by
    `random_places` (calls may share tile rows): `call_pieces` then `TileMask.of_pieces`
    gives the mask of the union of each call's pairs at its places, built here from the
    slices' definition (same kinds, partial blocks numbered alike)."""
    rnd = random.Random(11)
    sizes = (1, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 1, 300)
    for _ in range(60):
        sq, sk = rnd.choice(sizes), rnd.choice(sizes)
        tables, q_runs, kv_runs = [], [], []
        want = torch.zeros(sq, sk, dtype=torch.bool)
        for _ in range(rnd.randint(1, 3)):
            cq, ck = rnd.choice(sizes), rnd.choice(sizes)
            slices = random_slices(rnd, cq, ck)
            q_at, k_at = random_places(rnd, cq, sq), random_places(rnd, ck, sk)
            tables.append(slice_table(TileSlices((cq, ck), slices, "slices"), (cq, ck), False))
            q_runs.append(row_runs(q_at, cq))
            kv_runs.append(row_runs(k_at, ck))
            q_pos = q_at + torch.arange(cq) if isinstance(q_at, int) else q_at
            k_pos = k_at + torch.arange(ck) if isinstance(k_at, int) else k_at
            rows, keys = (q_pos >= 0).nonzero().flatten(), (k_pos >= 0).nonzero().flatten()
            seen = seen_of_slices(slices, (cq, ck))[rows[:, None], keys[None, :]]
            at = (q_pos[rows][:, None], k_pos[keys][None, :])
            want[at] = want[at] | seen
        made = TileMask.of_pieces((sq, sk), call_pieces(tables, q_runs, kv_runs),
                                  torch.device("cpu"))
        whole = TileMask.of(want)
        assert torch.equal(made.kinds, whole.kinds) and torch.equal(made.partial,
                                                                    whole.partial)


def test_keeps_written_in_place_is_keeps() -> None:
    """`keeps(..., out=)` writes what `keeps` returns: bounds as tensors [n, 1, 1] over
    a block's rows and keys (what the block build passes, int16), and as ints."""
    g = torch.Generator().manual_seed(2)
    i = torch.arange(BLOCK, dtype=torch.int16)
    r0, r1, c0, c1 = (torch.randint(0, BLOCK + 1, (40, 1, 1), generator=g, dtype=torch.int16)
                      for _ in range(4))
    lo, hi = (torch.randint(-BLOCK, BLOCK + 1, (40, 1, 1), generator=g, dtype=torch.int16)
              for _ in range(2))
    for bounds in (Bounds(r0, r1, c0, c1, lo, hi), Bounds(3, 100, 20, 128, -5, 60),
                   Bounds(0, BLOCK, 0, BLOCK)):
        want = keeps(bounds, i[:, None], i)
        out = torch.ones(want.shape, dtype=torch.bool)
        assert keeps(bounds, i[:, None], i, out=out) is out and torch.equal(out, want)
