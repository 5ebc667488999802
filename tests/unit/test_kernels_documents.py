"""Tile kernels over packed documents (a call's `TileSlices` of form documents), TE's and torch's.

Part 1 runs anywhere: the keyword arguments built for a "thd" tile are ones TE's real
`fused_attn_fwd` / `fused_attn_bwd` accept at every release read (signatures kept as data
in test_kernels_te.py), TE's backend query is asked with the thd layout and padding masks,
TE's thd softmax stats convert exactly to and from our lse [1, hq, t], and tiles TE cannot
run go to the torch kernel's documents path.

Part 2 needs CUDA (`gpu`): torch's CUDA documents path (varlen flash for fp16 / bf16, the
memory-efficient op with a mask for fp32) against its CPU path in fp32; with TE as well,
TE's documents tile against torch's, and `thd_partition_indices` against TE's
`thd_get_partitioned_indices`.
"""
from __future__ import annotations

import math

import pytest
import torch
from attention_ops import AttentionOps
from te_releases import ATTENTION_PARAMS, BACKEND, FWD_REQUIRED, RELEASES, SIGNATURES, TE_BF16

from megatron_mesh.calls.layout import AttentionMask, block_for
from megatron_mesh.calls.tile_slices import TileSlices
from megatron_mesh.kernels import (
    Choice,
    TorchFlashKernel,
    build,
    get_kernel,
    te_fused,
)
from megatron_mesh.kernels.te_fused import TEFusedKernel
from megatron_mesh.kernels.te_kwargs import thd_bwd_kwargs, thd_fwd_kwargs
from megatron_mesh.kernels.te_stats import lse_from_te, lse_to_te
from megatron_mesh.masks.documents import Documents, thd_partition_indices

# ---------------------------------------------------------------- part 1: no TE, no GPU

# documents of 3, 1 and 5 query rows (2, 4, 5 key rows where not causal)
CU_Q, CU_KV = (0, 3, 4, 9), (0, 2, 6, 11)


def _documents(cu_q: tuple[int, ...], cu_kv: tuple[int, ...]) -> TileSlices:
    """Documents of a call on the CPU (their bounds; the causal flag goes to TE apart)."""
    return TileSlices.documents(cu_q, cu_kv, False, torch.device("cpu"))


def _thd_build(release: str, causal: bool, signature: tuple | None = None):
    fwd_params, bwd_params = signature or SIGNATURES[RELEASES[release]][:2]
    cu_kv = CU_Q if causal else CU_KV
    documents = _documents(CU_Q, cu_kv)
    q = torch.randn(CU_Q[-1], 4, 16, dtype=torch.bfloat16)
    k, v = torch.randn(2, cu_kv[-1], 2, 16, dtype=torch.bfloat16)
    fwd = thd_fwd_kwargs(fwd_params, q, k, v, documents, causal, 0.25, BACKEND)
    aux = [torch.zeros(CU_Q[-1], 4, 1), torch.zeros(2, dtype=torch.int64)]
    bwd = thd_bwd_kwargs(bwd_params, q, q, k, v, q, aux, documents, causal, 0.25, BACKEND,
                         TE_BF16, deterministic=True)
    return fwd, bwd, documents, (q, k, v, aux)


@pytest.mark.parametrize("release", sorted(RELEASES))
@pytest.mark.parametrize("causal", [False, True])
def test_thd_kwargs_match_real_signature(release: str, causal: bool) -> None:
    fwd_params, bwd_params, bwd_required = SIGNATURES[RELEASES[release]]
    fwd, bwd, _, _ = _thd_build(release, causal)
    assert set(fwd) <= set(fwd_params), set(fwd) - set(fwd_params)
    assert set(FWD_REQUIRED) <= set(fwd), set(FWD_REQUIRED) - set(fwd)
    assert set(bwd) <= set(bwd_params), set(bwd) - set(bwd_params)
    assert set(bwd_required) <= set(bwd), set(bwd_required) - set(bwd)


@pytest.mark.parametrize("release", sorted(RELEASES))
@pytest.mark.parametrize("causal", [False, True])
def test_thd_kwargs_values(release: str, causal: bool) -> None:
    sig = RELEASES[release]
    fwd, bwd, documents, (q, k, v, aux) = _thd_build(release, causal)
    mask = ("padding_causal", (-1, 0)) if causal else ("padding", (-1, -1))
    for kw in (fwd, bwd):
        assert kw["qkv_layout"] == "thd_thd_thd"
        assert (kw["attn_mask_type"], kw["window_size"]) == mask
        assert kw["cu_seqlens_q"] is documents.cu_q_tensor
        assert kw["cu_seqlens_kv"] is documents.cu_kv_tensor
        # the rows of each document are contiguous: offsets = bounds
        assert kw["cu_seqlens_q_padded"] is documents.cu_q_tensor
        assert kw["cu_seqlens_kv_padded"] is documents.cu_kv_tensor
        assert (kw["max_seqlen_q"], kw["max_seqlen_kv"]) == (5, 5)
        assert kw["q"] is q and kw["k"] is k and kw["v"] is v and q.dim() == 3
        assert kw["attn_bias_type"] == "no_bias" and kw["dropout"] == 0.0
        assert kw["attn_scale"] == 0.25 and kw["fused_attention_backend"] is BACKEND
        assert kw.get("bottom_right_diagonal", False) is False
    assert fwd["is_training"] is True and fwd.get("return_max_logit", False) is False
    assert bwd["aux_ctx_tensors"][0] is aux[0] and bwd["deterministic"] is True
    if sig == "2.15":  # the sbhd / packed-dQKV defaults would be wrong here
        assert fwd["o_format"] == bwd["o_format"] == bwd["do_format"] == "thd"
        assert bwd["dqkv_layout"] == "thd_thd_thd"
    else:
        assert not {"o_format", "do_format", "dqkv_layout"} & (set(fwd) | set(bwd))


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_thd_kwargs_with_v_head_dim(release: str) -> None:
    """Packed documents with V of its own head dim (multi-latent attention): q, k [t, h, d],
    v, out, dout [t, h, dv] go to TE's "thd_thd_thd" call as they are, in each release's
    argument lists; the backend query is asked with head_dim_v = dv."""
    fwd_params, bwd_params, bwd_required = SIGNATURES[RELEASES[release]]
    documents = _documents(CU_Q, CU_KV)
    q = torch.randn(CU_Q[-1], 4, 24, dtype=torch.bfloat16)
    k = torch.randn(CU_KV[-1], 2, 24, dtype=torch.bfloat16)
    v = torch.randn(CU_KV[-1], 2, 16, dtype=torch.bfloat16)
    out = torch.randn(CU_Q[-1], 4, 16, dtype=torch.bfloat16)
    fwd = thd_fwd_kwargs(fwd_params, q, k, v, documents, False, 0.25, BACKEND)
    aux = [torch.zeros(CU_Q[-1], 4, 1), torch.zeros(2, dtype=torch.int64)]
    bwd = thd_bwd_kwargs(bwd_params, out, q, k, v, out, aux, documents, False, 0.25, BACKEND,
                         TE_BF16)
    assert set(fwd) <= set(fwd_params) and set(FWD_REQUIRED) <= set(fwd)
    assert set(bwd) <= set(bwd_params) and set(bwd_required) <= set(bwd)
    for kw in (fwd, bwd):
        assert kw["qkv_layout"] == "thd_thd_thd" and kw["v"] is v and kw["k"] is k
    assert bwd["o"] is out and bwd["d_o"] is out
    spec = te_fused.tile_spec(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), False, False,
                              False, documents)
    for fields in ATTENTION_PARAMS.values():
        kw = te_fused.attention_params(fields, spec)
        assert (kw["head_dim_qk"], kw["head_dim_v"]) == (24, 16)
        assert kw["qkv_layout"] == "thd_thd_thd" and kw["batch_size"] == 3


def test_thd_max_seqlen_is_the_longest_document() -> None:
    documents = _documents((0, 2, 9), (0, 6, 7))
    q = torch.randn(9, 4, 16)
    kv = torch.randn(7, 2, 16)
    kw = thd_fwd_kwargs(SIGNATURES["2.10"][0], q, kv, kv, documents, False, 0.5, BACKEND)
    assert (kw["max_seqlen_q"], kw["max_seqlen_kv"]) == (7, 6)


@pytest.mark.parametrize("release", sorted(ATTENTION_PARAMS))
@pytest.mark.parametrize("causal", [False, True])
def test_thd_backend_query_params(release: str, causal: bool) -> None:
    fields = ATTENTION_PARAMS[release]
    documents = _documents((0, 300, 301, 1000), (0, 300, 301, 1000))
    spec = te_fused.TileSpec.of_documents(torch.bfloat16, 16, 4, 128, documents, causal,
                                          False, False)
    kw = te_fused.attention_params(fields, spec)
    assert set(kw) <= set(fields), set(kw) - set(fields)
    assert kw["qkv_layout"] == "thd_thd_thd" and kw["batch_size"] == 3
    assert (kw["max_seqlen_q"], kw["max_seqlen_kv"]) == (699, 699)
    assert (kw["attn_mask_type"], kw["window_size"]) == (
        ("padding_causal", (-1, 0)) if causal else ("padding", (-1, -1)))
    assert kw["pad_between_seqs"] is False  # a field in every release read
    if "num_tokens_q" in fields:
        assert (kw["num_tokens_q"], kw["num_tokens_kv"]) == (1000, 1000)
    dense = te_fused.attention_params(fields, te_fused.TileSpec(
        torch.bfloat16, 2, 16, 4, 1000, 1000, 128, causal, False, False))
    assert dense["qkv_layout"] == "sbhd_sbhd_sbhd" and "pad_between_seqs" not in dense


def test_packed_stats_rule() -> None:
    """TE's rule for its thd softmax stats: per token from cuDNN 9.6, except sm120 from 2.14."""
    rule = te_fused.packed_stats
    assert rule((2, 10), (9, 6, 0), (9, 0)) and rule((2, 1), (9, 10, 2), (12, 0))
    assert not rule((2, 10), (9, 5, 1), (9, 0)) and not rule((2, 18), (8, 9, 7), (8, 0))
    assert not rule((2, 14), (9, 8, 0), (12, 0)) and rule((2, 14), (9, 8, 0), (12, 1))


def test_stats_rows() -> None:
    """Before 2.11 TE rounds per-token stats rows up (1024; powers of two to 32K; 32K steps)."""
    rows = te_fused.stats_rows
    assert [rows((2, 10), t) for t in (1, 1024, 1025, 4096, 32768, 32769, 70000)] == [
        1024, 1024, 2048, 4096, 32768, 65536, 98304]
    assert [rows((2, 11), t) for t in (1, 1025, 70000)] == [1, 1025, 70000]


# query rows 0-2: document 0 at 0-2; row 3: document 1 at 0; rows 4-8: document 2 at 0-4
HAND_LSE = torch.tensor([[[0, 1, 2, 100, 200, 201, 202, 203, 204],
                          [10, 11, 12, 110, 210, 211, 212, 213, 214]]], dtype=torch.float32)


def _per_document_stats() -> torch.Tensor:
    """[3 documents, 2 heads, 6 rows, 1]: 100 * document + 10 * head + position, NaN where
    no query row is (past a document's end)."""
    stats = torch.full((3, 2, 6, 1), float("nan"))
    for doc, n in enumerate((3, 1, 5)):
        for h in range(2):
            stats[doc, h, :n, 0] = torch.arange(n) + 100 * doc + 10 * h
    return stats


def _per_token_stats(rows: int) -> torch.Tensor:
    stats = torch.full((rows, 2, 1), float("nan"))
    stats[:9, :, 0] = HAND_LSE[0].t()
    return stats


def test_lse_from_te_by_hand() -> None:
    documents = _documents(CU_Q, CU_Q)
    for stats in (_per_document_stats(), _per_token_stats(1024), _per_token_stats(9)):
        got = lse_from_te(stats, documents)
        assert got.shape == (1, 2, 9) and got.dtype == torch.float32 and got.is_contiguous()
        assert torch.equal(got, HAND_LSE), (stats.shape, got)


def test_lse_to_te_by_hand() -> None:
    documents = _documents(CU_Q, CU_Q)
    per_doc = lse_to_te(HAND_LSE, documents, packed=False)
    assert per_doc.shape == (3, 2, 5, 1) and per_doc.dtype == torch.float32
    assert torch.equal(per_doc, _per_document_stats()[:, :, :5].nan_to_num(0.0))
    per_token = lse_to_te(HAND_LSE, documents, packed=True, rows=1024)
    assert per_token.shape == (1024, 2, 1)
    assert torch.equal(per_token, _per_token_stats(1024).nan_to_num(0.0))
    assert lse_to_te(HAND_LSE, documents, packed=True).shape == (9, 2, 1)
    for packed in (False, True):  # and back
        assert torch.equal(lse_from_te(lse_to_te(HAND_LSE, documents, packed), documents),
                           HAND_LSE)


def test_te_kernel_takes_documents_and_falls_back_past_cudnn() -> None:
    kernel = build(Choice(("te", "cudnn", "flash", "efficient")))
    assert isinstance(kernel, TEFusedKernel) and kernel.caps.documents
    assert kernel._fallback.name == "cudnn"
    assert isinstance(kernel._documents_fallback, TorchFlashKernel)
    assert kernel._documents_fallback.flash
    no_flash = build(Choice(("te", "cudnn", "efficient")))
    assert not no_flash._documents_fallback.flash


def test_get_kernel_for_documents_passes_over_cudnn() -> None:
    """cuDNN's kernel takes packed documents, and hands them to the variable-length flash op
    where the choice has it (one call, not one per document; `kernels.build`)."""
    meta = torch.device("meta")
    assert get_kernel("auto", meta, torch.bfloat16, 64, documents=True).name == "torch"
    assert get_kernel("cudnn", meta, torch.bfloat16, 64).name == "cudnn"
    assert get_kernel("cudnn", meta, torch.bfloat16, 64, documents=True).name == "cudnn"
    kernel = build(Choice(("cudnn", "flash", "efficient")))
    q = torch.empty(8, 1, 4, 64, device=meta, dtype=torch.bfloat16)
    docs = TileSlices.documents((0, 3, 8), (0, 3, 8), True, meta)
    with AttentionOps() as ops:
        out, lse = kernel.forward(q, q, q, True, 0.25, slices=docs)
        kernel.backward(out, q, q, q, out, lse, True, 0.25, slices=docs)
    assert ops.names == {"_flash_attention_forward", "_flash_attention_backward"}
    assert build(Choice(("cudnn", "efficient"))).documents is None  # then one call each


def _tiles(lengths: tuple[int, ...], padded: tuple[int, ...], cp_size: int, causal: bool,
           device: str) -> list:
    """The blocks over packed documents of a CP group of `cp_size` (real rows only)."""
    cum = lambda xs: [sum(xs[:i]) for i in range(len(xs) + 1)]  # noqa: E731
    docs = Documents.from_cu_seqlens(torch.tensor(cum(lengths), dtype=torch.int32),
                                     torch.tensor(cum(padded), dtype=torch.int32))
    mask = AttentionMask(causal, docs, cp_size)
    local = docs.total // cp_size
    blocks = [block_for(x, y, local, mask, device) for x in range(cp_size)
              for y in range(cp_size)]
    return [(local, call) for b in blocks for call in b.calls]


def _rows(t: torch.Tensor, rows: slice | torch.Tensor) -> torch.Tensor:
    return t[rows] if isinstance(rows, slice) else t.index_select(0, rows)


def _inputs(local: int, hq: int, hkv: int, d: int, dtype: torch.dtype, device: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = {n: torch.randn(local, 1, h, d, generator=gen) for n, h in
         (("q", hq), ("k", hkv), ("v", hkv), ("dout", hq))}
    return {n: t.to(device=device, dtype=dtype) for n, t in x.items()}


def _tile_pass(kernel, x: dict, blk, scale: float, ref: dict | None = None) -> dict:
    """Forward, then backward given `ref`'s out / lse (the same for every kernel; its own
    without `ref`), of one block's gathered rows."""
    q, k, v = (_rows(x[n], r) for n, r in
               (("q", blk.q_rows), ("k", blk.kv_rows), ("v", blk.kv_rows)))
    dout = _rows(x["dout"], blk.q_rows)
    out, lse = kernel.forward(q, k, v, blk.causal, scale, slices=blk.slices)
    row_out = out if ref is None else ref["out"].to(device=q.device, dtype=q.dtype)
    row_lse = lse if ref is None else ref["lse"].to(q.device)
    dq, dk, dv = kernel.backward(dout, q, k, v, row_out, row_lse, blk.causal, scale,
                                 slices=blk.slices)
    return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


def test_te_kernel_documents_off_cuda_run_on_torch() -> None:
    """CPU tiles (TE needs CUDA) of packed documents go to the torch kernel's documents path."""
    for local, blk in _tiles((13, 4, 9), (16, 4, 12), 2, True, "cpu"):
        x = _inputs(local, 4, 2, 16, torch.float32, "cpu", seed=3)
        got = _tile_pass(TEFusedKernel(), x, blk, 0.25)
        want = _tile_pass(TorchFlashKernel(), x, blk, 0.25)
        for n in got:
            assert torch.equal(got[n], want[n]), n


# ---------------------------------------------------------------- part 2: CUDA

needs_te = pytest.mark.skipif(
    not (torch.cuda.is_available() and te_fused.is_available()),
    reason=f"needs a GPU and Transformer Engine ({te_fused.unavailable()})"
    if torch.cuda.is_available() else "needs a GPU and Transformer Engine (no CUDA)")

# (lengths, padded lengths, CP size): padded documents of 2P multiples, long beside short
DOCUMENTS = [((300, 61, 517, 7), (304, 64, 520, 8), 2),
             ((1000, 24, 3), (1000, 24, 4), 2),
             ((255, 130, 64, 17, 1), (256, 136, 64, 24, 8), 4)]


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double().cpu() - b.double().cpu()).abs().max().item()


def _reference(x: dict, blk, scale: float) -> dict:
    """The torch kernel's CPU documents path in fp32 (CPU flash op with the documents'
    additive mask), on the same values."""
    cpu = {n: t.float().cpu() for n, t in x.items()}
    cpu_rows = lambda r: r if isinstance(r, slice) else r.cpu()  # noqa: E731
    slices = None if blk.slices is None else TileSlices.documents(
        blk.slices.cu_q, blk.slices.cu_kv, blk.slices.causal, torch.device("cpu"))
    blk_cpu = type(blk)(cpu_rows(blk.q_rows), cpu_rows(blk.kv_rows), blk.causal, slices)
    return _tile_pass(TorchFlashKernel(), cpu, blk_cpu, scale)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", range(len(DOCUMENTS)))
def test_torch_cuda_documents_tile_matches_cpu_fp32(dtype: torch.dtype, causal: bool,
                                                    case: int) -> None:
    """Varlen flash (fp16 / bf16) and memory-efficient with a mask (fp32) against the CPU
    path in fp32, forward and backward (given the reference's out / lse), GQA 8 / 2."""
    lengths, padded, cp = DOCUMENTS[case]
    scale = 1 / math.sqrt(64)
    tol = {torch.float32: 2e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    for i, (local, blk) in enumerate(_tiles(lengths, padded, cp, causal, "cuda")):
        x = _inputs(local, 8, 2, 64, dtype, "cuda", seed=i)
        ref = _reference(x, blk, scale)
        got = _tile_pass(TorchFlashKernel(flash=dtype != torch.float32), x, blk, scale, ref)
        assert got["out"].dtype == dtype and got["lse"].dtype == torch.float32
        assert got["lse"].shape == ref["lse"].shape
        for n, want in ref.items():
            assert got[n].shape == want.shape, n
            limit = tol * max(1.0, want.abs().max().item())
            assert _err(got[n], want) <= limit, f"tile {i} {n}: {_err(got[n], want):.2e}"


@pytest.mark.gpu
@needs_te
@pytest.mark.parametrize("heads", [(8, 8), (8, 2)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", range(len(DOCUMENTS)))
def test_te_documents_tile_matches_torch(heads: tuple[int, int], causal: bool,
                                         case: int) -> None:
    """TE's thd tile against torch's documents tile (varlen flash), both bf16 on CUDA, each
    within 2x torch's error (plus a floor) of the fp32 CPU path: out, lse, dq, dk, dv."""
    lengths, padded, cp = DOCUMENTS[case]
    hq, hkv = heads
    scale = 1 / math.sqrt(64)
    te = TEFusedKernel()
    for i, (local, blk) in enumerate(_tiles(lengths, padded, cp, causal, "cuda")):
        if blk.slices is None:
            continue  # one document: a plain tile (TE's own tests cover those)
        x = _inputs(local, hq, hkv, 64, torch.bfloat16, "cuda", seed=10 + i)
        spec = te_fused.TileSpec.of_documents(torch.bfloat16, hq, hkv, 64, blk.slices,
                                              blk.causal, False, False)
        why = te_fused.te_rejects(spec)
        if why is not None:
            pytest.skip(f"Transformer Engine turns the tile down here: {why}")
        ref = _reference(x, blk, scale)
        got = _tile_pass(te, x, blk, scale, ref)
        same = _tile_pass(TorchFlashKernel(flash=True), x, blk, scale, ref)
        assert got["out"].dtype == torch.bfloat16 and got["lse"].dtype == torch.float32
        for n, want in ref.items():
            assert got[n].shape == want.shape, n
            bound = 2 * _err(same[n], want) + 1e-3 * max(1.0, want.abs().max().item())
            assert _err(got[n], want) <= bound, f"tile {i} {n}: {_err(got[n], want):.2e} > {bound:.2e}"


@pytest.mark.gpu
@needs_te
@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_thd_partition_indices_equal_te(cp_size: int) -> None:
    """Our THD split of a packed sequence is the one TE's CP code uses."""
    import transformer_engine_torch as tex

    for padded in ((8, 16, 40), (24,), (8, 8, 8, 64, 16)):
        cum = [sum(padded[:i]) for i in range(len(padded) + 1)]
        docs = Documents.from_cu_seqlens(torch.tensor(cum, dtype=torch.int32))
        cu = torch.tensor(cum, dtype=torch.int32, device="cuda")
        for rank in range(cp_size):
            want = tex.thd_get_partitioned_indices(cu, docs.total, cp_size, rank)
            got = thd_partition_indices(docs, cp_size, rank)
            assert got.tolist() == want.cpu().tolist(), (padded, cp_size, rank)


def test_documents_of_a_batch_take_varlen_on_cuda_branches() -> None:
    """CUDA's variable-length flash op reads one packed sequence: a call over documents of a
    batch of two (a mask given as slices) makes one varlen call per batch entry, no bias,
    and gives both entries (meta tensors: the CUDA branches)."""
    meta = torch.device("meta")
    documents = TileSlices.documents((0, 3, 8), (0, 3, 8), True, meta)
    for batch, want in ((1, "_flash_attention_forward"), (2, "_flash_attention_forward")):
        q = torch.empty(8, batch, 4, 16, device=meta, dtype=torch.bfloat16)
        kv = torch.empty(8, batch, 2, 16, device=meta, dtype=torch.bfloat16)
        with AttentionOps() as ops:
            out, lse = TorchFlashKernel().forward(q, kv, kv, True, 0.25, slices=documents)
            dq, dk, dv = TorchFlashKernel().backward(out, q, kv, kv, out, lse, True, 0.25,
                                                     slices=documents)
        assert want in ops.names and out.shape == q.shape and lse.shape == (batch, 4, 8)
        assert ops.names == {"_flash_attention_forward", "_flash_attention_backward"}
        assert (dq.shape, dk.shape) == (q.shape, kv.shape)
