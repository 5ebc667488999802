"""The torch dtypes of the layer: input dtypes by their flag names, and the dtypes the
gradient partials travel in (the byte sizes live in `layer_plan`, which imports no torch)."""
from __future__ import annotations

from typing import NamedTuple

import torch

from .layer_plan import DTYPE_BYTES

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
assert TORCH_DTYPES.keys() == DTYPE_BYTES.keys()
DTYPE_NAMES = {dtype: name for name, dtype in TORCH_DTYPES.items()}


def flag_dtype_name(bf16: bool, fp16: bool) -> str:
    """The input dtype's name from Megatron's --bf16 / --fp16 flags: 'bf16', 'fp16' or 'fp32'."""
    return "bf16" if bf16 else "fp16" if fp16 else "fp32"


def flag_dtype(bf16: bool, fp16: bool) -> torch.dtype:
    """The torch dtype of Megatron's --bf16 / --fp16 flags (fp32 with neither)."""
    return TORCH_DTYPES[flag_dtype_name(bf16, fp16)]


class GradDtypes(NamedTuple):
    """The torch dtypes gradient partials travel in: dq over the row, dkv over the column
    (`layer_plan.GradDtype` decides them for the input dtype)."""

    dq: torch.dtype
    dkv: torch.dtype


FP32_GRADS = GradDtypes(torch.float32, torch.float32)
