"""A call's slices as runs (`calls/tile_runs.py`, `kernels/run_calls.py`) on torch's CPU
kernel, against an fp64 formula on the whole call with the mask built here from the slices'
definition (query i sees key j iff q0 <= i < q1, k0 <= j < k1 and lo <= j - i <= hi for some
slice), forward and backward: documents (full, causal, more keys than queries), windows,
prefix-LM calls, random slices, several runs on one row; batch 2, GQA, V of its own head dim.
No call makes a mask of the call's size: the only additive masks the CPU op gets are a
window block's (or a short window call's own, at most `SMALL_BIAS_BYTES`)."""
from __future__ import annotations

import random

import pytest
import torch
from attention_ops import AttentionOps

from megatron_mesh.calls.tile_runs import runs_of
from megatron_mesh.calls.tile_slices import TileSlices
from megatron_mesh.kernels.cudnn import CudnnKernel
from megatron_mesh.kernels.run_calls import BAND_ROWS, SMALL_BIAS_BYTES
from megatron_mesh.kernels.te_runs import fit_runs
from megatron_mesh.kernels.torch_flash import TorchFlashKernel
from megatron_mesh.kernels.varlen_runs import packs_of, varlen_runs_backward, varlen_runs_forward

from reference import fp64_masked_attention, seen_of_slices

SCALE = 0.3


def random_slices(rng: random.Random, sq: int, sk: int, count: int) -> list[tuple]:
    """Up to `count` rectangles that do not meet, each full, causal at its bottom right, or
    a window."""
    out: list[tuple] = []
    for _ in range(count * 4):
        q0, k0 = rng.randrange(sq), rng.randrange(sk)
        q1, k1 = rng.randint(q0 + 1, sq), rng.randint(k0 + 1, sk)
        if any(a < q1 and q0 < b and c < k1 and k0 < e for a, b, c, e, *_ in out):
            continue
        kind = rng.choice(("full", "causal", "window"))
        lo = hi = None
        if kind == "causal":
            hi = k1 - q1
        elif kind == "window":
            hi = k1 - q1 + rng.randint(-2, 3)
            lo = hi - rng.randint(0, 9)
        out.append((q0, q1, k0, k1, lo, hi))
        if len(out) == count:
            break
    return out


def documents(lengths, causal: bool, extra_keys=(), device=torch.device("cpu")) -> TileSlices:
    cu_q, cu_kv = [0], [0]
    for n, length in enumerate(lengths):
        cu_q.append(cu_q[-1] + length)
        cu_kv.append(cu_kv[-1] + length + (extra_keys[n] if extra_keys else 0))
    return TileSlices.documents(tuple(cu_q), tuple(cu_kv), causal, device)


def cases(device: torch.device = torch.device("cpu")) -> dict[str, TileSlices]:
    rng = random.Random(0)
    out = {
        "documents causal": documents((3, 1, 7, 12, 5, 2), True, device=device),
        "documents full": documents((3, 1, 7, 12, 5, 2), False, device=device),
        "documents causal, more keys": documents((3, 1, 7, 12), True, (2, 0, 5, 1), device),
        "window (4, 0)": TileSlices.band(30, 30, 4, 0),
        "window (3, 2), more keys": TileSlices.band(20, 29, 3, 2),
        "window (-1, 3)": TileSlices.band(20, 24, -1, 3),
        "window (2, -1)": TileSlices.band(20, 24, 2, -1),
        "causal, more keys": TileSlices.band(9, 30, -1, 0),
        "long window rows": TileSlices.band(BAND_ROWS + 70, BAND_ROWS + 75, 5, 1),
        "long window, row blocks": TileSlices.band(4 * BAND_ROWS + 70, 4 * BAND_ROWS + 75, 5, 1),
        "prefix-LM": TileSlices.of([(0, 30, 0, 11, None, None), (11, 30, 11, 30, None, 0)],
                                   (30, 30), device),
        "windows in documents": TileSlices.of(
            [(0, 10, 0, 10, -3, 0), (10, 25, 10, 25, -4, 0)], (25, 25), device),
        "wide window (150, 20), more keys": TileSlices.band(560, 570, 150, 20),
        "wide window (-1, 140)": TileSlices.band(520, 520, -1, 140),
        "wide window (140, -1)": TileSlices.band(520, 530, 140, -1),
        "wide windows in documents": TileSlices.of(
            [(0, 300, 0, 300, -140, 0), (300, 560, 300, 560, -130, 3)], (560, 560), device),
        "equal documents": documents((16,) * 8, True, device=device),
        "equal documents apart": documents((5, 9, 5, 9, 5, 3), False, device=device),
        "equal documents, more keys": documents((4, 4, 4), True, (2, 2, 2), device),
        "two causal on a row": TileSlices.of(
            [(0, 10, 0, 10, None, 0), (0, 10, 12, 20, None, 10), (4, 10, 20, 22, None, None)],
            (10, 22), device),
        # a band whose rows another slice cuts where its lower bound binds for none of them:
        # there it is a causal piece over its first rows and a full one below
        "band cut by another slice's rows": TileSlices.of(
            [(1, 16, 6, 10, -8, 1), (0, 15, 0, 5, None, None)], (20, 10), device),
        "window cut by another slice's rows": TileSlices.of(  # a 4-rank block's call
            [(0, 12, 1, 6, -8, 1), (10, 12, 0, 1, None, None)], (12, 6), device),
    }
    for n in range(6):
        sq, sk = rng.randint(8, 40), rng.randint(8, 40)
        found = random_slices(rng, sq, sk, rng.randint(1, 6))
        out[f"random {n}"] = TileSlices.of(found, (sq, sk), device)
    return out


CASES = cases()
# calls over 2^18 pairs (a window's bias over `SMALL_BIAS_BYTES`: its row blocks): two layouts
# (batch 1, where equal calls are batched, and batch 2), and no varlen emulation
LARGE = {name for name, s in CASES.items() if s.shape[0] * s.shape[1] * 4 > SMALL_BIAS_BYTES}
LAYOUTS = [(1, (4, 4), 8), (2, (4, 2), 8), (1, (2, 1), 12)]


@pytest.mark.parametrize("batch, heads, dv, name", [
    pytest.param(*layout, name, id=f"{layout[0]}-heads{n}-{layout[2]}-{name}")
    for n, layout in enumerate(LAYOUTS) for name in CASES
    if name not in LARGE or layout != LAYOUTS[0]])
def test_runs_are_exact(batch, heads, dv, name):
    slices = CASES[name]
    sq, sk = slices.shape
    torch.manual_seed(sq * sk + batch + dv)
    q = torch.randn(sq, batch, heads[0], 8)
    k = torch.randn(sk, batch, heads[1], 8)
    v = torch.randn(sk, batch, heads[1], dv)
    dout = torch.randn(sq, batch, heads[0], dv)
    seen = seen_of_slices(slices.slices, slices.shape)
    want = fp64_masked_attention(q, k, v, dout, seen, SCALE)
    kernel = TorchFlashKernel()
    with AttentionOps() as ops:
        out, lse = kernel.forward(q, k, v, False, SCALE, slices=slices)
        grads = kernel.backward(dout, q, k, v, out, lse, False, SCALE, slices=slices)
    for got, ref, what in zip((out, lse, *grads), want, ("out", "lse", "dq", "dk", "dv")):
        assert got.shape == ref.shape, what
        assert torch.allclose(got.double(), ref, atol=2e-5, rtol=1e-5), (
            what, (got.double() - ref).abs().nan_to_num(0).max())
    band = any(r.rule == "window" for r in slices.runs)
    small = SMALL_BIAS_BYTES // 4  # a short window call's own bias (`run_calls.one_block`)
    assert all(band and numel <= max(BAND_ROWS * sk, small) for numel in ops.masks)
    if not band:
        assert ops.masks == [], f"{name}: an additive mask reached the CPU op"


def test_documents_and_prefix_lm_are_runs_without_masks():
    """One run per document (their own keys only); a prefix-LM call is two runs: the prefix
    full against itself, the rest causal against all keys; a causal call of more keys than
    queries is one run."""
    docs = documents((3, 1, 7), True)
    assert [(r.q0, r.q1, r.keys, r.rule) for r in docs.runs] == [
        (0, 3, ((0, 3),), "causal"), (3, 4, ((3, 4),), "full"), (4, 11, ((4, 11),), "causal")]
    prefix = runs_of([(0, 30, 0, 11, None, None), (11, 30, 11, 30, None, 0)], (30, 30))
    assert [(r.q0, r.q1, r.keys, r.rule) for r in prefix] == [
        (0, 11, ((0, 11),), "full"), (11, 30, ((0, 30),), "causal")]
    assert [(r.keys, r.rule) for r in TileSlices.band(9, 30, -1, 0).runs] == [
        (((0, 30),), "causal")]


def _run_counts(runs, shape: tuple[int, int]) -> torch.Tensor:
    """int [sq, sk]: how many runs keep each (query, key) pair, each run read by its rule's
    definition on its concatenated keys (full; causal j <= i + sk - sq; window -left <=
    j - i - (sk - sq) <= right, -1 unbounded)."""
    counts = torch.zeros(shape, dtype=torch.int64)
    for run in runs:
        keys = torch.tensor([j for c, e in run.keys for j in range(c, e)], dtype=torch.int64)
        i = torch.arange(run.sq)[:, None]
        delta = torch.arange(run.sk)[None, :] - i - (run.sk - run.sq)
        keep = torch.ones(run.sq, run.sk, dtype=torch.bool)
        if run.rule == "causal":
            keep &= delta <= 0
        elif run.rule == "window":
            left, right = run.window
            keep &= (delta >= -left) if left >= 0 else keep
            keep &= (delta <= right) if right >= 0 else keep
        assert bool(keep.any(1).all()), run  # every row of a run sees a key
        counts[run.q0:run.q1].index_add_(1, keys, keep.long())
    return counts


def test_runs_keep_each_pair_of_random_slices_once():
    """The runs of random calls (up to five slices: full, causal, bands bounded on one side
    or both, one slice's rows cutting another's anywhere) keep each pair of the slices'
    definition exactly once and nothing else, and so do TE's cut runs (`fit_runs`)."""
    rng = random.Random(5)
    cut = 0
    for _ in range(400):
        sq, sk = rng.randint(1, 30), rng.randint(1, 30)
        found: list[tuple] = []
        for _ in range(20):
            q0, k0 = rng.randrange(sq), rng.randrange(sk)
            q1, k1 = rng.randint(q0 + 1, sq), rng.randint(k0 + 1, sk)
            bound = lambda: (None if rng.random() < 0.4  # noqa: E731
                             else rng.randint(k0 - q1 - 3, k1 - q0 + 3))
            lo, hi = bound(), bound()
            if lo is not None and hi is not None and lo > hi:
                lo, hi = hi, lo
            box = (q0, q1, k0, k1, lo, hi)
            if seen_of_slices([box], (sq, sk)).any() and not any(
                    a < q1 and q0 < b and c < k1 and k0 < e for a, b, c, e, *_ in found):
                found.append(box)
            if len(found) == 5:
                break
        if not found:
            continue
        slices = TileSlices.of(found, (sq, sk), torch.device("cpu"))
        want = seen_of_slices(slices.slices, slices.shape).long()
        assert torch.equal(_run_counts(slices.runs, (sq, sk)), want), (found, slices.runs)
        fitted = fit_runs(slices.runs)
        assert torch.equal(_run_counts(fitted, (sq, sk)), want), (found, fitted)
        cut += len(fitted) > len(slices.runs)
    assert cut >= 20, cut


META_KERNELS = {  # CUDA branch: (kernel, dtype, the ops a call's runs may dispatch)
    "flash": (TorchFlashKernel(flash=True), torch.bfloat16,
              {"_scaled_dot_product_flash_attention", "_flash_attention_forward",
               "_scaled_dot_product_flash_attention_backward", "_flash_attention_backward"}),
    "efficient": (TorchFlashKernel(flash=False), torch.float32,
                  {"_scaled_dot_product_efficient_attention",
                   "_scaled_dot_product_efficient_attention_backward"}),
    "cudnn": (CudnnKernel(), torch.bfloat16,
              {"_scaled_dot_product_cudnn_attention",
               "_scaled_dot_product_cudnn_attention_backward"}),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("branch", list(META_KERNELS))
def test_runs_on_cuda_branches_on_meta(branch, name):
    """Every CUDA branch takes every case's runs on meta tensors (the ops' schemas check the
    arguments): the shapes come back, only the branch's own ops run, and no additive mask
    reaches an op but a window block's (the flash op takes windows itself: none)."""
    kernel, dtype, allowed = META_KERNELS[branch]
    sq, sk = CASES[name].shape
    slices = cases(torch.device("meta"))[name]
    q = torch.empty(sq, 2, 4, 64, device="meta", dtype=dtype)
    k = torch.empty(sk, 2, 2, 64, device="meta", dtype=dtype)
    with AttentionOps() as ops:
        out, lse = kernel.forward(q, k, k, False, SCALE, slices=slices)
        dq, dk, dv = kernel.backward(out, q, k, k, out, lse, False, SCALE, slices=slices)
    assert (out.shape, lse.shape, dq.shape, dk.shape, dv.shape) == (
        q.shape, (2, 4, sq), q.shape, k.shape, k.shape)
    assert ops.names <= allowed, ops.names
    band = any(r.rule == "window" for r in slices.runs)
    if branch == "flash" or not band:
        assert ops.masks == [], ops.masks
    rows = max([BAND_ROWS, *(sum(r.window) + 1 for r in slices.runs if r.rule == "window")])
    small = SMALL_BIAS_BYTES // 4  # a short window call's own bias (`run_calls.one_block`)
    assert all(n <= 2 * 4 * max(rows * sk, small) for n in ops.masks)  # [b, h, rows, keys]


def emulated_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, window, scale):
    """A variable-length op from its definition, in fp64: sequence n is query rows
    cu_q[n]:cu_q[n+1] against key rows cu_k[n]:cu_k[n+1], `causal` or `window` aligned at
    the bottom right. out [tq, h, dv] in q's dtype, lse [h, tq] fp32."""
    outs, lses = [], []
    for n in range(len(cu_q) - 1):
        s, p = _sequence_probs(q, k, cu_q, cu_k, n, causal, window, scale)
        lse = torch.logsumexp(s, -1)
        vv = v[cu_k[n]:cu_k[n + 1]].double().repeat_interleave(q.shape[1] // k.shape[1], 1)
        outs.append(torch.einsum("hij,jhd->ihd", torch.exp(s - lse[..., None]), vv))
        lses.append(lse)
    return torch.cat(outs).to(q.dtype), torch.cat(lses, 1).float()


def emulated_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal,
                             window, scale):
    """Gradients of `emulated_varlen` with the rows' given (whole) out and lse."""
    groups = q.shape[1] // k.shape[1]
    dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float64) for t in (q, k, v))
    for n in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[n], cu_q[n + 1]), slice(cu_k[n], cu_k[n + 1])
        s, _ = _sequence_probs(q, k, cu_q, cu_k, n, causal, window, scale)
        p = torch.exp(s - lse[:, rows].double()[..., None])
        kk, vv = (t[keys].double().repeat_interleave(groups, 1) for t in (k, v))
        do, o = dout[rows].double(), out[rows].double()
        dp = torch.einsum("ihd,jhd->hij", do, vv)
        ds = p * (dp - (do * o).sum(-1).T[..., None])
        dq[rows] = torch.einsum("hij,jhd->ihd", ds, kk) * scale
        dk_full = torch.einsum("hij,ihd->jhd", ds, q[rows].double()) * scale
        dv_full = torch.einsum("hij,ihd->jhd", p, do)
        dk[keys] = dk_full.unflatten(1, (k.shape[1], groups)).sum(2)
        dv[keys] = dv_full.unflatten(1, (k.shape[1], groups)).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _sequence_probs(q, k, cu_q, cu_k, n, causal, window, scale):
    qs, ks = q[cu_q[n]:cu_q[n + 1]].double(), k[cu_k[n]:cu_k[n + 1]].double()
    ks = ks.repeat_interleave(q.shape[1] // k.shape[1], 1)
    s = torch.einsum("ihd,jhd->hij", qs, ks) * scale
    i, j = torch.arange(qs.shape[0])[:, None], torch.arange(ks.shape[0])[None, :]
    delta = j - i - (ks.shape[0] - qs.shape[0])
    keep = torch.ones_like(delta, dtype=torch.bool)
    if causal:
        keep &= delta <= 0
    if window is not None:
        keep &= (delta >= -window[0]) if window[0] >= 0 else keep
        keep &= (delta <= window[1]) if window[1] >= 0 else keep
    return s.masked_fill(~keep, float("-inf")), keep


@pytest.mark.parametrize("name", [name for name in CASES if name not in LARGE])
def test_runs_as_varlen_packs_are_exact(name):
    """The runs packed into variable-length calls (`varlen_runs`, what CUDA's flash op
    takes), on an op emulated from its definition: gathering each pack's rows, writing or
    merging its outputs back and adding its gradients into the rows read equal the fp64
    formula on the whole call, batch 2 and GQA, forward and backward."""
    slices = CASES[name]
    sq, sk = slices.shape
    torch.manual_seed(sq + sk)
    q, k, v = torch.randn(sq, 2, 4, 8), torch.randn(sk, 2, 2, 8), torch.randn(sk, 2, 2, 8)
    dout = torch.randn(sq, 2, 4, 8)
    want = fp64_masked_attention(q, k, v, dout, seen_of_slices(slices.slices, slices.shape),
                                 SCALE)
    packs = packs_of(slices.runs)
    tensors = [p.tensors(torch.device("cpu")) for p in packs]
    out, lse = varlen_runs_forward(q, k, v, SCALE, packs, tensors, emulated_varlen)
    grads = varlen_runs_backward(dout, q, k, v, out, lse, SCALE, packs, tensors,
                                 emulated_varlen_backward)
    for got, ref, what in zip((out, lse, *grads), want, ("out", "lse", "dq", "dk", "dv")):
        assert torch.allclose(got.double(), ref, atol=2e-5, rtol=1e-5), (
            what, (got.double() - ref).abs().nan_to_num(0).max())
    rules = {(p.causal, p.window) for p in packs}
    assert len(packs) <= len(rules) + 2  # one call per rule, more only where runs share rows


GPU_KERNELS = {  # the CUDA kernels that take a call's slices: (kernel, dtypes)
    "torch flash": (lambda: TorchFlashKernel(flash=True), (torch.bfloat16, torch.float32)),
    "cudnn": (lambda: CudnnKernel(), (torch.bfloat16,)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("kernel_name", list(GPU_KERNELS))
def test_runs_on_the_gpu_match_the_fp64_formula(kernel_name, name):
    """Every case's call on the GPU kernels that take slices (CUDA's flash op: documents
    varlen, other slices as packed varlen runs; fp32 on the memory-efficient op; cuDNN: runs
    on its op): out, lse, dq, dk, dv against the fp64 formula of the inputs as rounded, within
    the dtype's rounding (a wrong mask is off by O(1))."""
    make, dtypes = GPU_KERNELS[kernel_name]
    device = torch.device("cuda")
    slices = cases(device)[name]
    sq, sk = slices.shape
    seen = seen_of_slices(slices.slices, slices.shape).to(device)
    for dtype in dtypes:
        torch.manual_seed(sq * sk)
        q, k, v, dout = (torch.randn(s, 2, h, 64).to(dtype).to(device)
                         for s, h in ((sq, 4), (sk, 2), (sk, 2), (sq, 4)))
        want = fp64_masked_attention(q, k, v, dout, seen, SCALE)
        kernel = make()
        out, lse = kernel.forward(q, k, v, False, SCALE, slices=slices)
        grads = kernel.backward(dout, q, k, v, out, lse, False, SCALE, slices=slices)
        for got, ref, what in zip((out, lse, *grads), want, ("out", "lse", "dq", "dk", "dv")):
            assert got.shape == ref.shape, (kernel_name, name, dtype, what)
            tol = 1e-4 if dtype == torch.float32 else 0.05
            err = (got.double() - ref).abs().nan_to_num(0).max().item()
            assert err <= tol * max(1.0, ref.abs().nan_to_num(0).max().item()), (
                kernel_name, name, dtype, what, err)


@pytest.mark.parametrize("branch", ["cpu", "efficient", "cudnn"])
def test_wide_window_biases_are_block_sized(branch):
    """A window of 513 keys on an op without windows: each block of `BAND_ROWS` rows is the
    keys all its rows see (one full call) and two edge triangles; no bias is larger than
    [BAND_ROWS, 2 BAND_ROWS] (not [W, 2W]), forward and backward, and the edges of the inner
    blocks share one call each (their rows as batch entries)."""
    sq = 1024
    slices = TileSlices.band(sq, sq, 512, 0)
    kernel, dtype = (TorchFlashKernel(), torch.float32) if branch == "cpu" else \
        META_KERNELS[branch][:2]
    device = torch.device("cpu" if branch == "cpu" else "meta")
    q = torch.zeros(sq, 1, 2, 8 if branch == "cpu" else 64, dtype=dtype, device=device)
    with AttentionOps() as ops:
        out, lse = kernel.forward(q, q, q, False, SCALE, slices=slices)
        kernel.backward(out, q, q, q, out, lse, False, SCALE, slices=slices)
    assert ops.mask_layouts
    assert all(shape[-2] <= BAND_ROWS and shape[-1] <= 2 * BAND_ROWS
               for shape, _ in ops.mask_layouts), ops.mask_layouts
    blocks = sq // BAND_ROWS
    assert ops.calls < 2 * 2 * blocks  # each way: a full call per block, the edges batched


@pytest.mark.parametrize("name", [n for n, s in CASES.items()
                                  if any(r.rule == "window" for r in s.runs)])
@pytest.mark.parametrize("branch", ["efficient", "cudnn"])
def test_biases_reach_cuda_ops_with_aligned_rows_on_meta(branch, name):
    """Every bias a CUDA op takes (a window block's, a short call's own) is [b, hq, sq, sk]
    of the call, broadcast over batch and heads (strides 0), its rows 16 elements apart
    (cuDNN and the memory-efficient op read them aligned) and its keys dense."""
    kernel, dtype, _ = META_KERNELS[branch]
    slices = cases(torch.device("meta"))[name]
    sq, sk = slices.shape
    q = torch.empty(sq, 2, 4, 64, device="meta", dtype=dtype)
    k = torch.empty(sk, 2, 2, 64, device="meta", dtype=dtype)
    with AttentionOps() as ops:
        out, lse = kernel.forward(q, k, k, False, SCALE, slices=slices)
        kernel.backward(out, q, k, k, out, lse, False, SCALE, slices=slices)
    assert ops.mask_layouts
    for shape, stride in ops.mask_layouts:
        assert shape[:2] == (2, 4) and stride[:2] == (0, 0), (shape, stride)
        assert stride[3] == 1 and stride[2] % 16 == 0 and stride[2] >= shape[3], (shape, stride)


def test_equal_documents_are_one_call_and_their_calls_are_made_once(monkeypatch):
    """Eight causal documents of one length on the CPU op: one op call each way (the
    documents as batch entries), exact; the dense calls are made by the first forward and
    read by the next layer's forward and by the backward."""
    from megatron_mesh.kernels import run_calls
    made = []
    real = run_calls.plan_of
    monkeypatch.setattr(run_calls, "plan_of", lambda *a: made.append(1) or real(*a))
    slices = documents((16,) * 8, True)
    torch.manual_seed(1)
    q, k, v, dout = (torch.randn(128, 1, 2, 8) for _ in range(4))
    want = fp64_masked_attention(q, k, v, dout, seen_of_slices(slices.slices, slices.shape),
                                 SCALE)
    kernel = TorchFlashKernel()
    for _ in range(2):  # two layers
        with AttentionOps() as fwd:
            out, lse = kernel.forward(q, k, v, False, SCALE, slices=slices)
        with AttentionOps() as bwd:
            grads = kernel.backward(dout, q, k, v, out, lse, False, SCALE, slices=slices)
        assert fwd.calls == bwd.calls == 1
    assert made == [1]
    for got, ref in zip((out, lse, *grads), want):
        assert torch.allclose(got.double(), ref, atol=2e-5, rtol=1e-5)


def test_varlen_packs_are_made_once_per_call(monkeypatch):
    """On CUDA's flash op (meta) a call's packs (`packs_of`) and their index tensors are made
    by the first forward; the next layer's forward and the backward find them."""
    from megatron_mesh.kernels import torch_flash
    made = []
    real = torch_flash.packs_of
    monkeypatch.setattr(torch_flash, "packs_of", lambda runs: made.append(1) or real(runs))
    slices = cases(torch.device("meta"))["prefix-LM"]
    q = torch.empty(30, 1, 4, 64, device="meta", dtype=torch.bfloat16)
    kernel = TorchFlashKernel(flash=True)
    for _ in range(2):
        out, lse = kernel.forward(q, q, q, False, SCALE, slices=slices)
        kernel.backward(out, q, q, q, out, lse, False, SCALE, slices=slices)
    assert made == [1]
