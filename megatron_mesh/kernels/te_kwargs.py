"""The keyword arguments of Transformer Engine's `fused_attn_fwd` / `fused_attn_bwd` for a
tile (q [sq, b, hq, d], k [sk, b, hkv, d], v [sk, b, hkv, dv] as "sbhd_sbhd_sbhd"), for
packed documents ("thd_thd_thd": q [t, hq, d], cu_seqlens the documents' bounds) and for one
pack of a call's runs (`te_runs`): pure functions of the installed function's parameter
names, so one builder serves every release (docs/kernels.md lists what each added).
"""
from __future__ import annotations

from typing import Any, Collection, Sequence

import torch

from ..calls.tile_slices import TileSlices
from .te_runs import RunMask, documents_mask

QKV_LAYOUT = "sbhd_sbhd_sbhd"
FORMAT = "sbhd"
THD_LAYOUT = "thd_thd_thd"
THD_FORMAT = "thd"


NO_MASK = RunMask("no_mask", (-1, -1), False)
CAUSAL = RunMask("causal", (-1, 0), False)  # top-left: square tiles
CAUSAL_BOTTOM_RIGHT = RunMask("causal_bottom_right", (-1, 0), True)


def _mask(causal: bool, documents: bool = False, bottom_right: bool = False) -> RunMask:
    """TE's mask of a dense tile: none, causal top-left, or causal at the bottom right
    (`bottom_right`: a tile of more keys than queries, a causal diagonal after full keys,
    query i seeing key j <= i + sk - sq); packed documents take the padding masks (each
    document its own sequence, `te_runs.documents_mask`)."""
    if documents:
        return documents_mask(causal, bottom_right)
    if not causal:
        return NO_MASK
    return CAUSAL_BOTTOM_RIGHT if bottom_right else CAUSAL


# Keyword arguments passed only where the installed function has the parameter (each was
# added in some 2.x release, see docs/kernels.md), with the value that keeps the default
# behaviour of the releases before it (`bottom_right_diagonal`: the mask's own alignment).
_OPTIONAL_COMMON = {
    "softmax_type": "vanilla",
    "o_format": FORMAT,
}


def _common_kwargs(
    params: Collection[str],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    backend: Any,
    cuda_graph: bool,
) -> dict[str, Any]:
    """The keyword arguments fused_attn_fwd and fused_attn_bwd share, for a function whose
    parameter names are `params`; a causal tile of more keys than queries is aligned at
    the bottom right (`_mask`)."""
    mask = _mask(causal, bottom_right=causal and q.shape[0] != k.shape[0])
    kw: dict[str, Any] = dict(
        max_seqlen_q=q.shape[0],
        max_seqlen_kv=k.shape[0],
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_kv=cu_seqlens_kv,
        q=q,
        k=k,
        v=v,
        fake_dtype=q.dtype,
        fused_attention_backend=backend,
        attn_scale=softmax_scale,
        dropout=0.0,
        qkv_layout=QKV_LAYOUT,
        attn_bias_type="no_bias",
        attn_mask_type=mask.attn_mask_type,
        window_size=mask.window_size,
    )
    kw.update((n, val) for n, val in _OPTIONAL_COMMON.items() if n in params)
    if "bottom_right_diagonal" in params:
        kw["bottom_right_diagonal"] = mask.bottom_right_diagonal
    if "cuda_graph" in params:
        kw["cuda_graph"] = cuda_graph
    return kw


def fwd_kwargs(
    params: Collection[str],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    backend: Any,
    cuda_graph: bool = False,
) -> dict[str, Any]:
    """Keyword arguments of a `fused_attn_fwd` whose parameter names are `params` (read from
    the installed function's signature) for one tile, no bias / dropout.

    q [sq, b, hq, d], k [sk, b, hkv, d], v [sk, b, hkv, dv]; cu_seqlens_* [b + 1] int32;
    `backend` is
    FusedAttnBackend["F16_arbitrary_seqlen"] of that TE.
    """
    kw = _common_kwargs(params, q, k, v, cu_seqlens_q, cu_seqlens_kv, causal, softmax_scale,
                        backend, cuda_graph)
    kw["is_training"] = True  # only then does TE return the softmax stats (lse)
    if "return_max_logit" in params:
        kw["return_max_logit"] = False  # True would change the returned tuple
    return kw


def bwd_kwargs(
    params: Collection[str],
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    aux_ctx_tensors: Sequence[torch.Tensor],
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    backend: Any,
    dqkv_te_dtype: Any,
    cuda_graph: bool = False,
    deterministic: bool = False,
) -> dict[str, Any]:
    """Keyword arguments of a `fused_attn_bwd` whose parameter names are `params` for one tile.

    out, dout [sq, b, hq, dv]; aux_ctx_tensors = [lse [b, hq, sq, 1] fp32, rng_state [2] int64];
    dqkv_te_dtype is TE's DType of the gradients (passed where the function takes
    `dqkv_dtype`, releases before 2.15).
    """
    kw = _common_kwargs(params, q, k, v, cu_seqlens_q, cu_seqlens_kv, causal, softmax_scale,
                        backend, cuda_graph)
    kw.update(o=out, d_o=dout, aux_ctx_tensors=list(aux_ctx_tensors), deterministic=deterministic)
    if "dqkv_dtype" in params:
        kw["dqkv_dtype"] = dqkv_te_dtype
    if "do_format" in params:
        kw["do_format"] = FORMAT
    if "dqkv_layout" in params:
        kw["dqkv_layout"] = QKV_LAYOUT  # its default "sbh3d" would allocate packed dQKV
    return kw


def _thd(kw: dict[str, Any], cu_q: torch.Tensor, cu_kv: torch.Tensor, max_q: int,
         max_kv: int, mask: RunMask) -> dict[str, Any]:
    """kw (built for sbhd) turned into a call on packed sequences: "thd_thd_thd", `mask`,
    cu_seqlens and their padded offsets (the same: the rows of each sequence are
    contiguous, nothing between them), max_seqlen the longest sequence's."""
    kw.update(
        max_seqlen_q=max_q, max_seqlen_kv=max_kv,
        cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv,
        cu_seqlens_q_padded=cu_q, cu_seqlens_kv_padded=cu_kv,
        qkv_layout=THD_LAYOUT, attn_mask_type=mask.attn_mask_type,
        window_size=mask.window_size,
    )
    if "bottom_right_diagonal" in kw:
        kw["bottom_right_diagonal"] = mask.bottom_right_diagonal
    for name in ("o_format", "do_format"):
        if name in kw:
            kw[name] = THD_FORMAT
    if "dqkv_layout" in kw:
        kw["dqkv_layout"] = THD_LAYOUT
    return kw


def thd_fwd_kwargs(
    params: Collection[str],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    docs: TileSlices,
    causal: bool,
    softmax_scale: float,
    backend: Any,
    cuda_graph: bool = False,
) -> dict[str, Any]:
    """Keyword arguments of `fused_attn_fwd` (parameter names `params`) for one tile of
    packed documents: q [t_q, hq, d], k [t_kv, hkv, d], v [t_kv, hkv, dv] (t = the documents'
    rows)."""
    kw = fwd_kwargs(params, q, k, v, docs.cu_q_tensor, docs.cu_kv_tensor, causal,
                    softmax_scale, backend, cuda_graph)
    return _thd(kw, docs.cu_q_tensor, docs.cu_kv_tensor, docs.max_q, docs.max_kv,
                documents_mask(causal, docs.bottom_right))


def thd_bwd_kwargs(
    params: Collection[str],
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    aux_ctx_tensors: Sequence[torch.Tensor],
    docs: TileSlices,
    causal: bool,
    softmax_scale: float,
    backend: Any,
    dqkv_te_dtype: Any,
    cuda_graph: bool = False,
    deterministic: bool = False,
) -> dict[str, Any]:
    """Keyword arguments of `fused_attn_bwd` (parameter names `params`) for one tile of
    packed documents: out, dout [t_q, hq, dv]; aux_ctx_tensors = [softmax stats in TE's
    layout (`lse_to_te`), rng_state]."""
    kw = bwd_kwargs(params, dout, q, k, v, out, aux_ctx_tensors, docs.cu_q_tensor,
                    docs.cu_kv_tensor, causal, softmax_scale, backend, dqkv_te_dtype,
                    cuda_graph, deterministic)
    return _thd(kw, docs.cu_q_tensor, docs.cu_kv_tensor, docs.max_q, docs.max_kv,
                documents_mask(causal, docs.bottom_right))


def pack_fwd_kwargs(
    params: Collection[str],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_kv: torch.Tensor,
    max_q: int,
    max_kv: int,
    mask: RunMask,
    softmax_scale: float,
    backend: Any,
    cuda_graph: bool = False,
) -> dict[str, Any]:
    """Keyword arguments of `fused_attn_fwd` (parameter names `params`) for one pack of a
    call's runs (`te_runs`): q [t_q, hq, d], k [t_kv, hkv, d], v [t_kv, hkv, dv] gathered,
    sequence n query rows cu_q[n]:cu_q[n+1] against key rows cu_kv[n]:cu_kv[n+1] under
    `mask` (each aligned at its own bottom right)."""
    kw = fwd_kwargs(params, q, k, v, cu_q, cu_kv, False, softmax_scale, backend, cuda_graph)
    return _thd(kw, cu_q, cu_kv, max_q, max_kv, mask)


def pack_bwd_kwargs(
    params: Collection[str],
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    aux_ctx_tensors: Sequence[torch.Tensor],
    cu_q: torch.Tensor,
    cu_kv: torch.Tensor,
    max_q: int,
    max_kv: int,
    mask: RunMask,
    softmax_scale: float,
    backend: Any,
    dqkv_te_dtype: Any,
    cuda_graph: bool = False,
    deterministic: bool = False,
) -> dict[str, Any]:
    """Keyword arguments of `fused_attn_bwd` (parameter names `params`) for one pack of a
    call's runs: out, dout [t_q, hq, dv] gathered; aux_ctx_tensors = [softmax stats in
    TE's layout (`rows_to_te`), rng_state]."""
    kw = bwd_kwargs(params, dout, q, k, v, out, aux_ctx_tensors, cu_q, cu_kv, False,
                    softmax_scale, backend, dqkv_te_dtype, cuda_graph, deterministic)
    return _thd(kw, cu_q, cu_kv, max_q, max_kv, mask)
