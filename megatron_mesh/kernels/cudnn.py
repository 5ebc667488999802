"""Tile kernel on torch's own cuDNN fused-attention op (`aten._scaled_dot_product_cudnn_attention`
and its backward): the cuDNN kernels Transformer Engine's fused attention calls, without TE.

fp16 / bf16 CUDA tensors, head dim a multiple of 8 up to 128; `supports` says which inputs
it takes. K/V heads are repeated for GQA inside the call, as in `torch_flash`.
"""
from __future__ import annotations

import torch

from .torch_flash import bhsd, repeat_kv, sbhd, sum_kv_grad

aten = torch.ops.aten
DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 128
MIN_CUDNN = 90000  # cuDNN 9: torch's SDPA cuDNN backend needs it


def unsupported(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why this kernel cannot run tiles of `dtype` with `head_dim` on `device`, or None."""
    if not hasattr(aten, "_scaled_dot_product_cudnn_attention"):
        return f"torch {torch.__version__} has no _scaled_dot_product_cudnn_attention op"
    if device.type == "meta":
        pass  # shapes only: no cuDNN is needed to check the calls
    elif device.type != "cuda":
        return f"tensors are on {device}, cuDNN attention needs CUDA"
    else:
        version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        if version is None or version < MIN_CUDNN:
            return f"cuDNN {version or 'not available'}; cuDNN attention needs cuDNN >= 9"
    if dtype not in DTYPES:
        return f"dtype {dtype} is not one of float16, bfloat16"
    if head_dim % 8 or head_dim > MAX_HEAD_DIM:
        return f"head dim {head_dim} is not a multiple of 8 up to {MAX_HEAD_DIM}"
    return None


def _dense(t: torch.Tensor) -> torch.Tensor:
    """[b, h, s, d] as cuDNN takes it: dense head dim and no broadcast (stride 0) dim."""
    return t.contiguous() if 0 in t.stride() else t


class CudnnKernel:
    """The TileKernel of `kernels/base.py` on torch's cuDNN attention op (CUDA, fp16 / bf16)."""

    name = "cudnn"

    def forward(self, q, k, v, causal: bool, softmax_scale: float):
        """out [sq, b, hq, d] in q's dtype, lse [b, hq, sq] fp32."""
        groups = q.shape[2] // k.shape[2]
        qb = _dense(bhsd(q))
        kb, vb = (_dense(repeat_kv(bhsd(t), groups)) for t in (k, v))
        out, lse, *_ = aten._scaled_dot_product_cudnn_attention(
            qb, kb, vb, None, True, 0.0, causal, False, scale=softmax_scale
        )
        sq, b, hq, _ = q.shape
        return sbhd(out), lse.reshape(b, hq, sq).float()

    def backward(self, dout, q, k, v, out, lse, causal: bool, softmax_scale: float):
        """dq [sq, b, hq, d], dk, dv [sk, b, hkv, d]; out / lse are the whole row's."""
        groups = q.shape[2] // k.shape[2]
        qb, ob = _dense(bhsd(q)), _dense(bhsd(out.to(q.dtype)))
        dob = _dense(bhsd(dout.to(q.dtype)))
        kb, vb = (_dense(repeat_kv(bhsd(t), groups)) for t in (k, v))
        sq, b, hq, _ = q.shape
        stats = lse.float().reshape(b, hq, sq, 1).contiguous()  # as the forward returns it
        unused = torch.zeros((), dtype=torch.int64, device=q.device)  # philox: no dropout
        dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
            dob, qb, kb, vb, ob, stats, unused, unused, None, None, None, sq, k.shape[0],
            0.0, causal, scale=softmax_scale,
        )
        return sbhd(dq), sbhd(sum_kv_grad(dk, groups)), sbhd(sum_kv_grad(dv, groups))
