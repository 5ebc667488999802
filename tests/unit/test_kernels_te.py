"""The Transformer Engine tile kernel.

Part 1 runs anywhere: the module imports without TE, and the keyword arguments built for
each TE version are exactly ones that version's `fused_attn_fwd` / `fused_attn_bwd` accept.
The parameter names of every release are data in tests/te_releases.py.

Part 2 needs CUDA and TE: TEFusedKernel against torch SDPA (out, lse, dq, dk, dv), and the
"global out / lse" property that makes tile gradients exact partial sums.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import math
import sys

import pytest
import torch
from te_releases import AP_NEEDED, ATTENTION_PARAMS, BACKEND, FWD_REQUIRED, RELEASES, SIGNATURES, TE_BF16

from megatron_mesh.kernels import te_fused
from megatron_mesh.kernels.te_fused import TEFusedKernel
from megatron_mesh.kernels.te_kwargs import bwd_kwargs, fwd_kwargs


def _tile(sq=8, sk=4, b=2, hq=4, hkv=2, d=16, dtype=torch.bfloat16):
    q = torch.randn(sq, b, hq, d, dtype=dtype)
    k, v = torch.randn(2, sk, b, hkv, d, dtype=dtype)
    return q, k, v


def _build(release: str, causal: bool, signature: tuple | None = None):
    """The kwargs built for the signature of `release` (or the given (fwd, bwd) parameters)."""
    fwd_params, bwd_params = signature or SIGNATURES[RELEASES[release]][:2]
    q, k, v = _tile()
    cu_q = torch.arange(0, 3 * 8, 8, dtype=torch.int32)
    cu_kv = torch.arange(0, 3 * 4, 4, dtype=torch.int32)
    fwd = fwd_kwargs(fwd_params, q, k, v, cu_q, cu_kv, causal, 0.25, BACKEND)
    aux = [torch.zeros(2, 4, 8, 1), torch.zeros(2, dtype=torch.int64)]
    bwd = bwd_kwargs(
        bwd_params, q, q, k, v, q, aux, cu_q, cu_kv, causal, 0.25, BACKEND, TE_BF16,
        deterministic=True,
    )
    return fwd, bwd, (q, k, v, aux)


# ---------------------------------------------------------------- part 1: no TE needed


@pytest.mark.skipif(
    importlib.util.find_spec("transformer_engine") is not None, reason="TE is installed here"
)
def test_imports_without_te():
    assert te_fused.te_version() is None
    assert te_fused.is_available() is False
    assert "transformer_engine" not in sys.modules
    assert TEFusedKernel().name == "te"


@pytest.mark.parametrize("release", sorted(RELEASES))
@pytest.mark.parametrize("causal", [False, True])
def test_kwargs_match_real_signature(release: str, causal: bool):
    fwd_params, bwd_params, bwd_required = SIGNATURES[RELEASES[release]]
    fwd, bwd, _ = _build(release, causal)
    assert set(fwd) <= set(fwd_params), set(fwd) - set(fwd_params)
    assert set(FWD_REQUIRED) <= set(fwd), set(FWD_REQUIRED) - set(fwd)
    assert set(bwd) <= set(bwd_params), set(bwd) - set(bwd_params)
    assert set(bwd_required) <= set(bwd), set(bwd_required) - set(bwd)


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_kwargs_values(release: str):
    sig = RELEASES[release]
    fwd, bwd, (q, k, v, aux) = _build(release, causal=True)
    for kw in (fwd, bwd):
        assert kw["qkv_layout"] == "sbhd_sbhd_sbhd"
        # causal with sq != sk: aligned at the bottom right, as every tile kernel's causal
        assert kw["attn_mask_type"] == "causal_bottom_right" and kw["window_size"] == (-1, 0)
        assert kw["attn_bias_type"] == "no_bias" and kw["dropout"] == 0.0
        assert kw["attn_scale"] == 0.25 and kw["fused_attention_backend"] is BACKEND
        assert (kw["max_seqlen_q"], kw["max_seqlen_kv"]) == (8, 4)
        assert kw["q"] is q and kw["k"] is k and kw["v"] is v
        assert kw["fake_dtype"] == torch.bfloat16
    assert fwd["is_training"] is True  # TE returns the lse only when training
    assert bwd["aux_ctx_tensors"][0] is aux[0] and bwd["aux_ctx_tensors"][1] is aux[1]
    assert bwd["deterministic"] is True
    assert ("dqkv_dtype" in bwd) == (sig in ("2.1", "2.2", "2.8", "2.9", "2.10", "2.12"))
    if "dqkv_dtype" in bwd:
        assert bwd["dqkv_dtype"] is TE_BF16
    assert ("softmax_type" in fwd) == ("softmax_type" in bwd) == (sig not in ("2.1", "2.2"))
    assert fwd.get("softmax_type", "vanilla") == bwd.get("softmax_type", "vanilla") == "vanilla"
    # 2.9+: return_max_logit=True would change what fused_attn_fwd returns
    assert ("return_max_logit" in fwd) == (sig not in ("2.1", "2.2", "2.8"))
    assert fwd.get("return_max_logit", False) is False
    assert ("cuda_graph" in fwd) == ("cuda_graph" in bwd) == (sig in ("2.10", "2.12", "2.15"))
    if sig == "2.15":  # the defaults (dqkv_layout "sbh3d") would be wrong for us
        assert bwd["dqkv_layout"] == "sbhd_sbhd_sbhd"
        assert bwd["o_format"] == bwd["do_format"] == fwd["o_format"] == "sbhd"
    if "bottom_right_diagonal" in fwd:
        assert fwd["bottom_right_diagonal"] is True and bwd["bottom_right_diagonal"] is True
    nomask, _, _ = _build(release, causal=False)
    assert nomask["attn_mask_type"] == "no_mask" and nomask["window_size"] == (-1, -1)
    assert nomask.get("bottom_right_diagonal", False) is False
    square = fwd_kwargs(SIGNATURES[sig][0], q, q, q, *[torch.arange(0, 24, 8, dtype=torch.int32)] * 2,
                        True, 0.25, BACKEND)
    assert square["attn_mask_type"] == "causal" and square.get("bottom_right_diagonal", False) is False


def test_version_parsing():
    assert te_fused.minor_version("2.10.0.dev0+g1234abc") == (2, 10)
    assert te_fused.minor_version("2.15.0") == (2, 15)
    for bad in ("1.13.0", "2.0.0", "not-a-version"):
        with pytest.raises(ValueError, match="Transformer Engine"):
            te_fused.minor_version(bad)


def test_kwargs_follow_the_signature_not_the_version():
    """A mid-cycle dev build (here: 2.14's functions with 2.15's new bwd parameters and
    without `dqkv_dtype`, fwd without `return_max_logit`) gets what its functions take."""
    fwd_params = [n for n in SIGNATURES["2.12"][0] if n != "return_max_logit"]
    bwd_params = [n for n in SIGNATURES["2.12"][1] if n != "dqkv_dtype"] + [
        "do_format", "dqkv_layout"]
    fwd, bwd, _ = _build("dev", causal=True, signature=(fwd_params, bwd_params))
    assert set(fwd) <= set(fwd_params) and set(bwd) <= set(bwd_params)
    assert "return_max_logit" not in fwd and "o_format" not in fwd
    assert "dqkv_dtype" not in bwd and bwd["dqkv_layout"] == "sbhd_sbhd_sbhd"
    assert bwd["do_format"] == "sbhd" and bwd["bottom_right_diagonal"] is True  # 8 x 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_te_inputs_fall_back_to_torch(dtype):
    """CPU tensors (and fp32 anywhere) go to the torch kernel: still exact."""
    torch.manual_seed(0)
    q, k, v = _tile(sq=16, sk=16, b=2, hq=4, hkv=2, d=16, dtype=dtype)
    kern = TEFusedKernel()
    out, lse = kern.forward(q, k, v, True, 0.3)
    ref_out, ref_lse = _reference(q.float(), k.float(), v.float(), True, 0.3)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, ref_lse, atol=tol, rtol=tol)
    dout = torch.randn_like(q)
    dq, dk, dv = kern.backward(dout, q, k, v, out, lse, True, 0.3)
    ref = _grads(lambda a, b, c: _reference(a, b, c, True, 0.3)[0],
                 q.float(), k.float(), v.float(), dout.float())
    for got, want in zip((dq, dk, dv), ref[1:]):
        assert got.shape == want.shape and got.dtype == dtype
        torch.testing.assert_close(got.float(), want, atol=tol * 4, rtol=tol * 4)




@pytest.mark.parametrize("release", sorted(ATTENTION_PARAMS))
@pytest.mark.parametrize("causal", [False, True])
def test_backend_query_params_match_real_fields(release: str, causal: bool):
    fields = ATTENTION_PARAMS[release]
    spec = te_fused.TileSpec(torch.bfloat16, 2, 16, 4, 2048, 1024, 128, causal, False, False)
    kw = te_fused.attention_params(fields, spec)
    assert set(kw) <= set(fields), set(kw) - set(fields)
    assert AP_NEEDED <= set(kw), AP_NEEDED - set(kw)
    assert (kw["num_heads"], kw["num_gqa_groups"], kw["head_dim_qk"]) == (16, 4, 128)
    assert (kw["max_seqlen_q"], kw["max_seqlen_kv"], kw["batch_size"]) == (2048, 1024, 2)
    assert kw["qkv_layout"] == "sbhd_sbhd_sbhd" and kw["qkv_dtype"] == torch.bfloat16
    assert (kw["attn_mask_type"], kw["window_size"]) == (  # 2048 x 1024: bottom right
        ("causal_bottom_right", (-1, 0)) if causal else ("no_mask", (-1, -1)))
    if "bottom_right_diagonal" in fields:
        assert kw["bottom_right_diagonal"] is causal
    square = te_fused.attention_params(fields, dataclasses.replace(spec, sk=2048))
    assert square["attn_mask_type"] == ("causal" if causal else "no_mask")
    assert square.get("bottom_right_diagonal", False) is False


def test_fused_backend_read_from_both_result_shapes():
    """get_attention_backend returns 5 values in 2.1, 6 from 2.2 (flash_attention_backend
    added second); the fused sub-backend is third from the end in both."""
    five = (False, True, 1, False, [False, True, True])
    six = (True, "fa2", False, 1, False, [True, True, True])
    assert te_fused.fused_backend_of(five) == 1 and te_fused.fused_backend_of(six) == 1
    assert te_fused.fused_backend_of((True, "fa2", False, None, False, [True, False, True])) is None


# ------------------------------------------- V of its own head dim (multi-latent attention)

D_QK, D_V = 24, 16  # dv != d: TE takes V's head dim from v (the output and dV follow it)


def _mla_tile(dtype=torch.bfloat16):
    q = torch.randn(8, 2, 4, D_QK, dtype=dtype)
    k = torch.randn(4, 2, 2, D_QK, dtype=dtype)
    v = torch.randn(4, 2, 2, D_V, dtype=dtype)
    out = torch.randn(8, 2, 4, D_V, dtype=dtype)
    return q, k, v, out


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_kwargs_with_v_head_dim_match_real_signature(release: str):
    """q, k of head dim d and v, out, dout of dv go to fused_attn_fwd / _bwd as they are
    (separate tensors in "sbhd_sbhd_sbhd"): the argument lists are each release's."""
    fwd_params, bwd_params, bwd_required = SIGNATURES[RELEASES[release]]
    q, k, v, out = _mla_tile()
    cu_q = torch.arange(0, 3 * 8, 8, dtype=torch.int32)
    cu_kv = torch.arange(0, 3 * 4, 4, dtype=torch.int32)
    fwd = fwd_kwargs(fwd_params, q, k, v, cu_q, cu_kv, True, 0.25, BACKEND)
    aux = [torch.zeros(2, 4, 8, 1), torch.zeros(2, dtype=torch.int64)]
    bwd = bwd_kwargs(bwd_params, out, q, k, v, out, aux, cu_q, cu_kv, True, 0.25, BACKEND,
                     TE_BF16)
    assert set(fwd) <= set(fwd_params) and set(FWD_REQUIRED) <= set(fwd)
    assert set(bwd) <= set(bwd_params) and set(bwd_required) <= set(bwd)
    for kw in (fwd, bwd):
        assert kw["qkv_layout"] == "sbhd_sbhd_sbhd"  # TE's MLA needs separate q, k, v
        assert kw["q"].shape[-1] == kw["k"].shape[-1] == D_QK and kw["v"].shape[-1] == D_V
    assert bwd["o"].shape[-1] == bwd["d_o"].shape[-1] == D_V


@pytest.mark.parametrize("release", sorted(ATTENTION_PARAMS))
@pytest.mark.parametrize("dv", [D_QK, D_V])
def test_backend_query_carries_head_dim_v(release: str, dv: int):
    """TE's query is told V's head dim, read from v's last dim (not Q's)."""
    q, k, v, _ = _mla_tile()
    v = v[..., :1].expand(*v.shape[:-1], dv)
    spec = te_fused.tile_spec(q, k, v, True, False, False)
    assert (spec.head_dim, spec.v_dim) == (D_QK, dv)
    kw = te_fused.attention_params(ATTENTION_PARAMS[release], spec)
    assert (kw["head_dim_qk"], kw["head_dim_v"]) == (D_QK, dv)
    assert (kw["num_heads"], kw["num_gqa_groups"], kw["max_seqlen_q"]) == (4, 2, 8)


def _stub_te(monkeypatch, fields, answer):
    """te_fused._load replaced by TE's pieces as stand-ins: AttentionParams a dataclass of
    a release's `fields`, get_attention_backend recording what it is asked and answering
    `answer(params)`."""
    import dataclasses
    import types

    asked = []
    params_cls = dataclasses.make_dataclass(
        "AttentionParams", [(n, object, dataclasses.field(default=None)) for n in fields])

    def get_attention_backend(params):
        asked.append(params)
        fused = answer(params)
        return (False, None, fused, 1 if fused else None, False, [False, fused, False])

    selection = types.SimpleNamespace(AttentionParams=params_cls,
                                      get_attention_backend=get_attention_backend)
    stub = te_fused._TE("2.20.2", None, 1, {}, selection, lambda: (9, 10, 0))
    monkeypatch.setattr(te_fused, "_load", lambda: stub)
    return asked


def test_te_rejects_asks_with_head_dim_v(monkeypatch):
    """TE's own query decides MLA tiles: asked with head_dim_v = dv; its refusal is
    named (and the kernel then runs the tile on its fallback)."""
    mla_ok = [True]
    asked = _stub_te(monkeypatch, ATTENTION_PARAMS["2.20.2"],
                     lambda p: p.head_dim_qk == p.head_dim_v or mla_ok[0])
    q, k, v, _ = _mla_tile()
    spec = te_fused.tile_spec(q, k, v, False, False, False)
    assert te_fused.te_rejects(spec) is None
    assert (asked[-1].head_dim_qk, asked[-1].head_dim_v) == (D_QK, D_V)
    assert asked[-1].qkv_layout == "sbhd_sbhd_sbhd"
    mla_ok[0] = False
    why = te_fused.te_rejects(spec)
    assert why is not None and f"heads of {D_QK} (V {D_V})" in why
    same = te_fused.tile_spec(q, k, k, False, False, False)
    assert te_fused.te_rejects(same) is None and asked[-1].head_dim_v == D_QK


def test_te_without_head_dim_v_field_is_not_asked_about_mla(monkeypatch):
    fields = [n for n in ATTENTION_PARAMS["2.20.2"] if n != "head_dim_v"]
    asked = _stub_te(monkeypatch, fields, lambda p: True)
    q, k, v, _ = _mla_tile()
    why = te_fused.te_rejects(te_fused.tile_spec(q, k, v, True, False, False))
    assert "no head_dim_v" in why and not asked


# ---------------------------------------------------------------- references


def _expand(t: torch.Tensor, groups: int) -> torch.Tensor:
    """[s, b, hkv, d] -> [s, b, hkv * groups, d]."""
    return t.repeat_interleave(groups, dim=2)


def _reference(q, k, v, causal: bool, scale: float):
    """fp32 attention on [s, b, h, d] with GQA: (out [sq, b, hq, d], lse [b, hq, sq])."""
    g = q.shape[2] // k.shape[2]
    qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, _expand(k, g), _expand(v, g)))
    scores = scale * qb @ kb.transpose(-1, -2)
    if causal:  # aligned at the bottom right: query i sees key j <= i + sk - sq
        keep = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device).tril(
            k.shape[0] - q.shape[0])
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.softmax(scores, dim=-1) @ vb
    return out.permute(2, 0, 1, 3), lse


def _sdpa(q, k, v, causal: bool, scale: float) -> torch.Tensor:
    """torch SDPA on [s, b, h, d] in q's dtype (GQA by expanding K/V)."""
    g = q.shape[2] // k.shape[2]
    qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, _expand(k, g), _expand(v, g)))
    keep = None
    if causal:  # bottom right, as `_reference`
        keep = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device).tril(
            k.shape[0] - q.shape[0])
    out = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, attn_mask=keep,
                                                           scale=scale)
    return out.permute(2, 0, 1, 3)


def _grads(fn, q, k, v, dout):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _merge(o1, l1, o2, l2):
    """Log-sum-exp merge of two partials: o [s, b, h, d], l [b, h, s] -> fp32 (o, l)."""
    lse = torch.logaddexp(l1, l2)
    w1 = torch.exp(l1 - lse).permute(2, 0, 1).unsqueeze(-1)
    w2 = torch.exp(l2 - lse).permute(2, 0, 1).unsqueeze(-1)
    return o1.float() * w1 + o2.float() * w2, lse


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def _check(got, ref_fp32, ref_same_dtype, what: str):
    """got within 2x the same-dtype SDPA error against fp32 (plus a small floor)."""
    bound = 2 * _err(ref_same_dtype, ref_fp32) + 1e-3 * max(1.0, ref_fp32.abs().max().item())
    assert _err(got, ref_fp32) <= bound, f"{what}: {_err(got, ref_fp32):.3e} > {bound:.3e}"


# ---------------------------------------------------------------- part 2: CUDA + TE

needs_te = pytest.mark.skipif(
    te_fused.te_version() is None or not torch.cuda.is_available() or not te_fused.is_available(),
    reason="needs a GPU and Transformer Engine "
    f"(CUDA {'yes' if torch.cuda.is_available() else 'no'}, TE {te_fused.te_version()})",
)
DTYPES = [torch.bfloat16, torch.float16]
HEADS = [(8, 8), (8, 2), (8, 1)]  # MHA, GQA, MQA


def _cuda_tile(sq, sk, b, hq, hkv, d, dtype, seed=0, dv=None):
    dv = d if dv is None else dv
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(sq, b, hq, d, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(sk, b, hkv, d, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(sk, b, hkv, dv, device="cuda", dtype=dtype, generator=gen)
    dout = torch.randn(sq, b, hq, dv, device="cuda", dtype=dtype, generator=gen)
    return q, k, v, dout


@pytest.mark.gpu
@needs_te
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("causal,sq,sk,d", [(True, 256, 256, 64), (False, 256, 128, 64),
                                             (False, 128, 256, 128), (True, 128, 128, 128),
                                             (True, 128, 384, 64)])  # causal_bottom_right
def test_te_matches_sdpa(dtype, heads, causal, sq, sk, d):
    hq, hkv = heads
    q, k, v, dout = _cuda_tile(sq, sk, 2, hq, hkv, d, dtype)
    scale = 1.0 / math.sqrt(d)
    kern = TEFusedKernel()

    out, lse = kern.forward(q, k, v, causal, scale)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (2, hq, sq) and lse.dtype == torch.float32
    dq, dk, dv = kern.backward(dout, q, k, v, out, lse, causal, scale)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert dq.dtype == dk.dtype == dv.dtype == dtype

    f32 = [t.float() for t in (q, k, v)]
    ref = _grads(lambda a, b, c: _reference(a, b, c, causal, scale)[0], *f32, dout.float())
    ref_lse = _reference(*f32, causal, scale)[1]
    same = _grads(lambda a, b, c: _sdpa(a, b, c, causal, scale), q, k, v, dout)
    for name, got, r, s in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), ref, same):
        _check(got, r, s, name)
    torch.testing.assert_close(lse, ref_lse, atol=2e-3, rtol=1e-3)


@pytest.mark.gpu
@needs_te
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(8, 8), (8, 2)])
@pytest.mark.parametrize("causal,sq,sk,d,dv", [(True, 256, 256, 192, 128),
                                                (False, 256, 128, 128, 64)])
def test_te_v_head_dim_matches_sdpa(dtype, heads, causal, sq, sk, d, dv):
    """Multi-latent attention's dv != d on TE itself (skipped, saying why, where TE's own
    query turns the tile down on this GPU / cuDNN): out [sq, b, hq, dv], dv [sk, b, hkv, dv]."""
    hq, hkv = heads
    q, k, v, dout = _cuda_tile(sq, sk, 2, hq, hkv, d, dtype, dv=dv)
    why = te_fused.te_rejects(te_fused.tile_spec(q, k, v, causal, False, False))
    if why is not None:
        pytest.skip(why)
    scale = 1.0 / math.sqrt(d)
    kern = TEFusedKernel(deterministic=False)
    out, lse = kern.forward(q, k, v, causal, scale)
    assert all(kern._takes.values()), "the tile ran on the fallback, not TE"
    assert out.shape == (sq, 2, hq, dv) and out.dtype == dtype
    dq, dk, dvv = kern.backward(dout, q, k, v, out, lse, causal, scale)
    assert (dq.shape, dk.shape, dvv.shape) == (q.shape, k.shape, v.shape)
    f32 = [t.float() for t in (q, k, v)]
    ref = _grads(lambda a, b, c: _reference(a, b, c, causal, scale)[0], *f32, dout.float())
    same = _grads(lambda a, b, c: _sdpa(a, b, c, causal, scale), q, k, v, dout)
    for name, got, r, s in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dvv), ref, same):
        _check(got, r, s, name)
    torch.testing.assert_close(lse, _reference(*f32, causal, scale)[1], atol=2e-3, rtol=1e-3)


@pytest.mark.gpu
@needs_te
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
def test_te_global_out_lse_gives_partial_sums(dtype, heads):
    """Non-causal: two tiles over the halves of K/V, merged == one call; backward given
    the global out / lse returns dq summands and the dk / dv halves."""
    hq, hkv = heads
    s, d = 256, 64
    q, k, v, dout = _cuda_tile(s, s, 2, hq, hkv, d, dtype, seed=1)
    scale = 0.125
    kern = TEFusedKernel()
    out, lse = kern.forward(q, k, v, False, scale)
    h = s // 2
    o1, l1 = kern.forward(q, k[:h], v[:h], False, scale)
    o2, l2 = kern.forward(q, k[h:], v[h:], False, scale)
    merged, merged_lse = _merge(o1, l1, o2, l2)
    torch.testing.assert_close(merged_lse, lse, atol=2e-3, rtol=1e-3)

    f32 = [t.float() for t in (q, k, v)]
    ref = _grads(lambda a, b, c: _reference(a, b, c, False, scale)[0], *f32, dout.float())
    same = _grads(lambda a, b, c: _sdpa(a, b, c, False, scale), q, k, v, dout)
    _check(merged, ref[0], same[0], "merged out")

    dq1, dk1, dv1 = kern.backward(dout, q, k[:h], v[:h], out, lse, False, scale)
    dq2, dk2, dv2 = kern.backward(dout, q, k[h:], v[h:], out, lse, False, scale)
    _check(dq1.float() + dq2.float(), ref[1], same[1], "dq partial sum")
    _check(torch.cat([dk1, dk2]), ref[2], same[2], "dk halves")
    _check(torch.cat([dv1, dv2]), ref[3], same[3], "dv halves")


@pytest.mark.gpu
@needs_te
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
def test_te_causal_row_from_two_tiles(dtype, heads):
    """Causal, the rows of the second half of Q: an unmasked tile against the first half of
    K/V plus a causal tile against the second half equal the full causal attention rows."""
    hq, hkv = heads
    s, d = 256, 64
    q, k, v, dout = _cuda_tile(s, s, 2, hq, hkv, d, dtype, seed=2)
    scale = 1.0 / math.sqrt(d)
    h = s // 2
    kern = TEFusedKernel()
    out, lse = kern.forward(q, k, v, True, scale)
    q2, out2, lse2, dout2 = q[h:], out[h:], lse[:, :, h:], dout[h:].contiguous()

    oa, la = kern.forward(q2, k[:h], v[:h], False, scale)
    ob, lb = kern.forward(q2, k[h:], v[h:], True, scale)
    merged, merged_lse = _merge(oa, la, ob, lb)
    torch.testing.assert_close(merged_lse, lse2, atol=2e-3, rtol=1e-3)

    f32 = [t.float() for t in (q, k, v)]
    dout_rows = torch.zeros_like(dout)
    dout_rows[h:] = dout2
    ref = _grads(lambda a, b, c: _reference(a, b, c, True, scale)[0], *f32, dout_rows.float())
    same = _grads(lambda a, b, c: _sdpa(a, b, c, True, scale), q, k, v, dout_rows)
    _check(merged, ref[0][h:], same[0][h:], "merged out")

    dqa, dka, dva = kern.backward(dout2, q2, k[:h], v[:h], out2, lse2, False, scale)
    dqb, dkb, dvb = kern.backward(dout2, q2, k[h:], v[h:], out2, lse2, True, scale)
    _check(dqa.float() + dqb.float(), ref[1][h:], same[1][h:], "dq partial sum")
    _check(torch.cat([dka, dkb]), ref[2], same[2], "dk")
    _check(torch.cat([dva, dvb]), ref[3], same[3], "dv")
