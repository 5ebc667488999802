"""Log-sum-exp merging of partial attention results, in fp32: the one merge of the package
(the schedules' tiles, the sink's extra logit in masks/sink.py, decode's CP partials).

On CUDA with Triton importable, `merge_into` is one fused kernel (`merge_triton`); else
(CPU, no Triton, MESH_TRITON_MERGE=0) the torch ops below (`merge_into_torch`).
"""
from __future__ import annotations

import torch

from . import merge_triton


def bhs_to_sbh1(t: torch.Tensor) -> torch.Tensor:
    """A per-row value [b, h, s] (lse, D) -> [s, b, h, 1], to scale tensors [s, b, h, d]."""
    return t.permute(2, 0, 1).unsqueeze(-1)


def merge_into(
    out_acc: torch.Tensor,
    lse_acc: torch.Tensor,
    out: torch.Tensor | None,
    lse: torch.Tensor,
    rows: slice = slice(None),
) -> None:
    """Fold a partial (out [s', b, h, d], lse [b, h, s']) into rows `rows` of the fp32
    accumulators out_acc [s, b, h, d] and lse_acc [b, h, s], in place.

    Rows whose accumulated lse is still -inf (nothing merged yet) take the partial as is.
    out None: a partial whose output is 0 (an attention sink; lse may broadcast, [1, h, 1]).
    One Triton kernel where `merge_triton.available`, else `merge_into_torch`.
    """
    acc_o, acc_l = out_acc[rows], lse_acc[..., rows]
    if out is not None and merge_triton.available(acc_o):
        merge_triton.merge_into(acc_o, acc_l, out, lse)
    else:
        merge_into_torch(acc_o, acc_l, out, lse)


def merge_into_torch(
    acc_o: torch.Tensor, acc_l: torch.Tensor, out: torch.Tensor | None, lse: torch.Tensor
) -> None:
    """`merge_into` on the rows given, with torch ops (ten kernels, two passes over acc_o).

    In place, one weight at a time: the temporaries are two [b, h, s'] fp32 tensors (the new
    lse and one weight), none of the size of the output.
    """
    lse = lse.float()
    new_l = torch.logaddexp(acc_l, lse)
    acc_o.mul_(bhs_to_sbh1(weight(acc_l, new_l)))
    if out is not None:
        acc_o.addcmul_(out, bhs_to_sbh1(weight(lse, new_l)))
    acc_l.copy_(new_l)


def weight(lse: torch.Tensor, new_lse: torch.Tensor) -> torch.Tensor:
    """exp(lse - new_lse) [b, h, s], 0 where both are -inf (no partial merged there yet)."""
    return torch.sub(lse, new_lse).exp_().nan_to_num_(nan=0.0)


def empty_accumulators(
    s: int, b: int, h: int, d: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero fp32 output [s, b, h, d] and -inf lse [b, h, s] accumulators."""
    out = torch.zeros(s, b, h, d, dtype=torch.float32, device=device)
    lse = torch.full((b, h, s), float("-inf"), dtype=torch.float32, device=device)
    return out, lse
