"""Byte sizes and dtypes the layer and its models speak of (one home for each)."""
from __future__ import annotations

from typing import NamedTuple

import torch

FP32_BYTES = 4  # lse, D, fp32 accumulators and fp32 gradient exchanges
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}  # input dtypes by their flag names


class GradDtypes(NamedTuple):
    """The torch dtypes gradient partials travel in: dq over the row, dkv over the column
    (`plan.GradDtype` decides them for the input dtype)."""

    dq: torch.dtype
    dkv: torch.dtype


FP32_GRADS = GradDtypes(torch.float32, torch.float32)
