"""Tile kernel on Transformer Engine's fused attention (cuDNN, F16_arbitrary_seqlen backend).

Calls `transformer_engine.pytorch.cpp_extensions.fused_attn.fused_attn_fwd` / `_bwd` on
q [sq, b, hq, d], k [sk, b, hkv, d], v [sk, b, hkv, dv] ("sbhd_sbhd_sbhd"; GQA / MQA run
natively, dk / dv come back with hkv heads; dv, V's head dim, may differ from d as in
multi-latent attention: TE's output takes V's head dim and dV V's shape), after TE's own
backend query (`get_attention_backend`) has accepted the tile's shape, dtype, heads, head
dims (`head_dim_qk`, `head_dim_v`), mask and window. The keyword arguments come from
`te_kwargs` (pure functions of the installed function's parameter names; its Python
signature changed in 2.8, 2.9, 2.10, 2.12 and 2.15, see docs/kernels.md).
Packed documents (a tile's `TileSlices`) run as TE's "thd_thd_thd" layout: q [t, hq, d],
k [t, hkv, d], v [t, hkv, dv] with cu_seqlens = the documents' bounds, masks "padding" /
"padding_causal"; TE's softmax stats come back per token ([t', hq, 1], cuDNN >= 9.6) or per
document ([docs, hq, max_q, 1], older cuDNN and sm120 from TE 2.14) and are converted to
and from our [1, hq, t] (`lse_from_te`, `lse_to_te`). Causal documents of more keys than
queries take "padding_causal_bottom_right". Windows and masks given as slices run as thd
calls too, one per pack of their runs (`te_runs`: the masks, the release bounds, what stays
on the fallback; `runs_forward` / `runs_backward`, `pack_fwd_kwargs` / `pack_bwd_kwargs`).
TE is imported lazily, and only when it can be chosen: this module imports without it.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import inspect
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Collection, Sequence

import torch
from packaging.version import InvalidVersion, Version

from ..calls.tile_slices import DOCUMENTS, TileSlices
from .base import check_call, folds_diagonal, log_once
from .caps import KernelCaps, caps_of
from .te_kwargs import (
    QKV_LAYOUT,
    THD_LAYOUT,
    _mask,
    bwd_kwargs,
    fwd_kwargs,
    pack_bwd_kwargs,
    pack_fwd_kwargs,
    thd_bwd_kwargs,
    thd_fwd_kwargs,
)
from .te_runs import RunMask, RunsPlan, documents_mask, fit_runs, run_mask
from .te_stats import lse_from_te, lse_to_te, packed_stats, rows_from_te, rows_to_te, stats_rows
from .torch_flash import TorchFlashKernel
from .varlen_runs import packs_of, varlen_runs_backward, varlen_runs_forward

MIN_VERSION = (2, 1)
MAX_ASKED = 4096  # tile shapes whose backend-query answer a kernel keeps
BACKEND = "F16_arbitrary_seqlen"
TE_DTYPES = (torch.float16, torch.bfloat16)


def te_version() -> str | None:
    """The installed Transformer Engine version string, or None when it is not installed."""
    for dist in ("transformer_engine", "transformer_engine_torch"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def minor_version(version: str) -> tuple[int, int]:
    """'2.10.0.dev0+g1234' -> (2, 10). ValueError if unparsable or older than MIN_VERSION."""
    try:
        release = Version(version).release
    except InvalidVersion as e:
        raise ValueError(f"Transformer Engine version {version!r} is not a version string") from e
    minor = (release + (0,))[:2]
    if minor < MIN_VERSION:
        raise ValueError(
            f"Transformer Engine {version} is not supported; need >= "
            f"{MIN_VERSION[0]}.{MIN_VERSION[1]}"
        )
    return minor


@dataclass(frozen=True)
class _TE:
    """The imported pieces of Transformer Engine this kernel uses."""

    version: str
    fused_attn: ModuleType
    backend: Any
    te_dtype: Any  # torch dtype -> TE DType
    selection: ModuleType | None  # the module with AttentionParams / get_attention_backend
    cudnn: Callable[[], tuple[int, int, int]]  # the cuDNN version TE runs on

    @property
    def minor(self) -> tuple[int, int]:
        return minor_version(self.version)


# Where TE keeps its backend query (AttentionParams, get_attention_backend), newest first:
# 2.5 onwards (read in 2.5, 2.10, 2.14, 2.20), 2.2 (dot_product_attention/utils.py beside
# attention.py), 2.1 (the single attention module).
SELECTION_MODULES = (
    "transformer_engine.pytorch.attention.dot_product_attention.utils",
    "transformer_engine.pytorch.dot_product_attention.utils",
    "transformer_engine.pytorch.attention",
)


@functools.lru_cache(maxsize=None)
def _load() -> _TE:
    """Imports TE (raises ImportError / ValueError when missing or unsupported)."""
    fused_attn = importlib.import_module("transformer_engine.pytorch.cpp_extensions.fused_attn")
    constants = importlib.import_module("transformer_engine.pytorch.constants")
    te = importlib.import_module("transformer_engine")
    version = getattr(te, "__version__", None) or te_version()
    if version is None:
        raise ImportError("cannot tell the version of the installed Transformer Engine")
    minor_version(version)
    selection = None
    for name in SELECTION_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "get_attention_backend") and hasattr(module, "AttentionParams"):
            selection = module
            break
    utils = importlib.import_module("transformer_engine.pytorch.utils")
    cudnn = getattr(utils, "get_cudnn_version", None) or _torch_cudnn
    return _TE(version, fused_attn, fused_attn.FusedAttnBackend[BACKEND], constants.TE_DType,
               selection, cudnn)


def _torch_cudnn() -> tuple[int, int, int]:
    """torch's cuDNN version as (major, minor, patch), e.g. 90100 -> (9, 1, 0)."""
    v = torch.backends.cudnn.version() or 0
    return (v // 10000, v % 10000 // 100, v % 100) if v >= 90000 else (v // 1000,
                                                                        v % 1000 // 100, v % 100)


@functools.lru_cache(maxsize=None)
def unavailable() -> str | None:
    """Why Transformer Engine cannot be used here (None when CUDA is there and a supported
    TE imports). Imports TE: call it only when TE could be chosen."""
    version = te_version()
    if version is None:
        return "Transformer Engine is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        _load()
    except Exception as e:  # a broken TE install fails in many ways (ImportError, OSError, ...)
        return f"Transformer Engine {version} does not import: {type(e).__name__}: {e}"
    return None


def is_available() -> bool:
    """True when CUDA is available and a supported Transformer Engine imports."""
    return unavailable() is None


@dataclass(frozen=True)
class TileSpec:
    """What TE's backend query needs to know of one tile."""

    dtype: torch.dtype
    batch: int
    heads: int
    kv_heads: int
    sq: int
    sk: int
    head_dim: int
    causal: bool
    deterministic: bool
    cuda_graph: bool
    documents: int = 0  # packed documents in the tile (thd); 0: dense sbhd
    tokens_q: int = 0  # thd: the tile's query rows (sq, sk are the longest document's)
    tokens_kv: int = 0
    head_dim_v: int = 0  # V's head dim (multi-latent attention); 0: head_dim
    mask: RunMask | None = None  # thd: TE's mask (None: the dense tile's, from `causal`)

    @property
    def v_dim(self) -> int:
        """V's head dim."""
        return self.head_dim_v or self.head_dim

    @classmethod
    def of_documents(cls, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                     docs: TileSlices, causal: bool, deterministic: bool, cuda_graph: bool,
                     head_dim_v: int = 0) -> TileSpec:
        """The spec of a tile over packed documents (`docs`)."""
        return cls(dtype, len(docs.cu_q) - 1, heads, kv_heads, docs.max_q,
                   docs.max_kv, head_dim, causal, deterministic, cuda_graph,
                   documents=len(docs.cu_q) - 1, tokens_q=docs.cu_q[-1],
                   tokens_kv=docs.cu_kv[-1], head_dim_v=head_dim_v,
                   mask=documents_mask(causal, docs.bottom_right))

    @classmethod
    def of_pack(cls, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                shape: tuple, deterministic: bool, cuda_graph: bool, head_dim_v: int = 0
                ) -> TileSpec:
        """The spec of one pack of a call's runs, `shape` as `RunsPlan.shapes` gives it:
        (mask, sequences, longest query and key sequence, query and key tokens)."""
        mask, count, max_q, max_kv, tokens_q, tokens_kv = shape
        return cls(dtype, count, heads, kv_heads, max_q, max_kv, head_dim,
                   mask.attn_mask_type != "padding" and not mask.windowed, deterministic,
                   cuda_graph, documents=count, tokens_q=tokens_q, tokens_kv=tokens_kv,
                   head_dim_v=head_dim_v, mask=mask)


def tile_spec(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
              deterministic: bool, cuda_graph: bool, docs: TileSlices | None = None
              ) -> TileSpec:
    """The spec of one tile: q [sq, b, hq, d], k [sk, b, hkv, d], v [sk, b, hkv, dv] (dv, V's
    head dim, goes to the query as head_dim_v); with `docs`, their packed documents."""
    sq, b, hq, d = q.shape
    if docs is None:
        return TileSpec(q.dtype, b, hq, k.shape[2], sq, k.shape[0], d, causal, deterministic,
                        cuda_graph, head_dim_v=v.shape[-1])
    return TileSpec.of_documents(q.dtype, hq, k.shape[2], d, docs, causal, deterministic,
                                 cuda_graph, head_dim_v=v.shape[-1])


def _spec_mask(spec: TileSpec) -> tuple[str, tuple[int, int], bool]:
    """attn_mask_type, window_size and bottom_right_diagonal TE is asked about for `spec`."""
    if spec.documents > 0 and spec.mask is not None:
        m = spec.mask
        return m.attn_mask_type, m.window_size, m.bottom_right_diagonal
    m = _mask(spec.causal, documents=spec.documents > 0,
              bottom_right=spec.causal and spec.sq != spec.sk)
    return m.attn_mask_type, m.window_size, m.bottom_right_diagonal


def attention_params(fields: Collection[str], spec: TileSpec) -> dict[str, Any]:
    """Keyword arguments of TE's `AttentionParams` (whose field names are `fields`) for one
    tile in our layout, mask and window; fields this TE lacks are left out."""
    thd = spec.documents > 0
    mask, window, bottom_right = _spec_mask(spec)
    values: dict[str, Any] = dict(
        qkv_type=torch.Tensor, qkv_dtype=spec.dtype,
        qkv_layout=THD_LAYOUT if thd else QKV_LAYOUT,
        batch_size=spec.batch, num_heads=spec.heads, num_gqa_groups=spec.kv_heads,
        max_seqlen_q=spec.sq, max_seqlen_kv=spec.sk, head_dim_qk=spec.head_dim,
        head_dim_v=spec.v_dim, attn_mask_type=mask, window_size=window,
        bottom_right_diagonal=bottom_right, core_attention_bias_type="no_bias",
        attention_dropout=0.0, deterministic=spec.deterministic, is_training=True, fp8=False,
        softmax_type="vanilla", return_max_logit=False, cuda_graph=spec.cuda_graph,
    )
    if thd:  # no padding between documents: each starts where the one before ends
        values.update(pad_between_seqs=False, num_tokens_q=spec.tokens_q,
                      num_tokens_kv=spec.tokens_kv)
    return {n: val for n, val in values.items() if n in fields}


def fused_backend_of(result: Sequence[Any]) -> Any:
    """The fused sub-backend in what TE's `get_attention_backend` returns: (use_flash,
    use_fused, fused_backend, use_unfused, available) in 2.1, (use_flash, flash_backend,
    use_fused, fused_backend, use_unfused, available) from 2.2 on; None when TE's fused
    attention cannot run the tile (available[1] false)."""
    available = result[-1]
    return result[-3] if available[1] else None


def te_rejects(spec: TileSpec) -> str | None:
    """Why TE's own backend query turns this tile down (None when it gives the
    F16_arbitrary_seqlen fused backend this kernel calls)."""
    te = _load()
    if te.selection is None:
        return f"Transformer Engine {te.version} has no get_attention_backend to ask"
    params_cls = te.selection.AttentionParams
    names = {f.name for f in dataclasses.fields(params_cls)}
    if spec.v_dim != spec.head_dim and "head_dim_v" not in names:
        return (f"Transformer Engine {te.version}'s backend query has no head_dim_v to ask "
                f"about V's head dim {spec.v_dim} (Q/K {spec.head_dim})")
    result = te.selection.get_attention_backend(params_cls(**attention_params(names, spec)))
    backend = fused_backend_of(result)
    if backend is None:
        return (f"Transformer Engine {te.version} has no fused attention for {spec.dtype}, "
                f"{spec.heads}/{spec.kv_heads} heads of {spec.head_dim}"
                f"{f' (V {spec.v_dim})' if spec.v_dim != spec.head_dim else ''}, sq {spec.sq}, "
                f"sk {spec.sk}, {_mask_words(spec)}"
                f"{f', {spec.documents} documents (thd)' if spec.documents else ''} "
                "on this GPU / cuDNN")
    if int(backend) != int(te.backend):
        return (f"Transformer Engine {te.version} picks fused sub-backend {int(backend)}, not "
                f"{BACKEND} ({int(te.backend)}) whose softmax stats this kernel reads")
    return None


def _mask_words(spec: TileSpec) -> str:
    mask, window, _ = _spec_mask(spec)
    return mask if window in ((-1, -1), (-1, 0)) else f"{mask} with window {window}"


@functools.lru_cache(maxsize=None)
def _parameters(fn: Callable) -> tuple[frozenset[str], frozenset[str]]:
    """(all, required) parameter names of fn."""
    params = inspect.signature(fn).parameters
    required = {n for n, p in params.items() if p.default is inspect.Parameter.empty}
    return frozenset(params), frozenset(required)


def _call(fn: Callable, kwargs: dict[str, Any], version: str) -> Any:
    """fn(**kwargs), with a clear error if this TE's signature is not the one we expect."""
    names, required = _parameters(fn)
    unknown, missing = set(kwargs) - names, required - set(kwargs)
    if unknown or missing:
        raise RuntimeError(
            f"Transformer Engine {version}: {fn.__name__} does not take {sorted(unknown)} "
            f"or needs {sorted(missing)}; this TE version is not supported"
        )
    return fn(**kwargs)


_RNG_STATE: dict[torch.device, torch.Tensor] = {}
CU_SEQLENS_KEPT = 256  # (device, b, s) whose cu_seqlens are kept: a layer's tile shapes


def cu_seqlens(batch: int, seqlen: int, device: torch.device) -> torch.Tensor:
    """[0, s, 2s, ..., b*s] int32 (b full-length sequences), kept for the last
    `CU_SEQLENS_KEPT` (device, b, s): calls of lengths new every micro-batch (packed
    documents, windows) do not grow it."""
    return _cu_seqlens(torch.device(device), batch, seqlen)


@functools.lru_cache(maxsize=CU_SEQLENS_KEPT)
def _cu_seqlens(device: torch.device, batch: int, seqlen: int) -> torch.Tensor:
    return torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32, device=device)


def rng_state(device: torch.device) -> torch.Tensor:
    """A zero [2] int64 rng state on `device`, made once (read only with dropout)."""
    t = _RNG_STATE.get(device)
    if t is None:
        t = _RNG_STATE[device] = torch.zeros(2, dtype=torch.int64, device=device)
    return t


@functools.lru_cache(maxsize=None)
def _stats_per_token(device: torch.device) -> bool:
    """`packed_stats` for the installed TE, its cuDNN and `device`'s GPU (asked once)."""
    te = _load()
    return packed_stats(te.minor, tuple(te.cudnn()),
                        tuple(torch.cuda.get_device_capability(device)))


@functools.lru_cache(maxsize=64)
def _causal_band(sq: int, sk: int) -> TileSlices:
    """The bottom-right causal band of sq x sk (a tile's few shapes: kept)."""
    return TileSlices.band(sq, sk, -1, 0)


def _uses_te(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in TE_DTYPES


def _capturing(q: torch.Tensor) -> bool:
    """Whether q's CUDA stream is being captured into a graph (never off CUDA)."""
    return q.is_cuda and torch.cuda.is_current_stream_capturing()


def _check_thd_stats(te: _TE, stats: torch.Tensor, packed: bool, heads: int, tokens: int,
                     sequences: int, longest: int) -> None:
    """RuntimeError, naming the shapes, where TE's thd softmax stats are not in the layout
    `packed` says: per token [>= tokens, heads, 1], else per sequence [sequences, heads,
    >= longest, 1], fp32."""
    ok = stats.dtype == torch.float32 and (
        (stats.dim() == 3 and stats.shape[0] >= tokens and tuple(stats.shape[1:]) == (heads, 1))
        if packed else
        (stats.dim() == 4 and tuple(stats.shape[:2]) == (sequences, heads)
         and stats.shape[2] >= longest and stats.shape[3] == 1))
    if not ok:
        expected = (f"(>= {tokens}, {heads}, 1)" if packed else
                    f"({sequences}, {heads}, >= {longest}, 1)")
        raise RuntimeError(
            f"Transformer Engine {te.version} returned thd softmax stats "
            f"{tuple(stats.shape)} {stats.dtype}, expected {expected} float32 (cuDNN "
            f"{te.cudnn()}): not the {BACKEND} backend, or a stats layout not known here")


# A call's runs (windows, masks given as slices) on TE's thd calls: `varlen_runs` gathers
# each pack's rows, writes or merges the outputs back and adds the gradients into the rows
# read; the op it calls per pack and batch entry is one TE call on [t, h, d] with the
# pack's cu_seqlens and mask (`te_runs`), lse [h, t] converted from and to TE's stats.


def runs_forward(te: _TE, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 softmax_scale: float, plan: RunsPlan, packed: bool, cuda_graph: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """out [sq, b, hq, dv] in q's dtype, lse [b, hq, sq] fp32 of a call's runs (`plan`, one
    TE thd call per pack and batch entry); `packed`: TE's stats are per token."""
    op = functools.partial(_pack_forward, te, packed, cuda_graph)
    return varlen_runs_forward(q, k, v, softmax_scale, plan.packs, list(plan.tensors), op)


def runs_backward(te: _TE, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, softmax_scale: float,
                  plan: RunsPlan, packed: bool, cuda_graph: bool = False,
                  deterministic: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv (the inputs' shapes and dtype) of `runs_forward`'s call; out and lse are
    the whole row's."""
    op = functools.partial(_pack_backward, te, packed, cuda_graph, deterministic)
    return varlen_runs_backward(dout, q, k, v, out, lse, softmax_scale, plan.packs,
                                list(plan.tensors), op)


def _pack_forward(te: _TE, packed: bool, cuda_graph: bool, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int,
                  max_k: int, causal: bool, window: tuple[int, int] | None, scale: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """One pack on TE: q [t_q, hq, d], k [t_k, hkv, d], v [t_k, hkv, dv] -> out [t_q, hq, dv],
    lse [hq, t_q] fp32 (`varlen_runs`'s op)."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    fn = te.fused_attn.fused_attn_fwd
    kw = pack_fwd_kwargs(_parameters(fn)[0], q, k, v, cu_q, cu_k, max_q, max_k,
                         run_mask(causal, window), scale, te.backend, cuda_graph)
    out, aux = _call(fn, kw, te.version)[:2]
    _check_thd_stats(te, aux[0], packed, q.shape[1], q.shape[0], cu_q.numel() - 1, max_q)
    return out, rows_from_te(aux[0], cu_q, q.shape[0])


def _pack_backward(te: _TE, packed: bool, cuda_graph: bool, deterministic: bool,
                   dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, cu_q: torch.Tensor,
                   cu_k: torch.Tensor, max_q: int, max_k: int, causal: bool,
                   window: tuple[int, int] | None, scale: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of `_pack_forward`'s call; out [t_q, hq, dv] and lse [hq, t_q] are the
    rows' whole ones."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out, dout = out.to(q.dtype).contiguous(), dout.to(q.dtype).contiguous()
    stats = rows_to_te(lse, cu_q, max_q, packed, stats_rows(te.minor, q.shape[0]))
    fn = te.fused_attn.fused_attn_bwd
    kw = pack_bwd_kwargs(_parameters(fn)[0], dout, q, k, v, out, [stats, rng_state(q.device)],
                         cu_q, cu_k, max_q, max_k, run_mask(causal, window), scale,
                         te.backend, te.te_dtype[q.dtype], cuda_graph, deterministic)
    dq, dk, dv = _call(fn, kw, te.version)[:3]
    return dq, dk, dv


class TEFusedKernel:
    """The TileKernel of `kernels/base.py` on TE's cuDNN fused attention.

    Each tile shape (for packed documents: their count and longest lengths) is first put
    to TE's own backend query (`te_rejects`, once per shape); tiles TE turns down, and
    anything not fp16 / bf16 on CUDA, go to `fallback` (the next choice of
    `choice.choose`; torch's ops when not given), tiles of packed documents to
    `documents_fallback` (`fallback` where its caps take documents, else torch's ops), the
    reason logged once. `deterministic` follows TE's NVTE_ALLOW_NONDETERMINISTIC_ALGO=0
    unless given.

    Windows and masks given as slices run on TE's thd calls as their runs' packs
    (`te_runs`: bottom-right causal, full, and from TE 2.12 windows), where the release and
    the rules take every pack and TE's query accepts each pack's shape (asked once per pack
    shape); other such calls go to `fallback` (as runs: `run_calls`), the reason logged
    once per kind.

    A causal tile of more keys than queries (a grouped tile's diagonal after the full keys
    before it, `calls.groups`) runs as one "causal_bottom_right" call; one TE turns down
    runs on `fallback`, as its band where that has no bottom-right causal.

    `caps`: packed documents where `documents_fallback` takes them, V's own head dim where
    both fallbacks do (a tile TE turns down runs on them), windows and masks given as slices
    where `fallback` takes them (the calls TE cannot take run there), bottom-right causal
    where `fallback` takes it or its band. The class's `caps` are those with torch's ops as
    the fallbacks.
    """

    name = "te"
    caps = KernelCaps(documents=True, tile_mask=True, window=True, v_head_dim=True,
                      bottom_right=True)

    def __init__(self, deterministic: bool | None = None, fallback: Any = None,
                 documents_fallback: Any = None) -> None:
        if deterministic is None:
            deterministic = os.getenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1") == "0"
        self.deterministic = deterministic
        self._fallback = fallback if fallback is not None else TorchFlashKernel()
        if documents_fallback is None:
            takes = caps_of(self._fallback).documents
            documents_fallback = self._fallback if takes else TorchFlashKernel()
        self._documents_fallback = documents_fallback
        fallbacks = caps_of(self._fallback), caps_of(documents_fallback)
        self.caps = KernelCaps(documents=fallbacks[1].documents,
                               tile_mask=fallbacks[0].tile_mask,
                               window=fallbacks[0].window or fallbacks[0].tile_mask,
                               v_head_dim=fallbacks[0].v_head_dim and fallbacks[1].v_head_dim,
                               bottom_right=(fallbacks[0].bottom_right or fallbacks[0].window
                                             or fallbacks[0].tile_mask))
        self._takes: dict[tuple, bool] = {}
        self._asked: dict[tuple, str | None] = {}  # a pack shape -> why TE's query refuses it
        self._told: set[tuple] = set()  # (heads, dims, dtype, mask, documents?) logged once

    def bottom_right_mask_free(self, q: torch.Tensor) -> bool:
        """Whether a causal call of more keys than queries on tensors like q [sq, b, hq, d]
        runs as one call without a mask of sq x sk (`base.folds_diagonal`): on TE's tensors
        ("causal_bottom_right"; one TE's query turns down runs on `fallback`, `_on_fallback`),
        elsewhere where `fallback` folds it."""
        return _uses_te(q) or folds_diagonal(self._fallback, q)

    def _on_fallback(self, q: torch.Tensor, k: torch.Tensor, causal: bool
                     ) -> tuple[bool, TileSlices | None]:
        """(causal, slices) of a dense tile TE does not run, for `fallback`: as it is, or a
        causal tile of more keys than queries, where `fallback` has no bottom-right causal,
        as its band (-1, 0), which it splits into a full call and a causal square
        (`run_calls`)."""
        sq, sk = q.shape[0], k.shape[0]
        if causal and sq != sk and not caps_of(self._fallback).bottom_right:
            return False, _causal_band(sq, sk)
        return causal, None

    def _te_takes(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  docs: TileSlices | None = None) -> bool:
        """Whether TE runs this tile (asked once per shape, V head dim, dtype, mask and
        documents)."""
        if not _uses_te(q):
            return False
        capturing = _capturing(q)
        if docs is None:
            key: tuple = (q.shape, k.shape, v.shape[-1], q.dtype, causal, capturing)
        else:  # what TileSpec.of_documents reads: the documents change every batch
            key = (q.shape[2:], k.shape[2], v.shape[-1], q.dtype, causal, capturing,
                   len(docs.cu_q), docs.bottom_right,
                   docs.max_q, docs.max_kv, docs.cu_q[-1], docs.cu_kv[-1])
        takes = self._takes.get(key)
        if takes is None:
            if len(self._takes) >= MAX_ASKED:
                self._takes.clear()  # documents of ever new lengths: ask again, bounded
            spec = tile_spec(q, k, v, causal, self.deterministic, capturing, docs)
            fallback = self._fallback if docs is None else self._documents_fallback
            try:
                why = te_rejects(spec)
            except Exception as e:  # a query that fails says no more than a refusal
                why = f"Transformer Engine's backend query failed ({type(e).__name__}: {e})"
            # said once per kind of tile, not per length: packed documents (THD or placed)
            # bring tiles of new lengths every micro-batch, and a message per length would
            # grow the log and log_once's memory for the whole run
            told = (q.shape[2:], k.shape[2], v.shape[-1], q.dtype, causal, docs is None)
            if why is not None and told not in self._told:
                self._told.add(told)
                log_once(f"te tile kernel: {why}; these tiles, and any other of these heads, "
                         f"dtype and mask that TE turns down at other lengths (not logged), "
                         f"run on {fallback.name}")
            takes = self._takes[key] = why is None
        return takes

    def _thd(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
             slices: TileSlices) -> bool:
        """Whether TE's thd call runs this call: documents of one packed sequence (b = 1)
        that TE's query accepts (causal: "padding_causal", or "padding_causal_bottom_right"
        where a document has more keys than queries)."""
        return (slices.form == DOCUMENTS and q.shape[1] == 1
                and self._te_takes(q, k, v, causal, slices))

    def _runs_plan(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   slices: TileSlices) -> RunsPlan | None:
        """The plan on which TE's thd calls run a call of a window or other slices
        (`te_runs`; made once per call), or None where TE cannot take every pack: the
        release or a rule (`pack_refusal`), or TE's query on a pack's shape (asked once per
        shape, heads, dtype and mask). The reason is logged once per kind."""
        if slices.form == DOCUMENTS or not _uses_te(q):
            return None
        te = _load()
        params = _parameters(te.fused_attn.fused_attn_fwd)[0]
        plan = slices.made_on("te runs", q.device,
                              lambda d: RunsPlan.of(packs_of(fit_runs(slices.runs)), params, d))
        why = plan.refusal
        if why is None:
            capturing = _capturing(q)
            for shape in plan.shapes():
                refused = self._ask_pack(q, k, v, shape, capturing)
                if refused is not None:
                    why = ("query", refused)
                    break
        if why is None:
            return plan
        told = (q.shape[2:], k.shape[2], v.shape[-1], q.dtype, "runs", why[0])
        if told not in self._told:
            self._told.add(told)
            log_once(f"te tile kernel: {why[1]}; these calls of windows or masks, and any "
                     f"other of these heads and dtype that TE turns down for this reason "
                     f"(not logged), run on {self._fallback.name}")
        return None

    def _ask_pack(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: tuple,
                  capturing: bool) -> str | None:
        """Why TE's query turns a pack of `shape` (`RunsPlan.shapes`) down, asked once."""
        key = (q.shape[2:], k.shape[2], v.shape[-1], q.dtype, capturing, shape)
        if key in self._asked:
            return self._asked[key]
        if len(self._asked) >= MAX_ASKED:
            self._asked.clear()  # runs of ever new lengths: ask again, bounded
        spec = TileSpec.of_pack(q.dtype, q.shape[2], k.shape[2], q.shape[3], shape,
                                self.deterministic, capturing, head_dim_v=v.shape[-1])
        try:
            why = te_rejects(spec)
        except Exception as e:  # a query that fails says no more than a refusal
            why = f"Transformer Engine's backend query failed ({type(e).__name__}: {e})"
        self._asked[key] = why
        return why

    def _slices_fallback(self, slices: TileSlices) -> Any:
        """The kernel a call's slices go to when TE's thd call does not take them: documents
        to `documents_fallback`, other slices (windows, masks) to `fallback` (as runs)."""
        return self._documents_fallback if slices.form == DOCUMENTS else self._fallback

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
        softmax_scale: float, *, slices: TileSlices | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """out [sq, b, hq, dv] in q's dtype (dv: v's head dim), lse [b, hq, sq] fp32 (b = 1
        with `slices`, documents)."""
        check_call(self, q, v, slices, causal)
        if slices is not None:
            if self._thd(q, k, v, causal, slices):
                return self._documents_forward(q, k, v, causal, softmax_scale, slices)
            plan = self._runs_plan(q, k, v, slices)
            if plan is not None:
                return runs_forward(_load(), q, k, v, softmax_scale, plan,
                                    _stats_per_token(q.device), _capturing(q))
            return self._slices_fallback(slices).forward(q, k, v, causal, softmax_scale,
                                                         slices=slices)
        if not self._te_takes(q, k, v, causal):
            causal, band = self._on_fallback(q, k, causal)
            return self._fallback.forward(q, k, v, causal, softmax_scale, slices=band)
        te = _load()
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        sq, b, hq, _ = q.shape
        fn = te.fused_attn.fused_attn_fwd
        kw = fwd_kwargs(
            _parameters(fn)[0], q, k, v,
            cu_seqlens(b, sq, q.device), cu_seqlens(b, k.shape[0], q.device),
            causal, softmax_scale, te.backend,
            cuda_graph=_capturing(q),
        )
        out, aux = _call(fn, kw, te.version)[:2]
        stats = aux[0]
        if stats.dtype != torch.float32 or tuple(stats.shape) != (b, hq, sq, 1):
            raise RuntimeError(
                f"Transformer Engine {te.version} returned softmax stats {tuple(stats.shape)} "
                f"{stats.dtype}, expected ({b}, {hq}, {sq}, 1) float32: not the "
                f"{BACKEND} backend?"
            )
        return out, stats.reshape(b, hq, sq)

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        causal: bool,
        softmax_scale: float,
        *,
        slices: TileSlices | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """dq [sq, b, hq, d], dk [sk, b, hkv, d], dv [sk, b, hkv, dv]; out / lse are the whole
        row's."""
        check_call(self, q, v, slices, causal)
        if slices is not None:
            if self._thd(q, k, v, causal, slices):
                return self._documents_backward(dout, q, k, v, out, lse, causal,
                                                softmax_scale, slices)
            plan = self._runs_plan(q, k, v, slices)
            if plan is not None:
                return runs_backward(_load(), dout, q, k, v, out, lse, softmax_scale, plan,
                                     _stats_per_token(q.device), _capturing(q),
                                     self.deterministic)
            return self._slices_fallback(slices).backward(dout, q, k, v, out, lse, causal,
                                                          softmax_scale, slices=slices)
        if not self._te_takes(q, k, v, causal):
            causal, band = self._on_fallback(q, k, causal)
            return self._fallback.backward(dout, q, k, v, out, lse, causal, softmax_scale,
                                           slices=band)
        te = _load()
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out, dout = out.to(q.dtype).contiguous(), dout.to(q.dtype).contiguous()
        sq, b, hq, _ = q.shape
        stats = lse.to(torch.float32).reshape(b, hq, sq, 1).contiguous()
        fn = te.fused_attn.fused_attn_bwd
        kw = bwd_kwargs(
            _parameters(fn)[0], dout, q, k, v, out, [stats, rng_state(q.device)],
            cu_seqlens(b, sq, q.device), cu_seqlens(b, k.shape[0], q.device),
            causal, softmax_scale, te.backend, te.te_dtype[q.dtype],
            cuda_graph=_capturing(q),
            deterministic=self.deterministic,
        )
        dq, dk, dv = _call(fn, kw, te.version)[:3]
        return dq, dk, dv

    # Packed documents: [t, 1, h, d] -> TE's thd [t, h, d] (a view) and back.

    def _documents_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           causal: bool, softmax_scale: float, docs: TileSlices
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """out [t_q, 1, hq, dv], lse [1, hq, t_q] fp32 of one tile over packed documents."""
        te = _load()
        q3, k3, v3 = (t[:, 0].contiguous() for t in (q, k, v))
        fn = te.fused_attn.fused_attn_fwd
        kw = thd_fwd_kwargs(_parameters(fn)[0], q3, k3, v3, docs, causal, softmax_scale,
                            te.backend, cuda_graph=_capturing(q))
        out, aux = _call(fn, kw, te.version)[:2]
        stats = aux[0]
        _check_thd_stats(te, stats, _stats_per_token(q.device), q.shape[2], docs.cu_q[-1],
                         len(docs.cu_q) - 1, docs.max_q)
        return out.unsqueeze(1), lse_from_te(stats, docs)

    def _documents_backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                            v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, causal: bool,
                            softmax_scale: float, docs: TileSlices
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """dq [t_q, 1, hq, d], dk [t_kv, 1, hkv, d], dv [t_kv, 1, hkv, dv]; out / lse are the whole row's."""
        te = _load()
        q3, k3, v3 = (t[:, 0].contiguous() for t in (q, k, v))
        out3, dout3 = (t[:, 0].to(q.dtype).contiguous() for t in (out, dout))
        packed = _stats_per_token(q.device)
        stats = lse_to_te(lse, docs, packed, stats_rows(te.minor, docs.cu_q[-1]))
        fn = te.fused_attn.fused_attn_bwd
        kw = thd_bwd_kwargs(
            _parameters(fn)[0], dout3, q3, k3, v3, out3, [stats, rng_state(q.device)],
            docs, causal, softmax_scale, te.backend, te.te_dtype[q.dtype],
            cuda_graph=_capturing(q),
            deterministic=self.deterministic,
        )
        dq, dk, dv = _call(fn, kw, te.version)[:3]
        return dq.unsqueeze(1), dk.unsqueeze(1), dv.unsqueeze(1)


__all__ = ["TEFusedKernel", "TileSpec", "attention_params", "bwd_kwargs", "fwd_kwargs",
           "is_available", "lse_from_te", "lse_to_te", "pack_bwd_kwargs", "pack_fwd_kwargs",
           "packed_stats", "runs_backward", "runs_forward", "stats_rows", "te_rejects",
           "te_version", "thd_bwd_kwargs", "thd_fwd_kwargs", "tile_spec", "unavailable"]
