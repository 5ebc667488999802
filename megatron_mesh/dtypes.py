"""Byte sizes of the dtypes the layer and its models speak of (one home for each)."""
from __future__ import annotations

FP32_BYTES = 4  # lse, D, fp32 accumulators and (by default) the gradient exchange
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}  # input dtypes by their flag names
