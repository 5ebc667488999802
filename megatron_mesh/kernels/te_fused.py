"""Tile kernel on Transformer Engine's fused attention (cuDNN, F16_arbitrary_seqlen backend).

Calls `transformer_engine.pytorch.cpp_extensions.fused_attn.fused_attn_fwd` / `_bwd` on
q [sq, b, hq, d], k / v [sk, b, hkv, d] ("sbhd_sbhd_sbhd"; GQA / MQA run natively, dk / dv
come back with hkv heads), after TE's own backend query (`get_attention_backend`) has
accepted the tile's shape, dtype, heads, mask and window. The keyword arguments come from
`fwd_kwargs` / `bwd_kwargs`, pure functions of the installed function's parameter names
(its Python signature changed in 2.8, 2.9, 2.10, 2.12 and 2.15, see docs/kernels.md).
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

from .base import log_once
from .torch_flash import TorchFlashKernel

MIN_VERSION = (2, 1)
QKV_LAYOUT = "sbhd_sbhd_sbhd"
FORMAT = "sbhd"
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


def _mask(causal: bool) -> tuple[str, tuple[int, int]]:
    """attn_mask_type and the window_size TE pairs with it (top-left causal, or none)."""
    return ("causal", (-1, 0)) if causal else ("no_mask", (-1, -1))


# Keyword arguments passed only where the installed function has the parameter (each was
# added in some 2.x release, see docs/kernels.md), with the value that keeps the default
# behaviour of the releases before it.
_OPTIONAL_COMMON = {
    "softmax_type": "vanilla",
    "bottom_right_diagonal": False,  # top-left causal
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
    parameter names are `params`."""
    mask, window = _mask(causal)
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
        attn_mask_type=mask,
        window_size=window,
    )
    kw.update((n, val) for n, val in _OPTIONAL_COMMON.items() if n in params)
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

    q [sq, b, hq, d], k / v [sk, b, hkv, d]; cu_seqlens_* [b + 1] int32; `backend` is
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

    out, dout [sq, b, hq, d]; aux_ctx_tensors = [lse [b, hq, sq, 1] fp32, rng_state [2] int64];
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


@dataclass(frozen=True)
class _TE:
    """The imported pieces of Transformer Engine this kernel uses."""

    version: str
    fused_attn: ModuleType
    backend: Any
    te_dtype: Any  # torch dtype -> TE DType
    selection: ModuleType | None  # the module with AttentionParams / get_attention_backend


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
    return _TE(version, fused_attn, fused_attn.FusedAttnBackend[BACKEND], constants.TE_DType,
               selection)


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


def attention_params(fields: Collection[str], spec: TileSpec) -> dict[str, Any]:
    """Keyword arguments of TE's `AttentionParams` (whose field names are `fields`) for one
    tile in our layout, mask and window; fields this TE lacks are left out."""
    mask, window = _mask(spec.causal)
    values: dict[str, Any] = dict(
        qkv_type=torch.Tensor, qkv_dtype=spec.dtype, qkv_layout=QKV_LAYOUT,
        batch_size=spec.batch, num_heads=spec.heads, num_gqa_groups=spec.kv_heads,
        max_seqlen_q=spec.sq, max_seqlen_kv=spec.sk, head_dim_qk=spec.head_dim,
        head_dim_v=spec.head_dim, attn_mask_type=mask, window_size=window,
        bottom_right_diagonal=False, core_attention_bias_type="no_bias",
        attention_dropout=0.0, deterministic=spec.deterministic, is_training=True, fp8=False,
        softmax_type="vanilla", return_max_logit=False, cuda_graph=spec.cuda_graph,
    )
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
    result = te.selection.get_attention_backend(params_cls(**attention_params(names, spec)))
    backend = fused_backend_of(result)
    if backend is None:
        return (f"Transformer Engine {te.version} has no fused attention for {spec.dtype}, "
                f"{spec.heads}/{spec.kv_heads} heads of {spec.head_dim}, sq {spec.sq}, "
                f"sk {spec.sk}, {'causal' if spec.causal else 'no mask'} on this GPU / cuDNN")
    if int(backend) != int(te.backend):
        return (f"Transformer Engine {te.version} picks fused sub-backend {int(backend)}, not "
                f"{BACKEND} ({int(te.backend)}) whose softmax stats this kernel reads")
    return None


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


_CU_SEQLENS: dict[tuple[torch.device, int, int], torch.Tensor] = {}
_RNG_STATE: dict[torch.device, torch.Tensor] = {}


def cu_seqlens(batch: int, seqlen: int, device: torch.device) -> torch.Tensor:
    """[0, s, 2s, ..., b*s] int32 (b full-length sequences), made once per (device, b, s)."""
    key = (torch.device(device), batch, seqlen)
    t = _CU_SEQLENS.get(key)
    if t is None:
        t = _CU_SEQLENS[key] = torch.arange(0, (batch + 1) * seqlen, seqlen,
                                            dtype=torch.int32, device=device)
    return t


def rng_state(device: torch.device) -> torch.Tensor:
    """A zero [2] int64 rng state on `device`, made once (read only with dropout)."""
    t = _RNG_STATE.get(device)
    if t is None:
        t = _RNG_STATE[device] = torch.zeros(2, dtype=torch.int64, device=device)
    return t


def _uses_te(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in TE_DTYPES


class TEFusedKernel:
    """The TileKernel of `kernels/base.py` on TE's cuDNN fused attention.

    Each tile shape is first put to TE's own backend query (`te_rejects`, once per shape);
    tiles TE turns down, and anything not fp16 / bf16 on CUDA, go to `fallback` (the next
    choice of `choice.choose`; torch's ops when not given), the reason logged once.
    `deterministic` follows TE's NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 unless given.
    """

    name = "te"

    def __init__(self, deterministic: bool | None = None, fallback: Any = None) -> None:
        if deterministic is None:
            deterministic = os.getenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1") == "0"
        self.deterministic = deterministic
        self._fallback = fallback if fallback is not None else TorchFlashKernel()
        self._takes: dict[tuple, bool] = {}

    def _te_takes(self, q: torch.Tensor, k: torch.Tensor, causal: bool) -> bool:
        """Whether TE runs this tile (asked once per shape, dtype and mask)."""
        if not _uses_te(q):
            return False
        capturing = torch.cuda.is_current_stream_capturing()
        key = (q.shape, k.shape, q.dtype, causal, capturing)
        takes = self._takes.get(key)
        if takes is None:
            sq, b, hq, d = q.shape
            spec = TileSpec(q.dtype, b, hq, k.shape[2], sq, k.shape[0], d, causal,
                            self.deterministic, capturing)
            try:
                why = te_rejects(spec)
            except Exception as e:  # a query that fails says no more than a refusal
                why = f"Transformer Engine's backend query failed ({type(e).__name__}: {e})"
            if why is not None:
                log_once(f"te tile kernel: {why}; these tiles run on "
                                f"{self._fallback.name}")
            takes = self._takes[key] = why is None
        return takes

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """out [sq, b, hq, d] in q's dtype, lse [b, hq, sq] fp32."""
        if not self._te_takes(q, k, causal):
            return self._fallback.forward(q, k, v, causal, softmax_scale)
        te = _load()
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        sq, b, hq, _ = q.shape
        fn = te.fused_attn.fused_attn_fwd
        kw = fwd_kwargs(
            _parameters(fn)[0], q, k, v,
            cu_seqlens(b, sq, q.device), cu_seqlens(b, k.shape[0], q.device),
            causal, softmax_scale, te.backend,
            cuda_graph=torch.cuda.is_current_stream_capturing(),
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
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """dq [sq, b, hq, d], dk, dv [sk, b, hkv, d]; out / lse are the whole row's."""
        if not self._te_takes(q, k, causal):
            return self._fallback.backward(dout, q, k, v, out, lse, causal, softmax_scale)
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
            cuda_graph=torch.cuda.is_current_stream_capturing(),
            deterministic=self.deterministic,
        )
        dq, dk, dv = _call(fn, kw, te.version)[:3]
        return dq, dk, dv


__all__ = ["TEFusedKernel", "TileSpec", "attention_params", "bwd_kwargs", "fwd_kwargs",
           "is_available", "te_rejects", "te_version", "unavailable"]
