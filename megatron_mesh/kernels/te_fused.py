"""Tile kernel on Transformer Engine's fused attention (cuDNN, F16_arbitrary_seqlen backend).

Calls `transformer_engine.pytorch.cpp_extensions.fused_attn.fused_attn_fwd` / `_bwd` on
q [sq, b, hq, d], k / v [sk, b, hkv, d] ("sbhd_sbhd_sbhd"; GQA / MQA run natively, dk / dv
come back with hkv heads). The keyword arguments come from `fwd_kwargs` / `bwd_kwargs`, pure
functions of the TE version: its Python signature changed in 2.8, 2.9, 2.10, 2.12 and 2.15
(see docs/kernels.md). TE is imported lazily: this module imports without it.
"""
from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Sequence

import torch
from packaging.version import InvalidVersion, Version

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


def _common_kwargs(
    ver: tuple[int, int],
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
    """The keyword arguments fused_attn_fwd and fused_attn_bwd share in TE `ver`."""
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
    if ver >= (2, 8):
        kw["softmax_type"] = "vanilla"
    if ver >= (2, 10):
        kw["cuda_graph"] = cuda_graph
    if ver >= (2, 12):
        kw["bottom_right_diagonal"] = False
    if ver >= (2, 15):
        kw["o_format"] = FORMAT
    return kw


def fwd_kwargs(
    version: str,
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
    """Keyword arguments of `fused_attn_fwd` in TE `version` for one tile, no bias/dropout.

    q [sq, b, hq, d], k / v [sk, b, hkv, d]; cu_seqlens_* [b + 1] int32; `backend` is
    FusedAttnBackend["F16_arbitrary_seqlen"] of that TE.
    """
    ver = minor_version(version)
    kw = _common_kwargs(ver, q, k, v, cu_seqlens_q, cu_seqlens_kv, causal, softmax_scale,
                        backend, cuda_graph)
    kw["is_training"] = True  # only then does TE return the softmax stats (lse)
    if ver >= (2, 9):
        kw["return_max_logit"] = False  # True would change the returned tuple
    return kw


def bwd_kwargs(
    version: str,
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
    """Keyword arguments of `fused_attn_bwd` in TE `version` for one tile.

    out, dout [sq, b, hq, d]; aux_ctx_tensors = [lse [b, hq, sq, 1] fp32, rng_state [2] int64];
    dqkv_te_dtype is TE's DType of the gradients (an argument only before 2.15).
    """
    ver = minor_version(version)
    kw = _common_kwargs(ver, q, k, v, cu_seqlens_q, cu_seqlens_kv, causal, softmax_scale,
                        backend, cuda_graph)
    kw.update(o=out, d_o=dout, aux_ctx_tensors=list(aux_ctx_tensors), deterministic=deterministic)
    if ver < (2, 15):
        kw["dqkv_dtype"] = dqkv_te_dtype
    else:
        kw["do_format"] = FORMAT
        kw["dqkv_layout"] = QKV_LAYOUT  # its default "sbh3d" would allocate packed dQKV
    return kw


@dataclass(frozen=True)
class _TE:
    """The imported pieces of Transformer Engine this kernel uses."""

    version: str
    fused_attn: ModuleType
    backend: Any
    te_dtype: Any  # torch dtype -> TE DType


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
    return _TE(version, fused_attn, fused_attn.FusedAttnBackend[BACKEND], constants.TE_DType)


@functools.lru_cache(maxsize=None)
def is_available() -> bool:
    """True when CUDA is available and a supported Transformer Engine imports."""
    if te_version() is None or not torch.cuda.is_available():
        return False
    try:
        _load()
    except Exception:  # a broken TE install fails in many ways (ImportError, OSError, ...)
        return False
    return True


@functools.lru_cache(maxsize=None)
def _parameters(fn: Callable) -> tuple[set[str], set[str]]:
    """(all, required) parameter names of fn."""
    params = inspect.signature(fn).parameters
    required = {n for n, p in params.items() if p.default is inspect.Parameter.empty}
    return set(params), required


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


def _cu_seqlens(batch: int, seqlen: int, device: torch.device) -> torch.Tensor:
    """[0, s, 2s, ..., b*s] int32: b full-length sequences."""
    return torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32, device=device)


def _uses_te(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in TE_DTYPES


class TEFusedKernel:
    """The TileKernel of `kernels/base.py` on TE's cuDNN fused attention.

    fp16 / bf16 CUDA tensors go to TE; anything else (fp32, CPU) to `TorchFlashKernel`.
    `deterministic` follows TE's NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 unless given.
    """

    name = "te"

    def __init__(self, deterministic: bool | None = None) -> None:
        if deterministic is None:
            deterministic = os.getenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1") == "0"
        self.deterministic = deterministic
        self._fallback = TorchFlashKernel()

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """out [sq, b, hq, d] in q's dtype, lse [b, hq, sq] fp32."""
        if not _uses_te(q):
            return self._fallback.forward(q, k, v, causal, softmax_scale)
        te = _load()
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        sq, b, hq, _ = q.shape
        kw = fwd_kwargs(
            te.version, q, k, v,
            _cu_seqlens(b, sq, q.device), _cu_seqlens(b, k.shape[0], q.device),
            causal, softmax_scale, te.backend,
            cuda_graph=torch.cuda.is_current_stream_capturing(),
        )
        out, aux = _call(te.fused_attn.fused_attn_fwd, kw, te.version)[:2]
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
        if not _uses_te(q):
            return self._fallback.backward(dout, q, k, v, out, lse, causal, softmax_scale)
        te = _load()
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out, dout = out.to(q.dtype).contiguous(), dout.to(q.dtype).contiguous()
        sq, b, hq, _ = q.shape
        stats = lse.to(torch.float32).reshape(b, hq, sq, 1).contiguous()
        rng_state = torch.zeros(2, dtype=torch.int64, device=q.device)  # unused: no dropout
        kw = bwd_kwargs(
            te.version, dout, q, k, v, out, [stats, rng_state],
            _cu_seqlens(b, sq, q.device), _cu_seqlens(b, k.shape[0], q.device),
            causal, softmax_scale, te.backend, te.te_dtype[q.dtype],
            cuda_graph=torch.cuda.is_current_stream_capturing(),
            deterministic=self.deterministic,
        )
        dq, dk, dv = _call(te.fused_attn.fused_attn_bwd, kw, te.version)[:3]
        return dq, dk, dv


__all__ = ["TEFusedKernel", "bwd_kwargs", "fwd_kwargs", "is_available", "te_version"]
