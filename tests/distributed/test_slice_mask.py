"""Masks given as slices (`mesh_attention(..., mask=)`) on gloo ranks, against torch SDPA over
the whole sequence with a dense boolean mask built here from the slices' definition, forward
and backward: every (A, R, C) grid of P = 2, 4, 8; prefix-LM, block-diagonal documents, a
random slice list, rows that see nothing, full and causal slices of unequal lengths; GQA and
MQA, fp32 and bf16. Each case's bytes, counted on the real collectives and by the
TrafficCounter, equal the traffic model of the exchange that ran; short documents take the
sparse exchange and send a fraction of the dense bytes. Bad masks raise on every rank. One
`Mask` composed of documents (THD, placed), a window and slices is exact too, and the old
keywords build the same value."""
from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

import megatron_mesh as mm
from megatron_mesh.calls.layout import AttentionMask, zigzag_split
from megatron_mesh.cost_models.sparse import sparse_traffic
from megatron_mesh.layer_plan import Exchange, Schedule, grid_shapes

from dist_utils import run_distributed
from reference import beyond_tolerance, count_sent_bytes, partial_results

LOCAL = 8  # tokens per rank: sub-chunks of 4
Q_HEADS = 8
SCHEDULES = tuple(str(s) for s in Schedule)


def dense_mask(slices: list[tuple], seq: int) -> torch.Tensor:
    """[seq, seq] bool from the definition: query i sees key j iff some slice holds (i, j)
    and, for a causal one, j - k_start <= i - q_start + (k_end - k_start) - (q_end - q_start)."""
    i = torch.arange(seq)[:, None]
    j = torch.arange(seq)[None, :]
    seen = torch.zeros(seq, seq, dtype=torch.bool)
    for q0, q1, k0, k1, kind in slices:
        inside = (i >= q0) & (i < q1) & (j >= k0) & (j < k1)
        if kind == "causal":
            inside &= (j - k0) <= (i - q0) + (k1 - k0) - (q1 - q0)
        seen |= inside
    return seen


def documents(seq: int, lengths=(3, 1, 5, 2, 7, 4, 6, 2, 9, 1)) -> list[tuple]:
    """Block-diagonal causal documents of the given lengths, repeated over the sequence."""
    out, start, n = [], 0, 0
    while start < seq:
        end = min(seq, start + lengths[n % len(lengths)])
        out.append((start, end, start, end, "causal"))
        start, n = end, n + 1
    return out


def random_slices(seq: int, count: int, seed: int) -> list[tuple]:
    rng = random.Random(seed)
    out: list[tuple] = []
    while len(out) < count:
        q0, k0 = rng.randrange(seq), rng.randrange(seq)
        q1, k1 = rng.randint(q0 + 1, seq), rng.randint(k0 + 1, min(seq, k0 + seq // 3))
        s = (q0, q1, k0, k1, rng.choice(("full", "causal")))
        if not any(a < q1 and q0 < b and c < k1 and k0 < d for a, b, c, d, _ in out):
            out.append(s)
    return out


def masks(seq: int) -> dict[str, list[tuple]]:
    """The cases' slice lists over `seq` positions."""
    third, half, quarter = seq // 3, seq // 2, seq // 4
    return {
        "prefix-LM": [s.as_tuple for s in mm.prefix_lm_mask(seq, third + 1).slices],
        "documents": documents(seq),
        "random": random_slices(seq, 6, seq),
        "rows that see nothing": [(0, quarter, 0, quarter // 2, "causal"),  # sq > sk
                                  (half, seq, half + 1, seq, "full")],
        "unequal": [(0, half, quarter, seq, "causal"), (half, seq, 0, third, "full"),
                    (half + 1, seq, third, seq - 2, "causal"), (half, half + 1, third, seq, "full")],
    }


@dataclass(frozen=True)
class SliceCase:
    name: str
    slices: tuple
    kv_heads: int = 2  # GQA; 1: MQA
    dtype: torch.dtype = torch.float32
    batch: int = 1
    schedule: str = "streamed"
    window_exchange: str = "sparse"
    seed: int = 0

    def __str__(self) -> str:
        return (f"{self.name} hkv={self.kv_heads} {str(self.dtype)[6:]} b={self.batch} "
                f"{self.schedule} {self.window_exchange}")


def reference(x: dict, seen: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """out, dq, dk, dv [S, b, h, d] of SDPA with `seen` in `dtype` (fp64 out): a row that sees
    no key is given its own key and then zeroed, so its output is 0 and it sends no gradient."""
    has_key = seen.any(1)
    t = {n: x[n].to(dtype).permute(1, 2, 0, 3).requires_grad_() for n in "qkv"}
    o = F.scaled_dot_product_attention(t["q"], t["k"], t["v"], enable_gqa=True,
                                       attn_mask=seen | torch.diag(~has_key))
    o = o * has_key[None, None, :, None]
    o.backward(x["dout"].to(dtype).permute(1, 2, 0, 3))
    sbhd = lambda r: r.detach().permute(2, 0, 1, 3).double()  # noqa: E731
    return {"out": sbhd(o), "dq": sbhd(t["q"].grad), "dk": sbhd(t["k"].grad),
            "dv": sbhd(t["v"].grad)}


def expected_bytes(case: SliceCase, grid: mm.MeshGrid, seq: int, exchange: Exchange,
                   plan) -> int:
    """The traffic model's bytes of this rank: the sparse exchange's rows or the dense plan."""
    shape = mm.AttentionShape(seq, case.batch, Q_HEADS, case.kv_heads, 8, case.dtype.itemsize)
    if exchange is Exchange.DENSE:
        return mm.mesh_traffic(shape, plan).total
    e = case.dtype.itemsize
    mask = AttentionMask(False, ranks=grid.rows * grid.cols, slices=mm.SliceMask(case.slices))
    return sparse_traffic(shape, grid.heads, grid.rows, grid.cols, mask, grid.mesh_rank,
                          plan.dq_bytes(e), plan.dkv_bytes(e)).total


def check(case: SliceCase, grid: mm.MeshGrid) -> tuple[list[str], int, Exchange]:
    """Failures of one case, the bytes this rank sent and the exchange that ran."""
    seq = LOCAL * grid.cp_size
    g = torch.Generator().manual_seed(case.seed)
    heads = {"q": Q_HEADS, "k": case.kv_heads, "v": case.kv_heads, "dout": Q_HEADS}
    x = {n: torch.randn(seq, case.batch, h, 8, generator=g, dtype=torch.float64)
         for n, h in heads.items()}
    mine = lambda t: zigzag_split(t, grid.cp_size)[grid.cp_rank]  # noqa: E731
    share = {n: mine(t).to(case.dtype) for n, t in x.items()}
    q, k, v = (share[n].requires_grad_() for n in "qkv")
    mask = mm.SliceMask(case.slices)
    plan = mm.MeshAttention.build(q, k, v, grid, schedule=case.schedule, mask=mask,
                                  window_exchange=case.window_exchange).plan  # local
    with count_sent_bytes() as sent, mm.TrafficCounter() as counter:
        out = mm.mesh_attention(q, k, v, grid, schedule=case.schedule, mask=mask,
                                window_exchange=case.window_exchange)
        out.backward(share["dout"])
    got = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    seen = dense_mask(list(case.slices), seq)
    ref = {n: mine(t) for n, t in reference(x, seen, torch.float64).items()}
    same = {n: mine(t) for n, t in reference(x, seen, case.dtype).items()}
    same32 = ({n: mine(t) for n, t in reference(x, seen, torch.float32).items()}
              if case.dtype != torch.float32 else None)
    where = f"{case} grid {grid.shape_text} rank {grid.cp_rank}"
    bad = beyond_tolerance(got, ref, same, case.dtype, where, partial_results(grid), same32)
    blind = ~mine(seen.any(1))  # this rank's rows that see nothing: exactly 0
    if bool(got["out"][blind].any()) or bool(got["dq"][blind].any()):
        bad.append(f"{where}: rows that see no key have output or gradient")
    expected = expected_bytes(case, grid, seq, plan.exchange, plan)
    if not sent[0] == counter.total_bytes == expected:
        bad.append(f"{where}: sent {sent[0]} B, counter {counter.total_bytes} B, traffic model "
                   f"({plan.exchange} exchange) {expected} B")
    return bad, counter.total_bytes, plan.exchange


def cases(cp_size: int, index: int) -> list[SliceCase]:
    """Every mask on grid `index`, with GQA / MQA, fp32 / bf16, the schedule and the batch
    taking turns."""
    out = []
    for i, (name, slices) in enumerate(masks(LOCAL * cp_size).items()):
        n = index + i
        out.append(SliceCase(name, tuple(slices), kv_heads=(2, 1)[n % 2],
                             dtype=(torch.float32, torch.bfloat16)[(n // 2) % 2],
                             batch=1 + (n % 3 == 0), schedule=SCHEDULES[n % 3], seed=n))
    return out


def _run(rank: int, world: int) -> list[str]:
    bad = []
    for index, (a, r, c) in enumerate(grid_shapes(world)):
        grid = mm.MeshGrid.build(rows=r, cols=c, heads=a)
        for case in cases(world, index):
            try:
                bad += check(case, grid)[0]
            except Exception as e:  # noqa: BLE001 (reported with the case)
                bad.append(f"{case} grid {grid.shape_text} rank {rank}: {type(e).__name__}: {e}")
    return bad + _sparse_bytes(rank, world) + _bad_masks(rank, world) + _composed(rank, world)


def packed_seen(cu: list[int], lengths: list[int], causal: bool) -> torch.Tensor:
    """[T, T] bool from the definition of packed documents starting at `cu` (padded starts)
    with `lengths` real tokens: same document, real tokens, j <= i where causal."""
    total = cu[-1]
    doc = torch.full((total,), -1)
    for d, (start, n) in enumerate(zip(cu, lengths)):
        doc[start:start + n] = d
    i, j = torch.arange(total)[:, None], torch.arange(total)[None, :]
    seen = (doc[:, None] == doc[None, :]) & (doc[:, None] >= 0)
    return seen & (j <= i) if causal else seen


def band_seen(seq: int, left: int, right: int) -> torch.Tensor:
    """[seq, seq] bool: i - left <= j <= i + right (-1: unbounded)."""
    d = torch.arange(seq)[None, :] - torch.arange(seq)[:, None]
    return (d >= (-left if left >= 0 else -seq)) & (d <= (right if right >= 0 else seq))


def _composed(rank: int, world: int) -> list[str]:
    """One Mask composed of documents (THD with padding, placed), a window and a user's
    slices, against SDPA with the intersection built here from each part's definition,
    forward and backward, on every grid; the old keywords build the same value (bit for
    bit)."""
    seq = LOCAL * world
    p2 = 2 * world
    cu_pad = [0, p2, 3 * p2, 4 * p2]  # padded documents of 2P, 4P, 2P tokens
    lengths = [p2 - 1, 2 * p2 - 1, world]
    cu = [0] + list(torch.tensor(lengths).cumsum(0).tolist())
    docs = mm.Documents.from_cu_seqlens(cu, cu_pad)
    prefix = mm.prefix_lm_mask(seq, 5)  # over the packed positions: 5 global prefix tokens
    user = mm.SliceMask(random_slices(seq, 5, 7 * world))
    thd = dict(documents=docs)
    cases = {  # name -> (mask, the keywords that build it (or None), pairs kept, layout)
        "window & THD documents": (
            mm.documents_mask(cu, cu_pad) & mm.sliding_window_mask(3),
            dict(cu_seqlens=cu, cu_seqlens_padded=cu_pad, window_size=(3, 0)),
            packed_seen(cu_pad, lengths, True) & band_seen(seq, 3, 0), thd),
        "prefix-LM & THD documents": (
            mm.documents_mask(docs, causal=False) & prefix,
            dict(cu_seqlens=docs, mask=prefix),
            packed_seen(cu_pad, lengths, False) & dense_mask(
                [s.as_tuple for s in prefix.slices], seq), thd),
        "slices & window & THD documents, not causal": (
            mm.documents_mask(docs, causal=False) & user & mm.sliding_window_mask(2, 3, False),
            dict(cu_seqlens=docs, mask=user, window_size=(2, 3)),
            packed_seen(cu_pad, lengths, False) & band_seen(seq, 2, 3)
            & dense_mask([s.as_tuple for s in user.slices], seq), thd),
        "slices & window": (
            mm.sliding_window_mask(4, 1, causal=False) & user, dict(mask=user, window_size=(4, 1)),
            band_seen(seq, 4, 1) & dense_mask([s.as_tuple for s in user.slices], seq), {}),
    }
    placed_cu = [0, 3, 3 + 2 * p2 + 1, seq - 2, seq]  # one document spans ranks
    placement = mm.place_documents(placed_cu, world)
    placed_len = [b - a for a, b in zip(placed_cu, placed_cu[1:])]
    cases["prefix-LM & placed documents"] = (
        mm.documents_mask(placement, causal=False) & prefix, dict(placement=placement, mask=prefix),
        packed_seen(placed_cu, placed_len, False)
        & dense_mask([s.as_tuple for s in prefix.slices], seq), dict(placement=placement))
    cases["window & placed documents"] = (
        mm.documents_mask(placement) & mm.sliding_window_mask(5),
        dict(placement=placement, window_size=(5, 0)),
        packed_seen(placed_cu, placed_len, True) & band_seen(seq, 5, 0),
        dict(placement=placement))
    bad = []
    for index, (a, r, c) in enumerate(grid_shapes(world)):
        grid = mm.MeshGrid.build(rows=r, cols=c, heads=a)
        for n, (name, (mask, keywords, seen, layout)) in enumerate(cases.items()):
            where = f"{name} grid {grid.shape_text} rank {rank}"
            try:
                bad += _check_composed(grid, mask, keywords, seen, layout, index + n, where)
            except Exception as e:  # noqa: BLE001 (reported with the case)
                bad.append(f"{where}: {type(e).__name__}: {e}")
    return bad


def _check_composed(grid: mm.MeshGrid, mask: mm.Mask, keywords: dict | None,
                    seen: torch.Tensor, layout: dict, n: int, where: str) -> list[str]:
    seq = seen.shape[0]
    g = torch.Generator().manual_seed(n)
    kv_heads = (2, 1)[n % 2]
    heads = {"q": Q_HEADS, "k": kv_heads, "v": kv_heads, "dout": Q_HEADS}
    x = {name: torch.randn(seq, 1, h, 8, generator=g, dtype=torch.float64)
         for name, h in heads.items()}
    if "documents" in layout:
        mine = lambda t: mm.thd_split(t, layout["documents"], grid.cp_size)[grid.cp_rank]  # noqa: E731
    elif "placement" in layout:
        index = layout["placement"].token_indices(grid.cp_rank)
        mine = lambda t: t[index]  # noqa: E731
    else:
        mine = lambda t: zigzag_split(t, grid.cp_size)[grid.cp_rank]  # noqa: E731
    packed = bool(layout)
    share = {name: mine(t)[:, 0] if packed else mine(t) for name, t in x.items()}
    results = {}
    for how, kwargs in (("mask", dict(mask=mask)), ("keywords", keywords)):
        if kwargs is None:
            continue
        q, k, v = (share[name].float().requires_grad_() for name in "qkv")
        out = mm.mesh_attention(q, k, v, grid, **kwargs)
        out.backward(share["dout"].float())
        results[how] = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    got = results["mask"]
    unpack = (lambda t: t[:, None]) if packed else (lambda t: t)  # noqa: E731
    ref = {name: mine(t) for name, t in reference(x, seen, torch.float64).items()}
    same = {name: mine(t) for name, t in reference(x, seen, torch.float32).items()}
    bad = beyond_tolerance({name: unpack(t) for name, t in got.items()}, ref, same,
                           torch.float32, where, partial_results(grid))
    if "keywords" in results and any(not torch.equal(got[name], results["keywords"][name])
                                     for name in got):
        bad.append(f"{where}: the keywords' mask differs from the Mask's (want bit for bit)")
    return bad


def _sparse_bytes(rank: int, world: int) -> list[str]:
    """Short documents: the sparse exchange, a fraction of the dense exchange's bytes (the
    same mask with window_exchange='gathered', counted), on the 2D grids."""
    bad = []
    slices = tuple(documents(LOCAL * world, (2, 3, 1, 2)))
    for r, c in ((world, 1), (2, world // 2)):
        grid = mm.MeshGrid.build(rows=r, cols=c)
        sparse = SliceCase("short documents", slices, schedule="gathered")
        dense = SliceCase("short documents", slices, schedule="gathered",
                          window_exchange="gathered")
        fails, sparse_bytes, exchange = check(sparse, grid)
        fails_dense, dense_bytes, _ = check(dense, grid)
        bad += fails + fails_dense
        if exchange is not Exchange.SPARSE or not sparse_bytes * 4 <= dense_bytes:
            bad.append(f"short documents grid {grid.shape_text} rank {rank}: {exchange} exchange "
                       f"sent {sparse_bytes} B, dense {dense_bytes} B (want sparse, <= 1/4)")
    return bad


def _bad_masks(rank: int, world: int) -> list[str]:
    """Bad masks raise ValueError on every rank, naming what is wrong, before the attention's
    collectives: the group runs the next call after each."""
    seq = LOCAL * world
    grid = mm.MeshGrid.build(rows=world, cols=1)
    q = torch.randn(LOCAL, 1, 2, 8)
    good = [(0, seq, 0, seq, "causal")]
    calls = [
        ("past the end", dict(mask=[(0, seq, 0, seq + 1, "full")]),
         f"reaches past the sequence of {seq} tokens"),
        ("past the end on rank 0 only",
         dict(mask=[(0, seq + (rank == 0), 0, seq, "full")]), "reaches past the sequence"),
        ("overlap on the last rank only",
         dict(mask=good + ([(0, 1, 0, 1, "full")] if rank == world - 1 else [])), "overlap"),
        ("different masks", dict(mask=[(0, seq, 0, seq, "causal" if rank else "full")]),
         "mask 1 slices"),
        ("built for another length", dict(mask=mm.prefix_lm_mask(2 * seq, 2)),
         f"built for a sequence of {2 * seq} tokens"),
        ("with causal", dict(mask=good, causal=True), "causal=True was given with a mask"),
        ("a window that is not one", dict(mask=good, window_size=(2, 0, 1)),
         "window_size=(2, 0, 1)"),
        ("other documents", dict(mask=mm.documents_mask([0, seq]), cu_seqlens=[0, 2, seq]),
         "different documents"),
    ]
    bad = []
    for name, kwargs, words in calls:
        try:
            mm.mesh_attention(q, q, q, grid, **kwargs)
            bad.append(f"{name}: rank {rank} was not refused")
        except ValueError as e:
            if words not in str(e):
                bad.append(f"{name}: rank {rank}: {words!r} not in {e}")
        out = mm.mesh_attention(q, q, q, grid, mask=good)  # the group still runs
        want = mm.mesh_attention(q, q, q, grid)  # a causal slice over all: the causal mask
        if not torch.allclose(out, want, atol=1e-6):
            bad.append(f"{name}: rank {rank}: the causal slice differs from causal=True")
    return bad


@pytest.mark.parametrize("cp_size", [2, 4, 8])
def test_slice_masks_exact_on_every_grid(cp_size: int) -> None:
    bad = [b for rank_bad in run_distributed(_run, cp_size) for b in rank_bad]
    assert not bad, f"{len(bad)} failures:\n" + "\n".join(bad[:30])


def _empty_mask(rank: int, world: int) -> list[str]:
    """An empty mask (`mask=[]`, `SliceMask([], S)`): no row sees a key, so every output is 0
    and no gradient flows, on every grid and schedule."""
    bad = []
    for index, (a, r, c) in enumerate(grid_shapes(world)):
        grid = mm.MeshGrid.build(rows=r, cols=c, heads=a)
        for n, mask in enumerate(([], mm.SliceMask([], LOCAL * world))):
            x = {n: torch.randn(LOCAL, 1, h, 8, requires_grad=True)
                 for n, h in (("q", Q_HEADS), ("k", 2), ("v", 2))}
            out = mm.mesh_attention(x["q"], x["k"], x["v"], grid, mask=mask,
                                    schedule=SCHEDULES[(index + n) % 3])
            out.backward(torch.randn_like(out))
            sums = [float(t.abs().sum()) for t in (out, *(x[n].grad for n in "qkv"))]
            if any(sums):
                bad.append(f"empty mask {mask!r} grid {grid.shape_text} rank {rank}: |out|, "
                           f"|dq|, |dk|, |dv| = {sums} (want zeros)")
    return bad


@pytest.mark.parametrize("cp_size", [2, 4])
def test_an_empty_mask_gives_zeros_and_no_gradient(cp_size: int) -> None:
    bad = [b for rank_bad in run_distributed(_empty_mask, cp_size) for b in rank_bad]
    assert not bad, "\n".join(bad[:20])
