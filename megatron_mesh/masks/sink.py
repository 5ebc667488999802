"""Attention sinks: one more logit per head whose value vector is 0 (gpt-oss; Megatron-Core's
`softmax_type` "learnable", "off-by-one" with the logit fixed at 0):

    out_i = sum_j e^(s_ij) v_j / (sum_j e^(s_ij) + e^(sink_h))

The mesh merges a row's partials exactly by log-sum-exp, so the sink is one more partial
(out 0, lse = sink) merged once per query row at its owner, after every block
(`attention.finish_rows`, with the mesh's merge `common.merge.merge_into`): out <- out
e^(lse - lse'), lse' = log(e^lse + e^sink). The tiles
and their backward are unchanged: they take the row's final lse', and D = rowsum(dO * O)
of the final output, which is what softmax with the extra column gives. The sink's
gradient is d sink_h = -sum_rows e^(sink_h - lse') D over this rank's rows: a partial, which
the CP group's gradient reduction sums (as Megatron's reduction over data x context
parallel ranks does). No bytes travel for it.
"""
from __future__ import annotations

import torch

from ..common.merge import merge_into


def check_offset(offset: object, q_heads: int) -> None:
    """ValueError unless `offset` is None or a float32 [q_heads] tensor of finite values."""
    if offset is None:
        return
    if not isinstance(offset, torch.Tensor) or offset.dtype != torch.float32 or \
            tuple(offset.shape) != (q_heads,):
        what = (f"{offset.dtype} {tuple(offset.shape)}" if isinstance(offset, torch.Tensor)
                else type(offset).__name__)
        raise ValueError(f"softmax_offset must be a float32 tensor [{q_heads}] (one sink "
                         f"logit per query head), got {what}")
    if offset.device.type != "cpu":  # no device-to-host wait per call on an accelerator
        return
    if not bool(torch.isfinite(offset.detach()).all()):
        raise ValueError("softmax_offset holds a non-finite value; the sink logits must be "
                         "finite")


def add_sink(out: torch.Tensor, lse: torch.Tensor, offset: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """out [s, b, h, dv] fp32 (scaled in place), lse [b, h, s] fp32 of whole rows and the
    heads' sink logits offset [h] -> (out, lse') with the sink merged in."""
    sink = offset.detach().to(device=lse.device, dtype=torch.float32)[None, :, None]
    merged = lse.float().clone()  # the caller's lse stays as it was
    merge_into(out, merged, None, sink)  # a partial of output 0; rows that saw no key: 0
    return out, merged


def sink_grad(delta: torch.Tensor, lse: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """d offset [h] (fp32) of this rank's rows: -sum over rows of e^(sink_h - lse') D, with
    D = rowsum(dO * O) [b, h, s] of the final output and lse' [b, h, s]."""
    sink = offset.detach().to(device=lse.device, dtype=torch.float32)[None, :, None]
    return -(torch.exp(sink - lse) * delta).sum((0, 2)).to(offset.dtype)
