"""FlexAttention's tile kernel (`kernels/flex.py`), on the CPU eagerly (and compiled on a
GPU, `gpu` tests): a call's slices (documents, a band, any slices), plain and bottom-right
causal calls and a whole tile's mask, forward (out and lse) and backward given the WHOLE
row's out and lse (the keys cut in two calls whose results merge and whose gradients add
up), against an fp64 formula with the mask built here from its definition; GQA and V of
its own head dim. Its mask is kept by its edges, not its area; 'flex' is chosen by name
only, and the call model counts one call a group for it."""
from __future__ import annotations

import pytest
import torch
from torch.nn.attention import flex_attention as flex_api

import megatron_mesh as mm
from megatron_mesh.calls.band_blocks import BATCH, Pieces
from megatron_mesh.calls.layout import AttentionMask
from megatron_mesh.calls.needed_rows import needed_rows
from megatron_mesh.calls.tile_slices import TileSlices
from megatron_mesh.common.merge import empty_accumulators, merge_into
from megatron_mesh.cost_models.memory import FLEX_BLOCK, FLEX_BUILD_BATCH, _Chunk
from megatron_mesh.cost_models.tile_calls import (
    CallShape,
    backward_calls,
    call_shapes,
    forward_calls,
)
from megatron_mesh.kernels import (
    BACKENDS,
    WINDOWS,
    DeviceFacts,
    FlexTileKernel,
    backend_for,
    choose,
    flex,
    get_kernel,
)
from megatron_mesh.kernels.flex import BLOCK, TileMask
from megatron_mesh.layer_plan import GradDtype
from megatron_mesh.masks.window import Window
from megatron_mesh.planner import Workload
from megatron_mesh.planner.pricing.tiles import mesh_calls
from megatron_mesh.runtime.peak_memory import CpuPeakMemory
from megatron_mesh.schedules import whole_tile
from megatron_mesh.schedules.kept_rows import KeptRows
from megatron_mesh.schedules.whole_tile import tile_mask

from reference import seen_of_slices

SQ, SK, B, HQ, HKV, D = 40, 56, 2, 4, 2, 16


def definition(kind: str) -> torch.Tensor:
    """[SQ, SK] bool: query i sees key j, from each kind's definition."""
    i, j = torch.arange(SQ)[:, None], torch.arange(SK)[None, :]
    if kind == "full":
        return torch.ones(SQ, SK, dtype=torch.bool)
    if kind == "causal":  # bottom-right aligned: j <= i + SK - SQ
        return j <= i + SK - SQ
    if kind == "band":  # a window of 5 back, 2 ahead, bottom-right aligned
        return (j - i - (SK - SQ) >= -5) & (j - i - (SK - SQ) <= 2)
    if kind == "documents":  # query rows 0-15 / 15-40 against key rows 0-20 / 20-56, causal
        first = (i < 15) & (j < 20) & (j - i <= 20 - 15)
        return first | ((i >= 15) & (j >= 20) & (j - i <= SK - SQ))
    # slices: rows 0-10 see keys 30-40; rows 10-40 see keys 0-25 with j - i in [-12, 3]
    return ((i < 10) & (j >= 30) & (j < 40)) | ((i >= 10) & (j < 25) & (j - i >= -12)
                                                & (j - i <= 3))


def slices_of(kind: str) -> TileSlices | None:
    if kind == "band":
        return TileSlices.band(SQ, SK, 5, 2)
    if kind == "documents":
        return TileSlices.documents((0, 15, SQ), (0, 20, SK), True, torch.device("cpu"))
    if kind == "slices":
        return TileSlices.of([(0, 10, 30, 40, None, None), (10, SQ, 0, 25, -12, 3)], (SQ, SK),
                             torch.device("cpu"))
    return None


def formula(x: dict, seen: torch.Tensor, scale: float) -> dict:
    """out [SQ, B, HQ, dv], lse [B, HQ, SQ], dq, dk, dv in fp64; rows that see nothing:
    out 0, lse -inf."""
    q, k, v = (x[n].double().requires_grad_() for n in "qkv")
    groups = q.shape[2] // k.shape[2]
    kk, vv = (t.repeat_interleave(groups, 2) for t in (k, v))
    scores = torch.einsum("ibhd,jbhd->bhij", q, kk) * scale
    scores = scores.masked_fill(~seen.to(q.device), float("-inf"))
    lse = torch.logsumexp(scores, -1)
    out = torch.einsum("bhij,jbhd->ibhd", torch.softmax(scores, -1).nan_to_num(), vv)
    out.backward(x["dout"].double())
    return {"out": out.detach(), "lse": lse.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def inputs(dv: int = D, device: str = "cpu", dtype: torch.dtype = torch.float32) -> dict:
    g = torch.Generator().manual_seed(5)
    shapes = {"q": (SQ, HQ, D), "k": (SK, HKV, D), "v": (SK, HKV, dv), "dout": (SQ, HQ, dv)}
    return {n: torch.randn(s, B, h, e, generator=g).to(device, dtype)
            for n, (s, h, e) in shapes.items()}


def in_two_calls(kernel, x: dict, causal: bool, scale: float, slices: TileSlices | None,
                 seen: torch.Tensor) -> dict:
    """The call as the schedules run a row: the whole call once (its out and lse are the
    row's), then its keys cut in two calls (first half, then the rest; `seen` [SQ, SK] its
    pairs) on the whole row's out and lse: merged outputs, summed gradients."""
    out, lse = kernel.forward(x["q"], x["k"], x["v"], causal, scale, slices=slices)
    got = {"out": out, "lse": lse}
    acc_out, acc_lse = empty_accumulators(SQ, B, HQ, x["v"].shape[-1], x["q"].device)
    grads = {n: torch.zeros(x[n].shape, dtype=torch.float32, device=x[n].device)
             for n in "qkv"}
    half = SK // 2
    for keys in (slice(0, half), slice(half, SK)):
        mask = TileMask.of(seen[:, keys].to(x["q"].device))  # from the definition
        k, v = x["k"][keys], x["v"][keys]
        o, o_lse = kernel.tile_forward(x["q"], k, v, mask, scale)
        merge_into(acc_out, acc_lse, o, o_lse)
        dq, dk, dv = kernel.tile_backward(x["dout"], x["q"], k, v, out, lse, mask, scale)
        grads["q"] += dq
        grads["k"][keys] += dk
        grads["v"][keys] += dv
    got.update(merged=acc_out, merged_lse=acc_lse, dq=grads["q"], dk=grads["k"],
               dv=grads["v"])
    # the whole call's own backward too
    got["whole"] = kernel.backward(x["dout"], x["q"], x["k"], x["v"], out, lse, causal, scale,
                                   slices=slices)
    return got


def check(got: dict, want: dict, tol: float) -> None:
    finite = torch.isfinite(want["lse"])
    assert torch.equal(torch.isfinite(got["lse"]), finite)
    assert (got["lse"].double() - want["lse"])[finite].abs().max() <= tol
    assert (got["merged_lse"].double() - want["lse"])[finite].abs().max() <= tol
    for name, value in (("out", got["out"]), ("merged", got["merged"])):
        err = (value.double() - want["out"]).abs().max().item()
        assert err <= tol, f"{name}: {err:.3g}"
    for n in ("dq", "dk", "dv"):
        err = (got[n].double() - want[n]).abs().max().item()
        assert err <= tol * max(1.0, want[n].abs().max().item()), f"{n}: {err:.3g}"
    for n, g in zip(("dq", "dk", "dv"), got["whole"]):
        err = (g.double() - want[n]).abs().max().item()
        assert err <= tol * max(1.0, want[n].abs().max().item()), f"whole {n}: {err:.3g}"


@pytest.mark.parametrize("kind", ["full", "causal", "band", "documents", "slices"])
def test_flex_calls_match_the_formula(kind: str) -> None:
    """Each kind of call on the CPU (eager), GQA, dv != d for the slices: forward, and the
    backward of the call and of its keys in two calls on the whole row's out and lse."""
    x = inputs(dv=8 if kind == "slices" else D)
    seen = definition(kind)
    got = in_two_calls(FlexTileKernel(), x, kind == "causal", 0.3, slices_of(kind), seen)
    check(got, formula(x, seen, 0.3), 1e-5)


def test_tile_mask_keeps_edges_not_area() -> None:
    """A causal tile of 1024 x 2048 keeps 8 partial blocks (its diagonal's) of 128 x 128,
    whatever its area; its pairs read back as given, with rows that see nothing (their
    block row's full blocks become partial ones)."""
    seen = torch.ones(1024, 2048, dtype=torch.bool).tril(1024)
    mask = TileMask.of(seen)
    assert mask.kinds.shape == (8, 16) and int((mask.kinds >= 2).sum()) == 8
    assert mask.partial.shape == (16, BLOCK, BLOCK)  # 2 + 8 kept, in a power of two
    assert torch.equal(mask.seen(), seen) and not mask.empty
    seen[100:120] = False
    mask = TileMask.of(seen)
    assert int((mask.kinds >= 2).sum()) == 16 and mask.partial.shape == (32, BLOCK, BLOCK)
    assert torch.equal(mask.seen(), seen)
    odd = torch.rand(130, 70, generator=torch.Generator().manual_seed(1)) < 0.5
    assert torch.equal(TileMask.of(odd).seen(), odd)
    assert TileMask.of(torch.zeros(5, 300, dtype=torch.bool)).empty


def test_a_tile_mask_made_from_pieces_is_the_whole_masks() -> None:
    """Band pieces over a 700 x 900 tile (a causal square, a window, full rectangles that
    meet inside a block and fill it together, one overlapping another, one off the block
    grid) cut into blocks from their bounds (`of_pieces`) are the mask of the definition
    built here (`of`): the same kinds, partial blocks numbered alike; 100 random slices of
    random calls likewise (`of_slices`); a piece outside the tile is refused."""
    rects = [(0, 256, 0, 256, -300, 0), (256, 700, 100, 900, -40, 30),
             (0, 200, 300, 450, -999, 999), (0, 200, 450, 600, -999, 999),
             (100, 150, 350, 500, -999, 999), (601, 653, 5, 77, -999, 999)]
    i, j = torch.arange(700)[:, None], torch.arange(900)[None, :]
    whole = torch.zeros(700, 900, dtype=torch.bool)
    for q0, q1, k0, k1, lo, hi in rects:
        whole |= (i >= q0) & (i < q1) & (j >= k0) & (j < k1) & (j - i >= lo) & (j - i <= hi)
    pieces = Pieces(*torch.tensor(rects).T)
    made, want = TileMask.of_pieces((700, 900), pieces, torch.device("cpu")), TileMask.of(whole)
    assert torch.equal(made.kinds, want.kinds) and torch.equal(made.partial, want.partial)
    assert made.kinds[0, 3] == 1  # rows 0..127 x keys 384..511: two pieces fill it
    g = torch.Generator().manual_seed(3)
    for _ in range(100):
        sq, sk = (int(n) for n in torch.randint(1, 400, (2,), generator=g))
        slices = []
        for _ in range(int(torch.randint(1, 5, (1,), generator=g))):
            q0, q1 = sorted(int(n) for n in torch.randint(0, sq + 1, (2,), generator=g))
            k0, k1 = sorted(int(n) for n in torch.randint(0, sk + 1, (2,), generator=g))
            lo, hi = (None if int(b) < 0 else int(b) - 300
                      for b in torch.randint(-100, 600, (2,), generator=g))
            slices.append((q0, max(q1, q0 + 1), k0, max(k1, k0 + 1), lo, hi))
        slices = [s for s in slices if s[1] <= sq and s[3] <= sk]
        call = TileSlices((sq, sk), tuple(slices), "slices")
        made = TileMask.of_slices(call, (sq, sk), False, torch.device("cpu"))
        want = TileMask.of(seen_of_slices(slices, (sq, sk)))
        assert torch.equal(made.kinds, want.kinds) and torch.equal(made.partial, want.partial)
    with pytest.raises(ValueError, match=r"piece 1 \(rows 256..700, keys 100..900\) is "
                       "outside the tile 700 x 800"):
        TileMask.of_pieces((700, 800), pieces, torch.device("cpu"))


def zigzag_positions(rank: int, ranks: int, local: int) -> torch.Tensor:
    """The global positions of a rank's zigzag share: halves rank and 2 ranks - 1 - rank."""
    h = local // 2
    return torch.cat([torch.arange(h * rank, h * (rank + 1)),
                      torch.arange(h * (2 * ranks - 1 - rank), h * (2 * ranks - rank))])


def held(kept: KeptRows | None, local: int) -> torch.Tensor:
    return torch.arange(local) if kept is None else torch.tensor(kept.kept, dtype=torch.int64)


@pytest.mark.parametrize("local,left", [(300, None), (300, 70), (256, 100)])
def test_a_whole_tiles_mask_is_the_definitions(local, left) -> None:
    """Query chunks (1, 2) against key chunks (0, 1, 3) of 4 ranks' zigzag shares, causal
    (and a window of `left` keys), block (2, 3) left out, chunks of 300 rows (not whole
    128-row blocks) or 256: whole, or some held packed (random rows kept: many runs and
    gaps, `KeptRows`): `tile_mask` is `TileMask.of` the mask of the definition on the held
    rows' positions, built here (same kinds, partial blocks numbered alike); made on meta
    tensors (CUDA's placement) its blocks lie there, as many."""
    mask = AttentionMask(True, ranks=4, window=None if left is None else Window(left, 0))
    g = torch.Generator().manual_seed(local + (left or 0))
    xs, ys, cpu = (1, 2), (0, 1, 3), torch.device("cpu")

    def some_rows() -> KeptRows:
        return KeptRows(tuple((torch.rand(local, generator=g) < 0.7).nonzero().flatten()
                              .tolist()), local)

    for q_kept, kv_kept in ((None, None), ([None, some_rows()], [some_rows(), None,
                                                                  some_rows()])):
        made = tile_mask(mask, xs, ys, local, cpu, {(2, 3)}, q_kept, kv_kept)
        q_rows = [held(None if q_kept is None else q_kept[n], local) for n in range(2)]
        kv_rows = [held(None if kv_kept is None else kv_kept[n], local) for n in range(3)]
        qp = torch.cat([zigzag_positions(x, 4, local)[r] for x, r in zip(xs, q_rows)])
        kp = torch.cat([zigzag_positions(y, 4, local)[r] for y, r in zip(ys, kv_rows)])
        qc = torch.cat([torch.full((len(r),), x) for x, r in zip(xs, q_rows)])
        kc = torch.cat([torch.full((len(r),), y) for y, r in zip(ys, kv_rows)])
        seen = kp[None, :] <= qp[:, None]
        if left is not None:
            seen &= qp[:, None] - kp[None, :] <= left
        seen &= ~((qc[:, None] == 2) & (kc[None, :] == 3))
        want = TileMask.of(seen)
        assert torch.equal(made.kinds, want.kinds) and torch.equal(made.partial, want.partial)
        meta = torch.device("meta")  # CUDA's placement: the blocks made on the tensors' device
        on_meta = tile_mask(mask, xs, ys, local, meta, {(2, 3)}, q_kept, kv_kept)
        assert on_meta.kinds.device == on_meta.partial.device == meta
        assert on_meta.partial.shape == made.partial.shape


def test_a_whole_tiles_mask_is_made_without_a_mask_of_its_size() -> None:
    """A causal tile of 4000-row chunks (query chunks 2, 3 against all 4: 8000 x 16000
    pairs, not whole 128-row blocks) and a window's packed tile (rank 0 of a 2 x 2 mesh,
    4096-row chunks, a window of 7000: a peer's rows kept as the sparse exchange keeps
    them): while `tile_mask` makes it (the blocks' calls made before), the CPU tensors it
    holds never exceed the mask's own bytes (kinds, partial blocks) by more than 2 MiB, far
    below a bool of its rows x keys."""
    cpu = torch.device("cpu")
    window = AttentionMask(True, ranks=4, window=Window(7000, 0))
    kept = KeptRows(needed_rows(window, 2, 2, 4096, 0, 2, "kv"), 4096)
    assert 0 < len(kept) < 4096
    for args in ((AttentionMask(True, ranks=4), (2, 3), (0, 1, 2, 3), 4000, cpu),
                 (window, (0, 1), (0, 2), 4096, cpu, (), None, [None, kept])):
        tile_mask(*args)  # the blocks' calls, made and kept
        whole_tile._tile_mask.cache_clear()
        with CpuPeakMemory() as mem:
            made = tile_mask(*args)
        sq, sk = made.shape
        own = made.kinds.untyped_storage().nbytes() + made.partial.untyped_storage().nbytes()
        assert mem.peak_bytes <= own + (2 << 20) and mem.peak_bytes < sq * sk / 4, (
            f"{sq} x {sk}: held {mem.peak_bytes} B making a mask of {own} B")


def block_sparse_reading(block_mask: flex_api.BlockMask, shape: tuple[int, int]
                         ) -> tuple[torch.Tensor, ...]:
    """What a block-sparse kernel (CUDA's compiled FlexAttention) computes from `block_mask`,
    read here from its block lists: each listed partial block through its mask_mod, each
    listed full block whole, nothing else; forward by the kv blocks of each q block,
    backward by the q blocks of each kv block -> (forward pairs, backward pairs) bool
    [sq, sk], and how often each pass lists each block (partial and full lists together)
    int64 [q blocks, kv blocks] twice. The CPU's eager ops read the mask_mod alone, so the
    exactness tests do not see these lists."""
    sq, sk = shape
    bm = block_mask
    nq, nk = -(-sq // BLOCK), -(-sk // BLOCK)

    def listed(count: torch.Tensor, index: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        taken = torch.arange(cols)[None, :] < count[0, 0, :, None].long()  # [rows, cols]
        hits = torch.zeros(rows, cols, dtype=torch.int64)
        return hits.scatter_add_(1, index[0, 0].long(), taken.long())

    i, j = torch.arange(nq * BLOCK)[:, None], torch.arange(nk * BLOCK)[None, :]
    pairs = bm.mask_mod(torch.tensor(0), torch.tensor(0), i, j).view(nq, BLOCK, nk, BLOCK)

    def reading(partial: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        got = (pairs & (partial > 0)[:, None, :, None]) | (full > 0)[:, None, :, None]
        return got.reshape(nq * BLOCK, nk * BLOCK)[:sq, :sk]

    fwd = (listed(bm.kv_num_blocks, bm.kv_indices, nq, nk),
           listed(bm.full_kv_num_blocks, bm.full_kv_indices, nq, nk))
    bwd = (listed(bm.q_num_blocks, bm.q_indices, nk, nq).T,
           listed(bm.full_q_num_blocks, bm.full_q_indices, nk, nq).T)
    return reading(*fwd), reading(*bwd), sum(fwd), sum(bwd)


def test_the_block_lists_cuda_reads_are_the_masks_pairs() -> None:
    """The BlockMask's lists of partial and full blocks (what CUDA's block-sparse kernels
    visit, forward by kv blocks and backward by q blocks; the CPU's eager ops never read
    them) give exactly the mask's pairs, each block that keeps a pair listed once a pass (a
    block both partial and full would be added twice): masks of the definition (`of`), of random
    slices (`of_slices`), and whole tiles with packed chunks (`tile_mask`)."""
    g = torch.Generator().manual_seed(7)
    masks = []
    for sq, sk in ((127, 129), (256, 384), (300, 1000), (129, 128)):
        seen = torch.rand(sq, sk, generator=g) < 0.5
        seen[:, :BLOCK // 2] = True  # some full blocks, some empty ones
        seen[sq // 2:, sk // 2:] = False
        masks.append(TileMask.of(seen))
        masks.append(TileMask.of(torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)))
    masks.append(TileMask.of_slices(TileSlices((700, 900), ((0, 256, 0, 256, None, 0),
                                                            (256, 700, 100, 900, -40, 30),
                                                            (0, 200, 300, 600, None, None)),
                                               "slices"), (700, 900), False, torch.device("cpu")))
    window = AttentionMask(True, ranks=4, window=Window(70, 0))
    kept = KeptRows(tuple(range(0, 300, 3)), 300)
    masks.append(tile_mask(window, (1, 2), (0, 1, 3), 300, torch.device("cpu"), {(2, 3)},
                           [None, kept], [kept, None, None]))
    for mask in masks:
        forward, backward, *listed = block_sparse_reading(mask.block_mask("cpu"), mask.shape)
        seen = mask.seen()
        assert torch.equal(forward, seen) and torch.equal(backward, seen), mask.shape
        for times in listed:  # every block that keeps a pair, once a pass
            assert torch.equal(times, (mask.kinds != 0).long()), mask.shape


def test_a_mask_of_other_rows_is_refused() -> None:
    """A call whose mask (or slices) is not of its q rows x k rows is refused, naming both,
    forward and backward: fewer rows would read the mask's first rows (wrong pairs, no
    error), more would index past its blocks."""
    x = inputs()
    kernel, seen = FlexTileKernel(), definition("band")
    out, lse = kernel.forward(x["q"], x["k"], x["v"], False, 0.3, slices=slices_of("band"))
    for rows in (SQ - 10, SQ + 200):
        q = torch.randn(rows, B, HQ, D)
        with pytest.raises(ValueError, match=f"mask is of {SQ} x {SK} .* q has {rows} rows"):
            kernel.forward(q, x["k"], x["v"], False, 0.3, slices=slices_of("band"))
        with pytest.raises(ValueError, match=f"mask is of {SQ} x {SK} .* q has {rows} rows"):
            kernel.tile_forward(q, x["k"], x["v"], TileMask.of(seen), 0.3)
    with pytest.raises(ValueError, match=f"mask is of {SQ} x {SK - 8} .* k {SK}"):
        kernel.tile_backward(x["dout"], x["q"], x["k"], x["v"], out, lse,
                             TileMask.of(seen[:, 8:]), 0.3)


def test_flex_is_chosen_by_name_only() -> None:
    """backend='flex' builds the FlexAttention kernel (it takes windows, documents, V's own
    head dim); 'auto' and 'torch' never choose it, on the CPU or for CUDA's calls."""
    assert "flex" in BACKENDS
    kernel = get_kernel("flex", "cpu", torch.float32, 64, documents=True, v_head_dim=32)
    assert isinstance(kernel, FlexTileKernel) and kernel.caps.whole_tile
    assert backend_for("flex", WINDOWS) == "flex"
    for facts in (DeviceFacts("cpu"), DeviceFacts("meta"),
                  DeviceFacts("cuda", (9, 0), 90100, True, None)):
        for backend in ("auto", "torch"):
            assert "flex" not in choose(backend, facts, torch.bfloat16, 128).ops
        assert choose("flex", facts, torch.bfloat16, 128).ops == ("flex",)


def test_the_cuda_backward_call_fits_the_op_on_meta() -> None:
    """What CUDA compiles for the backward (`flex._backward_op`: the backward op on the
    whole row's out and lse, the tile's block mask) run as it is on meta tensors: the op
    takes its arguments and gives dq, dk, dv the inputs' shapes (GQA, V's own head dim) in
    the inputs' dtype (the public `flex_attention` refuses meta tensors: its forward is
    checked on a GPU only)."""
    meta = torch.device("meta")
    mask = TileMask.of(torch.ones(200, 300, dtype=torch.bool).tril(100))
    q, k, v, out = (torch.empty(s, 2, h, e, device=meta, dtype=torch.bfloat16)
                    for s, h, e in ((200, 4, 64), (300, 2, 64), (300, 2, 32), (200, 4, 32)))
    lse = torch.empty(2, 4, 200, device=meta)
    qb, kb, vb, ob = (t.permute(1, 2, 0, 3) for t in (q, k, v, out))
    options = flex_api._apply_kernel_options(qb, kb, vb, True, None)
    grads = flex._backward_op(qb, kb, vb, ob, lse, ob, None, mask.block_mask(meta).as_tuple(),
                              0.1, options)
    assert [tuple(g.shape) for g in grads] == [(2, 4, 200, 64), (2, 2, 300, 64), (2, 2, 300, 32)]
    assert all(g.dtype == torch.bfloat16 and g.device == meta for g in grads)


@pytest.mark.parametrize("schedule,rows,cols,forward,backward", [
    # P x 1 (a row of one rank runs the gathered code): forward the query chunk against the
    # whole column, diagonal included (1 call); backward the diagonal alone while the
    # column's K/V arrive, then the other blocks (2)
    ("streamed_q", 4, 1, 1, 2),
    # 2 x 2 gathered: the whole tile, the row's query chunks against the column (1);
    # backward the diagonal, then the tile but the diagonal (2)
    ("gathered", 2, 2, 1, 2),
    # 1 x 4 gathered: the row's four query chunks against the one K/V chunk (1); backward
    # the diagonal, then the three others (2)
    ("gathered", 1, 4, 1, 2),
])
def test_the_model_counts_one_call_a_group(schedule, rows, cols, forward, backward) -> None:
    """A kernel taking whole tiles: one call a group on hand, causal or not, grouped or not,
    never more than the grouped calls; each call's chunks whole."""
    for causal in (True, False):
        for grouped in (True, False):
            kw = dict(whole_tile=True, grouped=grouped, chunk_tokens=2048, cap_tokens=1024)
            assert forward_calls(rows, cols, causal, schedule, **kw) == forward
            assert backward_calls(rows, cols, causal, schedule, **kw) == backward
        assert forward_calls(rows, cols, causal, schedule, whole_tile=True) <= forward_calls(
            rows, cols, causal, schedule)
    shapes = call_shapes(rows, cols, True, schedule, "forward", whole_tile=True)
    assert all(set(s.q) == {2} and set(s.kv) == {2} for s in shapes)
    # the planner prices backend='flex' by the same count
    workload = Workload(seq_length=8192, num_heads=8, num_kv_heads=8, head_dim=64,
                        dtype="bf16", mesh_schedule=schedule)
    got = mesh_calls(workload, rows * cols, rows, cols, backend="flex")
    assert (got.forward, got.backward) == (forward, backward)


@pytest.mark.parametrize("xs,ys", [((1,), (0, 1, 3)), ((2,), (0, 3)), ((0, 2), (1,)),
                                   ((3,), (0, 1, 2, 3))])
def test_the_memory_model_counts_a_whole_tile_masks_bytes(xs, ys) -> None:
    """A whole-tile call's mask on 4 ranks of 256-token chunks, causal (`TileMask` and the
    BlockMask made of it): its storages hold the bytes `memory.py` counts for the call, and
    the CPU tensors held while it is made (the blocks' calls made before) are within 10% of
    what it counts for the making."""
    s, cpu = 256, torch.device("cpu")
    mask = AttentionMask(True, ranks=4)
    tile_mask(mask, xs, ys, s, cpu)  # the blocks' calls, made and kept
    whole_tile._tile_mask.cache_clear()
    with CpuPeakMemory() as mem:
        made = tile_mask(mask, xs, ys, s, cpu)
    tensors = [made.kinds, made.partial,
               *(t for t in made.block_mask(cpu).as_tuple() if isinstance(t, torch.Tensor))]
    held = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors}.values())
    chunk = _Chunk.of(mm.AttentionShape(4 * s, 1, 8, 2, 32, 4), 4, GradDtype.MIXED)
    call = CallShape((2,) * len(xs), (2,) * len(ys), diagonal=bool(set(xs) & set(ys)))
    assert FLEX_BLOCK == BLOCK and FLEX_BUILD_BATCH == BATCH and chunk.tile_mask(call) == held
    assert 0.9 <= mem.peak_bytes / chunk.tile_mask_build(call) <= 1.1, (
        f"made holding {mem.peak_bytes} B, the model counts {chunk.tile_mask_build(call)} B")


def test_the_memory_model_bounds_a_mask_of_chunks_not_whole_blocks() -> None:
    """Chunks of 300 and 2100 tokens (halves not whole 128-row blocks), causal, the calls of
    4 ranks' tiles: the mask's storages hold no more than `memory.py` counts for the call,
    and at least a quarter of it (a bound, rounded up to a power of two like the mask: not
    every block counted partial)."""
    cpu = torch.device("cpu")
    mask = AttentionMask(True, ranks=4)
    for s in (300, 2100):
        chunk = _Chunk.of(mm.AttentionShape(4 * s, 1, 8, 2, 32, 4), 4, GradDtype.MIXED)
        for xs, ys in (((1,), (0, 1, 3)), ((2,), (0, 3)), ((0, 2), (1,)), ((3,), (0, 1, 2, 3))):
            made = tile_mask(mask, xs, ys, s, cpu)
            held = sum(t.untyped_storage().nbytes() for t in (made.kinds, made.partial))
            call = CallShape((2,) * len(xs), (2,) * len(ys), diagonal=bool(set(xs) & set(ys)))
            counted = chunk.tile_mask(call) - 16 * made.kinds.numel() - 8 * sum(
                made.kinds.shape)  # the BlockMask's indices aside
            assert held <= counted <= 4 * held, (s, xs, ys, held, counted)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["causal", "documents", "slices"])
def test_gpu_flex_compiled_matches_the_formula(kind: str, dtype: torch.dtype) -> None:
    """On CUDA (compiled FlexAttention, forward and the backward op on the whole row's out
    and lse): the same calls against the fp64 formula; bf16 within a few of its ulps."""
    x = inputs(dv=8 if kind == "slices" else D, device="cuda", dtype=dtype)
    seen = definition(kind)
    got = in_two_calls(FlexTileKernel(), x, kind == "causal", 0.3, slices_of(kind), seen)
    tol = 1e-4 if dtype == torch.float32 else 0.05
    check(got, formula(x, seen, 0.3), tol)


@pytest.mark.gpu
def test_gpu_flex_two_masks_of_one_shape_in_a_row() -> None:
    """On CUDA, one kernel given two different masks of the same shape one after the other
    (a compiled kernel must not keep the first's blocks), then the first again: each equals
    the fp64 formula of its own definition, rows that see nothing included."""
    x = inputs(device="cuda", dtype=torch.float32)
    kernel = FlexTileKernel()
    for kind in ("documents", "slices", "documents"):
        seen = definition(kind)
        got = in_two_calls(kernel, x, False, 0.3, slices_of(kind), seen)
        check(got, formula(x, seen, 0.3), 1e-4)
