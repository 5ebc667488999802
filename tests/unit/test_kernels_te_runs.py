"""Windows and masks given as slices on Transformer Engine's own "thd" calls (`te_runs`).

Part 1 runs anywhere: the keyword arguments of a pack of runs (full, bottom-right causal,
a window) are exactly ones each release's `fused_attn_fwd` / `fused_attn_bwd` accept
(parameter lists in tests/te_releases.py), windows are refused by releases without
`bottom_right_diagonal`, and the packing of runs into thd sequences (indices, cu_seqlens,
masks, TE's softmax stats both ways) is exact: the kernel's own runs path drives stand-ins
of TE's two functions that take the release's parameters and compute each packed sequence
in fp64 by TE's documented definition of its masks (SDPA per sequence), and the scattered
result equals the fp64 formula of the whole call, mask built here from the slices'
definition, forward and backward.

Part 2 needs CUDA and TE (`gpu`): TEFusedKernel on a window and on a SliceMask tile against
fp64 SDPA.
"""
from __future__ import annotations

import inspect
import logging
import random
import types

import pytest
import torch
from te_releases import (
    ATTENTION_PARAMS,
    BACKEND,
    BOTTOM_RIGHT_BY_DEFAULT,
    FWD_REQUIRED,
    MASK_TYPES,
    RELEASES,
    SIGNATURES,
    TE_BF16,
    WINDOW_ALIGNMENT_FROM,
)

from megatron_mesh.calls.tile_slices import TileSlices
from megatron_mesh.kernels import te_fused, te_kwargs
from megatron_mesh.kernels.te_fused import TEFusedKernel
from megatron_mesh.kernels.te_kwargs import pack_bwd_kwargs, pack_fwd_kwargs
from megatron_mesh.kernels.te_runs import (
    BOTTOM_RIGHT_MASK,
    FULL_MASK,
    RELEASE,
    SHAPE,
    RunsPlan,
    fit_runs,
    pack_refusal,
    run_mask,
)
from megatron_mesh.kernels.varlen_runs import Pack, packs_of
from megatron_mesh.masks.slices import SliceMask

from reference import fp64_masked_attention, seen_of_slices

SCALE = 0.3
CPU = torch.device("cpu")
WINDOWS_FROM = tuple(int(x) for x in WINDOW_ALIGNMENT_FROM.split("."))


def _minor(release: str) -> tuple[int, int]:
    return tuple(int(x) for x in release.split(".")[:2])


# ---------------------------------------------------------------- part 1: no TE needed

# three sequences: 3 query rows x 5 keys, 1 x 1, 4 x 6
CU_Q, CU_K = (0, 3, 4, 8), (0, 5, 6, 12)
MASKS = {"full": (False, None), "causal": (True, None), "window": (False, (2, 1)),
         "window (3, -1)": (False, (3, -1))}


def _pack_kwargs(release: str, mask):
    fwd_params, bwd_params = SIGNATURES[RELEASES[release]][:2]
    q = torch.randn(CU_Q[-1], 4, 16, dtype=torch.bfloat16)
    k, v = torch.randn(2, CU_K[-1], 2, 16, dtype=torch.bfloat16)
    cu_q, cu_k = (torch.tensor(c, dtype=torch.int32) for c in (CU_Q, CU_K))
    fwd = pack_fwd_kwargs(fwd_params, q, k, v, cu_q, cu_k, 4, 6, mask, 0.25, BACKEND)
    aux = [torch.zeros(CU_Q[-1], 4, 1), torch.zeros(2, dtype=torch.int64)]
    bwd = pack_bwd_kwargs(bwd_params, q, q, k, v, q, aux, cu_q, cu_k, 4, 6, mask, 0.25,
                          BACKEND, TE_BF16, deterministic=True)
    return fwd, bwd, (cu_q, cu_k)


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_pack_kwargs_match_real_signature(release: str):
    """Each mask of a pack: every argument is one the release's functions take, every
    required one is there, the thd layout and the pack's cu_seqlens and mask are passed;
    windows only where the release aligns them (bottom_right_diagonal, 2.12 on)."""
    fwd_params, bwd_params, bwd_required = SIGNATURES[RELEASES[release]]
    for name, (causal, window) in MASKS.items():
        pack = Pack(((0, 3), (3, 4), (4, 8)), (((0, 5),), ((5, 6),), ((6, 12),)), causal,
                    window)
        refusal = pack_refusal(pack, fwd_params)
        windowed = window is not None
        assert (refusal is not None) == (windowed and _minor(release) < WINDOWS_FROM), name
        if refusal is not None:
            assert refusal[0] == RELEASE and "bottom_right_diagonal" in refusal[1]
            continue
        mask = run_mask(causal, window)
        fwd, bwd, (cu_q, cu_k) = _pack_kwargs(release, mask)
        assert set(fwd) <= set(fwd_params), set(fwd) - set(fwd_params)
        assert set(FWD_REQUIRED) <= set(fwd), set(FWD_REQUIRED) - set(fwd)
        assert set(bwd) <= set(bwd_params), set(bwd) - set(bwd_params)
        assert set(bwd_required) <= set(bwd), set(bwd_required) - set(bwd)
        for kw in (fwd, bwd):
            assert kw["qkv_layout"] == "thd_thd_thd"
            assert kw["cu_seqlens_q"] is kw["cu_seqlens_q_padded"] is cu_q
            assert kw["cu_seqlens_kv"] is kw["cu_seqlens_kv_padded"] is cu_k
            assert (kw["max_seqlen_q"], kw["max_seqlen_kv"]) == (4, 6)
            want = {"full": ("padding", (-1, -1)),
                    "causal": ("padding_causal_bottom_right", (-1, 0)),
                    "window": ("padding", (2, 1)),
                    "window (3, -1)": ("padding", (3, -1))}[name]
            assert (kw["attn_mask_type"], kw["window_size"]) == want
            assert kw["attn_mask_type"] in MASK_TYPES
            if "bottom_right_diagonal" in kw:  # TE's band aligned at each sequence's end
                assert kw["bottom_right_diagonal"] is (name != "full")
            if "o_format" in kw:
                assert kw["o_format"] == "thd"
        if "dqkv_layout" in bwd:
            assert bwd["dqkv_layout"] == "thd_thd_thd" and bwd["do_format"] == "thd"


def test_pack_refusals_and_masks():
    """More queries than keys in a sequence under causal or a window: refused (SHAPE); a
    full pack takes it; flash's (-1, 0) window is bottom-right causal."""
    params = SIGNATURES["2.15"][0]
    rows, keys = ((0, 5), (5, 7)), (((0, 2),), ((2, 9),))  # 5 queries against 2 keys first
    assert pack_refusal(Pack(rows, keys, False, None), params) is None
    for causal, window in ((True, None), (False, (3, 3))):
        kind, words = pack_refusal(Pack(rows, keys, causal, window), params)
        assert kind == SHAPE and "5 queries against 2 keys" in words
    assert run_mask(False, (-1, 0)) == run_mask(True, None) == BOTTOM_RIGHT_MASK
    assert run_mask(False, (-1, -1)) == run_mask(False, None) == FULL_MASK
    with pytest.raises(ValueError, match=r"window \(-2, 0\)"):
        run_mask(False, (-2, 0))


def _run_pairs(run) -> set:
    """(row, key) pairs of a run, from flash-attention's bottom-right window: key j of the
    concatenated keys (sk) for row i (of sq) iff -left <= j - i - (sk - sq) <= right."""
    keys = [k for c, e in run.keys for k in range(c, e)]
    left, right = run.window
    out = set()
    for i in range(run.sq):
        for j, key in enumerate(keys):
            d = j - i - (run.sk - run.sq)
            if (left < 0 or d >= -left) and (right < 0 or d <= right):
                out.add((run.q0 + i, key))
    return out


def test_tall_window_runs_are_cut_into_parts_te_takes():
    """`fit_runs` on window runs of more queries than keys (random bands over earlier keys
    and within a square): the parts cover the run's rows once, keep exactly its pairs, and
    each is a window no taller than its keys that `pack_refusal` lets through."""
    rng = random.Random(3)
    params = frozenset({"bottom_right_diagonal"})
    cut = 0
    for _ in range(200):
        sq, sk = rng.randrange(2, 40), rng.randrange(1, 20)
        lo = rng.randrange(-sq, sk)
        hi = None if rng.random() < 0.5 else rng.randrange(lo, sk + 1)
        slices = TileSlices.of([(0, sq, 0, sk, lo, hi)], (sq, sk), CPU)
        for run in slices.runs:
            if run.rule != "window" or run.sq <= run.sk:
                continue
            parts = fit_runs((run,))
            assert sorted((p.q0, p.q1) for p in parts) == [(p.q0, p.q1) for p in parts]
            assert [(parts[0].q0, parts[-1].q1)] == [(run.q0, run.q1)]
            assert all(a.q1 == b.q0 for a, b in zip(parts, parts[1:]))
            assert set().union(*map(_run_pairs, parts)) == _run_pairs(run)
            if len(parts) > 1:
                cut += 1
                for part in parts:
                    assert pack_refusal(packs_of((part,))[0], params) is None, part
    assert cut >= 20, cut


@pytest.mark.parametrize("release", sorted(ATTENTION_PARAMS))
def test_backend_query_for_packs(release: str):
    """TE's query is asked about a pack as it runs: thd, one batch entry per sequence, the
    longest sequences, the pack's mask, window and alignment."""
    fields = ATTENTION_PARAMS[release]
    for mask in (FULL_MASK, BOTTOM_RIGHT_MASK, run_mask(False, (64, 0))):
        shape = (mask, 3, 300, 512, 700, 1100)
        spec = te_fused.TileSpec.of_pack(torch.bfloat16, 16, 4, 128, shape, False, False)
        kw = te_fused.attention_params(fields, spec)
        assert set(kw) <= set(fields), set(kw) - set(fields)
        assert kw["qkv_layout"] == "thd_thd_thd" and kw["batch_size"] == 3
        assert (kw["max_seqlen_q"], kw["max_seqlen_kv"]) == (300, 512)
        assert (kw["attn_mask_type"], kw["window_size"]) == (mask.attn_mask_type,
                                                             mask.window_size)
        if "bottom_right_diagonal" in fields:
            assert kw["bottom_right_diagonal"] is mask.bottom_right_diagonal
        if "num_tokens_q" in fields:
            assert (kw["num_tokens_q"], kw["num_tokens_kv"]) == (700, 1100)


# TE's two functions, stood in for by their documented definition (fp64, per sequence)


def _signature(names: list[str], required: list[str]) -> inspect.Signature:
    return inspect.Signature([
        inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY,
                          default=inspect.Parameter.empty if n in required else None)
        for n in names])


def _keep(kw: dict, sq: int, sk: int) -> torch.Tensor:
    """bool [sq, sk] of one sequence by TE's definition: "padding_causal" j <= i,
    "padding_causal_bottom_right" j <= i + sk - sq; window (left, right) keeps keys in
    [i + shift - left, i + shift + right] (-1: unbounded), shift = sk - sq where
    bottom_right_diagonal (default: for the bottom-right masks), else 0."""
    mask, (left, right) = kw["attn_mask_type"], kw["window_size"]
    aligned = kw.get("bottom_right_diagonal")
    if aligned is None:
        assert (left, right) in ((-1, -1), (-1, 0)), "a band TE could not align"
        aligned = mask in BOTTOM_RIGHT_BY_DEFAULT
    i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if mask == "padding_causal":
        keep &= j <= i
    elif mask == "padding_causal_bottom_right":
        keep &= j <= i + sk - sq
    else:
        assert mask == "padding", mask
    shift = sk - sq if aligned else 0
    if left >= 0:
        keep &= j >= i + shift - left
    if right >= 0:
        keep &= j <= i + shift + right
    return keep


def _sequences(kw: dict):
    """Each sequence's (query rows, key rows), checking the thd arguments on the way."""
    assert kw["qkv_layout"] == "thd_thd_thd" and kw["attn_bias_type"] == "no_bias"
    assert kw["dropout"] == 0.0
    cu_q, cu_k = kw["cu_seqlens_q"].tolist(), kw["cu_seqlens_kv"].tolist()
    assert kw["cu_seqlens_q_padded"].tolist() == cu_q
    assert kw["cu_seqlens_kv_padded"].tolist() == cu_k
    assert cu_q[-1] == kw["q"].shape[0] and cu_k[-1] == kw["k"].shape[0]
    for n in range(len(cu_q) - 1):
        sq, sk = cu_q[n + 1] - cu_q[n], cu_k[n + 1] - cu_k[n]
        assert 0 < sq <= kw["max_seqlen_q"] and 0 < sk <= kw["max_seqlen_kv"]
        yield n, slice(cu_q[n], cu_q[n + 1]), slice(cu_k[n], cu_k[n + 1])


def _expand(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t.double().repeat_interleave(heads // t.shape[1], 1)


# A dense (sbhd) call's masks are those of its b sequences as thd ones (TE's definition)
DENSE_AS_THD = {"no_mask": "padding", "causal": "padding_causal",
                "causal_bottom_right": "padding_causal_bottom_right"}


def _dense_as_thd(kw: dict) -> dict:
    """The kwargs of a dense sbhd call as the thd call of its batch's b sequences."""
    sq, b = kw["q"].shape[:2]
    sk = kw["k"].shape[0]
    assert kw["max_seqlen_q"] == sq and kw["max_seqlen_kv"] == sk

    def cu(n: int) -> torch.Tensor:
        return torch.arange(b + 1, dtype=torch.int32) * n

    assert kw["cu_seqlens_q"].tolist() == cu(sq).tolist()
    assert kw["cu_seqlens_kv"].tolist() == cu(sk).tolist()
    thd = dict(kw, qkv_layout="thd_thd_thd", attn_mask_type=DENSE_AS_THD[kw["attn_mask_type"]],
               cu_seqlens_q=cu(sq), cu_seqlens_kv=cu(sk), cu_seqlens_q_padded=cu(sq),
               cu_seqlens_kv_padded=cu(sk))
    for name in ("q", "k", "v", "o", "d_o"):
        if name in kw:
            thd[name] = kw[name].transpose(0, 1).reshape(-1, *kw[name].shape[2:])
    return thd


def _thd_as_dense(t: torch.Tensor, b: int) -> torch.Tensor:
    """[b * s, h, d] -> [s, b, h, d]."""
    return t.reshape(b, -1, *t.shape[1:]).transpose(0, 1)


def _stand_in_te(release: str, per_token: bool) -> te_fused._TE:
    """TE's pieces with fused_attn_fwd / _bwd of `release`'s parameters computing each
    sequence by the definition; softmax stats per token ([t, h, 1], rows rounded as the
    release rounds them) or per sequence ([n, h, max_seqlen_q, 1])."""
    fwd_names, bwd_names, bwd_required = SIGNATURES[RELEASES[release]]

    def fused_attn_fwd(**kw):
        if kw["qkv_layout"] == "sbhd_sbhd_sbhd":  # a dense batch: b sequences of sq rows
            b, sq = kw["q"].shape[1], kw["q"].shape[0]
            out, (stats, rng) = thd_fwd(**_dense_as_thd(kw))
            per_row = stats[:b * sq, :, 0] if per_token else stats[..., 0].transpose(1, 2)
            return (_thd_as_dense(out, b),
                    [per_row.reshape(b, sq, -1).transpose(1, 2)[..., None], rng])
        return thd_fwd(**kw)

    def fused_attn_bwd(**kw):
        if kw["qkv_layout"] == "sbhd_sbhd_sbhd":
            b, sq = kw["q"].shape[1], kw["q"].shape[0]
            stats, rng = kw["aux_ctx_tensors"]
            rows = stats[..., 0].transpose(1, 2)  # [b, sq, h]
            stats = (rows.reshape(b * sq, -1)[..., None] if per_token
                     else rows.reshape(b, sq, -1).transpose(1, 2)[..., None])
            grads = thd_bwd(**dict(_dense_as_thd(kw), aux_ctx_tensors=[stats, rng]))
            return tuple(_thd_as_dense(g, b) for g in grads[:3]) + grads[3:]
        return thd_bwd(**kw)

    def thd_fwd(**kw):
        q, k, v = kw["q"], kw["k"], kw["v"]
        heads, sequences = q.shape[1], len(kw["cu_seqlens_q"]) - 1
        out = torch.zeros(q.shape[0], heads, v.shape[-1], dtype=torch.float64)
        stats = (torch.zeros(te_fused.stats_rows(_minor(release), q.shape[0]), heads, 1)
                 if per_token else torch.zeros(sequences, heads, kw["max_seqlen_q"], 1))
        for n, rows, keys in _sequences(kw):
            qs, ks, vs = q[rows].double(), _expand(k[keys], heads), _expand(v[keys], heads)
            keep = _keep(kw, qs.shape[0], ks.shape[0])
            out[rows] = torch.nn.functional.scaled_dot_product_attention(
                qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1), attn_mask=keep,
                scale=kw["attn_scale"]).transpose(0, 1)
            scores = torch.einsum("ihd,jhd->hij", qs, ks) * kw["attn_scale"]
            lse = torch.logsumexp(scores.masked_fill(~keep, float("-inf")), -1)  # [h, sq]
            if per_token:
                stats[rows, :, 0] = lse.t().float()
            else:
                stats[n, :, :lse.shape[1], 0] = lse.float()
        return out.to(q.dtype), [stats, torch.zeros(2, dtype=torch.int64)]

    def thd_bwd(**kw):
        q, k, v, o, do = kw["q"], kw["k"], kw["v"], kw["o"], kw["d_o"]
        stats, heads, scale = kw["aux_ctx_tensors"][0], q.shape[1], kw["attn_scale"]
        assert stats.dim() == (3 if per_token else 4)
        grads = [torch.zeros(t.shape, dtype=torch.float64) for t in (q, k, v)]
        for n, rows, keys in _sequences(kw):
            qs, ks, vs = q[rows].double(), _expand(k[keys], heads), _expand(v[keys], heads)
            keep = _keep(kw, qs.shape[0], ks.shape[0])
            lse = stats[rows, :, 0].t() if per_token else stats[n, :, :qs.shape[0], 0]
            scores = torch.einsum("ihd,jhd->hij", qs, ks) * scale
            p = torch.exp(scores - lse.double()[..., None]).masked_fill(~keep, 0.0)
            dos = do[rows].double()
            dp = torch.einsum("ihd,jhd->hij", dos, vs)
            ds = p * (dp - (dos * o[rows].double()).sum(-1).t()[..., None])
            grads[0][rows] = torch.einsum("hij,jhd->ihd", ds, ks) * scale
            for g, full in ((grads[1], torch.einsum("hij,ihd->jhd", ds, qs) * scale),
                            (grads[2], torch.einsum("hij,ihd->jhd", p, dos))):
                g[keys] = full.unflatten(1, (k.shape[1], -1)).sum(2)
        return tuple(g.to(q.dtype) for g in grads) + (None, None)

    fused_attn_fwd.__signature__ = _signature(fwd_names, FWD_REQUIRED)
    fused_attn_bwd.__signature__ = _signature(bwd_names, bwd_required)
    module = types.SimpleNamespace(fused_attn_fwd=fused_attn_fwd, fused_attn_bwd=fused_attn_bwd)
    return te_fused._TE(release, module, BACKEND, {torch.float32: TE_BF16}, None,
                        lambda: (9, 10, 0))


def _prefix(sq: int, prefix: int) -> SliceMask:
    return SliceMask([(0, prefix, 0, prefix, "full"), (prefix, sq, 0, sq, "causal")], sq)


def _of_mask(mask: SliceMask, shape: tuple[int, int], device=CPU) -> TileSlices:
    """A call over the whole sequence of `mask`'s slices."""
    return TileSlices.of([(s.q_start, s.q_end, s.k_start, s.k_end, *s.bounds)
                          for s in mask.slices], shape, device)


CASES = {
    "window (4, 0)": TileSlices.band(30, 30, 4, 0),
    "window (3, 2), more keys": TileSlices.band(20, 29, 3, 2),
    "window (-1, 3)": TileSlices.band(20, 24, -1, 3),
    "window (2, -1)": TileSlices.band(20, 24, 2, -1),
    "causal, more keys": TileSlices.band(9, 30, -1, 0),
    "prefix-LM": _of_mask(_prefix(30, 11), (30, 30)),
    "windows in documents": TileSlices.of(
        [(0, 10, 0, 10, -3, 0), (10, 25, 10, 25, -4, 0)], (25, 25), CPU),
    "two causal on a row": TileSlices.of(
        [(0, 10, 0, 10, None, 0), (0, 10, 12, 20, None, 10), (4, 10, 20, 22, None, None)],
        (10, 22), CPU),
    # more queries than keys: cut into parts of rows no taller than the keys they see
    "window taller than its keys": TileSlices.of([(0, 7, 0, 4, -3, 0)], (7, 4), CPU),
    "window over earlier keys, taller": TileSlices.of([(0, 9, 0, 4, -5, None)], (9, 4), CPU),
    # a band another slice's rows cut where it is a causal piece and a full one
    "window cut by another slice's rows": TileSlices.of(
        [(0, 12, 1, 6, -8, 1), (10, 12, 0, 1, None, None)], (12, 6), CPU),
}


@pytest.mark.parametrize("release, per_token", [("2.20.2", True), ("2.14.1", False),
                                                ("2.10.0", True)])
def test_runs_on_te_thd_calls_are_exact(release: str, per_token: bool):
    """Every case through the TE runs path (packing, kwargs, stats both ways, scatter and
    merge) on the stand-ins equals the fp64 formula of the whole call, batch 2 and GQA,
    forward and backward; where the release or a rule cannot take a pack, the plan says
    which (a window before 2.12, a window sequence of more queries than keys)."""
    te = _stand_in_te(release, per_token)
    params = te_fused._parameters(te.fused_attn.fused_attn_fwd)[0]
    ran = set()
    for name, slices in CASES.items():
        if "taller" in name:  # refused as they are
            assert any(pack_refusal(p, params) for p in packs_of(slices.runs)), name
        plan = RunsPlan.of(packs_of(fit_runs(slices.runs)), params, CPU)
        windows = any(p.window not in (None, (-1, 0)) for p in plan.packs)
        if windows and _minor(release) < WINDOWS_FROM:
            assert plan.refusal[0] == RELEASE, name
            continue
        assert plan.refusal is None, (name, plan.refusal)
        sq, sk = slices.shape
        torch.manual_seed(sq * sk)
        q, k, v = torch.randn(sq, 2, 4, 8), torch.randn(sk, 2, 2, 8), torch.randn(sk, 2, 2, 8)
        dout = torch.randn(sq, 2, 4, 8)
        want = fp64_masked_attention(q, k, v, dout,
                                     seen_of_slices(slices.slices, slices.shape), SCALE)
        out, lse = te_fused.runs_forward(te, q, k, v, SCALE, plan, per_token)
        grads = te_fused.runs_backward(te, dout, q, k, v, out, lse, SCALE, plan, per_token)
        for got, ref, what in zip((out, lse, *grads), want, ("out", "lse", "dq", "dk", "dv")):
            assert got.shape == ref.shape and got.dtype == torch.float32, (name, what)
            assert torch.allclose(got.double(), ref, atol=2e-5, rtol=1e-5), (
                name, what, (got.double() - ref).abs().max())
        ran.add(name)
    assert {"prefix-LM", "two causal on a row", "causal, more keys"} <= ran
    assert ("window taller than its keys" in ran) == (_minor(release) >= WINDOWS_FROM)
    assert ("window (3, 2), more keys" in ran) == (_minor(release) >= WINDOWS_FROM)


def _stand_in_kernel(monkeypatch, release: str, refuse=lambda params: False):
    """A TEFusedKernel on the stand-ins, its tensors taken as TE's (CPU here), TE's query
    answering `not refuse(params)` and counting what it is asked."""
    import dataclasses

    te = _stand_in_te(release, per_token=True)
    asked = []
    params_cls = dataclasses.make_dataclass(
        "AttentionParams", [(n, object, dataclasses.field(default=None))
                            for n in ATTENTION_PARAMS["2.20.2"]])

    def get_attention_backend(params):
        asked.append(params)
        fused = not refuse(params)
        return (False, None, fused, 1 if fused else None, False, [False, fused, False])

    te = dataclasses.replace(te, backend=1, selection=types.SimpleNamespace(
        AttentionParams=params_cls, get_attention_backend=get_attention_backend))
    monkeypatch.setattr(te_fused, "_load", lambda: te)
    monkeypatch.setattr(te_fused, "_uses_te", lambda q: True)
    monkeypatch.setattr(te_fused, "_stats_per_token", lambda device: True)
    return asked


def test_kernel_runs_windows_on_te_and_falls_back_once(monkeypatch, caplog):
    """TEFusedKernel routes a window call to TE's thd calls (asked once per pack shape,
    exact), a window on a release before 2.12 and a pack TE's query refuses to its
    fallback, each logged once."""
    slices = TileSlices.band(20, 29, 3, 2)
    torch.manual_seed(0)
    q, k, v = torch.randn(20, 1, 4, 8), torch.randn(29, 1, 2, 8), torch.randn(29, 1, 2, 8)
    want = fp64_masked_attention(q, k, v, torch.ones_like(q),
                                 seen_of_slices(slices.slices, slices.shape), SCALE)
    asked = _stand_in_kernel(monkeypatch, "2.20.2")
    te = TEFusedKernel(deterministic=False)
    for _ in range(2):  # the second call asks nothing
        out, lse = te.forward(q, k, v, False, SCALE, slices=slices)
    assert len(asked) == 1 and asked[0].window_size == (3, 2)
    assert asked[0].attn_mask_type == "padding" and asked[0].bottom_right_diagonal is True
    assert torch.allclose(out.double(), want[0], atol=2e-5)

    caplog.set_level(logging.INFO, logger="megatron_mesh.kernels")
    asked = _stand_in_kernel(monkeypatch, "2.10.0")
    old = TEFusedKernel(deterministic=False)
    for _ in range(2):  # a new call (its slices) each time, as every micro-batch brings
        out, _ = old.forward(q, k, v, False, SCALE, slices=TileSlices.band(20, 29, 3, 2))
    assert not asked and torch.allclose(out.double(), want[0], atol=2e-5)  # on torch's
    said = [r.message for r in caplog.records if "bottom_right_diagonal" in r.message]
    assert len(said) == 1 and "run on torch" in said[0]

    asked = _stand_in_kernel(monkeypatch, "2.20.2", refuse=lambda p: p.window_size == (3, 2))
    refused = TEFusedKernel(deterministic=False)
    out, lse = refused.forward(q, k, v, False, SCALE, slices=slices)
    assert len(asked) == 1 and torch.allclose(out.double(), want[0], atol=2e-5)
    assert any("padding with window (3, 2)" in r.message for r in caplog.records)


def test_documents_of_more_keys_run_bottom_right_on_te(monkeypatch):
    """Causal documents of more keys than queries go to TE's thd call as
    "padding_causal_bottom_right" (square ones keep "padding_causal"): exact on the
    stand-ins, forward and backward, and asked of TE's query with that mask."""
    asked = _stand_in_kernel(monkeypatch, "2.20.2")
    docs = TileSlices.documents((0, 3, 4, 11), (0, 5, 6, 16), True, CPU)
    torch.manual_seed(1)
    q, k, v = torch.randn(11, 1, 4, 8), torch.randn(16, 1, 2, 8), torch.randn(16, 1, 2, 8)
    dout = torch.randn(11, 1, 4, 8)
    kernel = TEFusedKernel(deterministic=False)
    out, lse = kernel.forward(q, k, v, True, SCALE, slices=docs)
    grads = kernel.backward(dout, q, k, v, out, lse, True, SCALE, slices=docs)
    assert [p.attn_mask_type for p in asked] == ["padding_causal_bottom_right"]
    want = fp64_masked_attention(q, k, v, dout, seen_of_slices(docs.slices, docs.shape), SCALE)
    for got, ref, what in zip((out, lse, *grads), want, ("out", "lse", "dq", "dk", "dv")):
        assert torch.allclose(got.double(), ref, atol=2e-5, rtol=1e-5), (what, (got - ref).abs().max())
    for release in ("2.10.0", "2.20.2"):
        fwd_params = SIGNATURES[RELEASES[release]][0]
        kw = te_kwargs.thd_fwd_kwargs(fwd_params, q[:, 0], k[:, 0], v[:, 0], docs, True, 0.3,
                                     BACKEND)
        assert kw["attn_mask_type"] == "padding_causal_bottom_right"
        assert kw.get("bottom_right_diagonal", True) is True
        square = TileSlices.documents((0, 3, 11), (0, 3, 11), True, CPU)
        kw = te_kwargs.thd_fwd_kwargs(fwd_params, q[:, 0], q[:, 0], q[:, 0], square, True,
                                     0.3, BACKEND)
        assert kw["attn_mask_type"] == "padding_causal"


def test_te_folds_the_causal_diagonal_into_one_bottom_right_call(monkeypatch):
    """A grouped tile on TE takes its causal diagonal with the full keys before it as one
    "causal_bottom_right" call (query i sees key j <= i + sk - sq), as torch's flash op
    does: a P = 4 zigzag column in 2 calls a pass instead of 3, exact against the fp64
    formula of the zigzag positions (batch 2, GQA), forward and backward. TE's query is
    asked with that mask (the band aligned at the bottom right from 2.12, which has the
    argument); a tile it turns down runs on the fallback, still one call. The planner counts
    it the same way. A fallback with a top-left causal (cuDNN's) gets the call as its band,
    which it splits. Off TE's tensors TE folds where its fallback does."""
    import dataclasses

    from megatron_mesh.calls.layout import AttentionMask
    from megatron_mesh.common.merge import empty_accumulators
    from megatron_mesh.kernels import backend_folds_diagonal
    from megatron_mesh.kernels.base import folds_diagonal
    from megatron_mesh.kernels.torch_flash import TorchFlashKernel
    from megatron_mesh.planner.pricing.tiles import KernelCalls
    from megatron_mesh.schedules.blocks import backward_tile, forward_tile, kv_grads

    p, s, x = 4, 8, 2  # P chunks of s rows; the query chunk of rank x
    half = s // 2

    def positions(c: int) -> torch.Tensor:  # zigzag: halves c and 2P - 1 - c
        return torch.cat([torch.arange(c * half, (c + 1) * half),
                          torch.arange((2 * p - 1 - c) * half, (2 * p - c) * half)])

    torch.manual_seed(3)
    q, dout = torch.randn(s, 2, 4, 8), torch.randn(s, 2, 4, 8)
    kv = [(torch.randn(s, 2, 2, 8), torch.randn(s, 2, 2, 8)) for _ in range(p)]
    keys = torch.cat([positions(y) for y in range(p)])
    seen = keys[None, :] <= positions(x)[:, None]
    want = fp64_masked_attention(q, torch.cat([k for k, _ in kv]), torch.cat([v for _, v in kv]),
                                 dout, seen, SCALE)
    top_left = TorchFlashKernel()  # a fallback whose causal is top-left, as cuDNN's
    top_left.caps = dataclasses.replace(TorchFlashKernel.caps, bottom_right=False)
    cases = (("2.20.2", False, TorchFlashKernel(band_bottom_right=True)),
             ("2.10.0", False, TorchFlashKernel(band_bottom_right=True)),
             ("2.20.2", True, TorchFlashKernel(band_bottom_right=True)),
             ("2.20.2", True, top_left))  # the folded call to it as its band: 2 calls
    for release, refuse, fallback in cases:
        asked = _stand_in_kernel(monkeypatch, release,
                                 lambda prm: refuse and "bottom_right" in prm.attn_mask_type)
        te = te_fused._load()
        ran = []
        fwd, bwd = te.fused_attn.fused_attn_fwd, te.fused_attn.fused_attn_bwd

        def counted(fn, name):
            def call(**kw):
                ran.append((name, kw["attn_mask_type"], kw.get("bottom_right_diagonal")))
                return fn(**kw)
            call.__signature__ = fn.__signature__
            return call

        te.fused_attn.fused_attn_fwd = counted(fwd, "fwd")
        te.fused_attn.fused_attn_bwd = counted(bwd, "bwd")
        kernel = TEFusedKernel(deterministic=False, fallback=fallback)
        assert folds_diagonal(kernel, q)
        out, lse = empty_accumulators(s, 2, 4, 8, CPU)
        mask = AttentionMask(True, ranks=p)
        column = [(y, k, v) for y, (k, v) in enumerate(kv)]
        forward_tile(kernel, [(x, q, out, lse)], column, mask, SCALE, grouped=True)
        dq = torch.zeros(s, 2, 4, 8)
        dkv = torch.zeros(p, 2 * s * 2 * 2 * 8)
        backward_tile(kernel, [(x, dout, q, out.to(q.dtype), lse, dq)],
                      [(y, k, v, kv_grads(dkv[y], k, v)) for y, k, v in column], mask, SCALE,
                      grouped=True)
        dk = torch.cat([dkv[y].view(2, s, 2, 2, 8)[0] for y in range(p)])
        dv = torch.cat([dkv[y].view(2, s, 2, 2, 8)[1] for y in range(p)])
        for got, ref, what in zip((out, lse, dq, dk, dv), want, ("out", "lse", "dq", "dk", "dv")):
            assert torch.allclose(got.double(), ref, atol=2e-5, rtol=1e-5), (
                release, refuse, what, (got.double() - ref).abs().max())
        bottom_right = [a for a in asked if a.attn_mask_type == "causal_bottom_right"]
        assert len(bottom_right) == 1 and bottom_right[0].max_seqlen_kv > s
        assert bottom_right[0].bottom_right_diagonal is True
        if refuse:  # the folded call on the fallback, the calls after it on TE
            assert [r[0] for r in ran] == ["fwd", "bwd"]
            continue
        assert [r[0] for r in ran] == ["fwd", "fwd", "bwd", "bwd"], ran
        aligned = True if release == "2.20.2" else None  # no such argument before 2.12
        assert ("fwd", "causal_bottom_right", aligned) in ran, ran
        assert ("bwd", "causal_bottom_right", aligned) in ran, ran
    monkeypatch.undo()  # TE's tensors are CUDA's again: on the CPU, as torch's kernel
    assert not folds_diagonal(TEFusedKernel(deterministic=False), q)
    assert backend_folds_diagonal("te", torch.bfloat16) and KernelCalls.of("te", "bf16").bottom_right
    assert not backend_folds_diagonal("te", torch.float32)


# ---------------------------------------------------------------- part 2: CUDA + TE

needs_te = pytest.mark.skipif(
    te_fused.te_version() is None or not torch.cuda.is_available() or not te_fused.is_available(),
    reason="needs a GPU and Transformer Engine "
    f"(CUDA {'yes' if torch.cuda.is_available() else 'no'}, TE {te_fused.te_version()})",
)


@pytest.mark.gpu
@needs_te
@pytest.mark.parametrize("heads", [(8, 8), (8, 2)])
def test_te_window_and_slice_mask_tiles_match_fp64(heads):
    """A window (more keys than queries) and a SliceMask tile (a bidirectional prefix, the
    rest causal) on TEFusedKernel, bf16: out, lse, dq, dk, dv against the fp64 formula of
    the inputs as rounded, within bf16's rounding (a wrong mask is off by O(1)). Where TE
    (its release or query on this GPU / cuDNN) does not take the call, the test says so."""
    device = torch.device("cuda")
    cases = {"window (64, 16)": TileSlices.band(256, 384, 64, 16),
             "prefix-LM SliceMask": _of_mask(_prefix(512, 128), (512, 512), device)}
    for name, slices in cases.items():
        kernel = TEFusedKernel(deterministic=False)
        sq, sk = slices.shape
        torch.manual_seed(sq + sk)
        q, k, v, dout = (torch.randn(s, 1, h, 64).to(torch.bfloat16).to(device)
                         for s, h in ((sq, heads[0]), (sk, heads[1]), (sk, heads[1]),
                                      (sq, heads[0])))
        plan = kernel._runs_plan(q, k, v, slices)
        if plan is None:
            pytest.skip(f"{name}: TE {te_fused.te_version()} does not take it here (logged)")
        want = fp64_masked_attention(q, k, v, dout,
                                     seen_of_slices(slices.slices, slices.shape).to(device),
                                     SCALE)
        out, lse = kernel.forward(q, k, v, False, SCALE, slices=slices)
        grads = kernel.backward(dout, q, k, v, out, lse, False, SCALE, slices=slices)
        for got, ref, what in zip((out, lse, *grads), want, ("out", "lse", "dq", "dk", "dv")):
            assert got.shape == ref.shape, (name, what)
            err = (got.double() - ref).abs().max().item()
            assert err <= 0.05 * max(1.0, ref.abs().max().item()), (name, what, err)
