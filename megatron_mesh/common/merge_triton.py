"""The log-sum-exp merge of one tile's partial as ONE fused Triton kernel (CUDA).

`merge_into(acc_o, acc_l, out, lse)` does what `common.merge.merge_into` does with torch ops (ten
kernels and two passes over the fp32 accumulator) in one pass: each program takes a block
of rows (s, b, h) with their whole head dim, reads the accumulated lse and the partial's,
forms new_lse = logaddexp(acc_lse, lse) and the two weights exp(. - new_lse) (0 where both
are -inf), rescales its accumulator rows, adds the weighted partial, and writes new_lse.
Rows are disjoint between programs, so reading and writing the lse needs no barrier.

Any strides (the accumulators may be row slices); `out` in any float dtype, lse fp32.
Triton is imported only on first use; `available()` says whether it imports.
`MESH_TRITON_MERGE=0` turns the kernel off (then `merge.merge_into` uses torch's ops).
With `TRITON_INTERPRET=1` Triton runs the kernel on CPU tensors (how CI checks it).
"""
from __future__ import annotations

import functools
import importlib.util
import os

import torch

MAX_HEAD_DIM = 512
ELEMENTS_PER_PROGRAM = 4096


@functools.lru_cache(maxsize=None)
def _importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def available(t: torch.Tensor) -> bool:
    """Whether the fused kernel runs for accumulators like `t`: CUDA (or any tensor under
    TRITON_INTERPRET=1), Triton importable, not turned off, head dim up to MAX_HEAD_DIM."""
    if os.environ.get("MESH_TRITON_MERGE", "1") == "0" or t.shape[-1] > MAX_HEAD_DIM:
        return False
    on_device = t.is_cuda or (t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")
    return on_device and _importable()


@functools.lru_cache(maxsize=None)
def _kernel(interpret: bool):
    """The jitted kernel (one per interpreter setting: Triton reads it when decorating)."""
    import triton
    import triton.language as tl

    @triton.jit
    def merge_kernel(acc_o, acc_l, out, lse, n_rows, B, H, D,
                     ao_s, ao_b, ao_h, ao_d, al_b, al_h, al_s,
                     o_s, o_b, o_h, o_d, l_b, l_h, l_s,
                     BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        rmask = r < n_rows
        h = r % H
        b = (r // H) % B
        s = r // (H * B)
        al_ptr = acc_l + b * al_b + h * al_h + s * al_s
        a = tl.load(al_ptr, mask=rmask, other=float("-inf"))
        p = tl.load(lse + b * l_b + h * l_h + s * l_s, mask=rmask,
                    other=float("-inf")).to(tl.float32)
        m = tl.maximum(a, p)
        empty = m == float("-inf")  # nothing merged yet and an empty partial: weights 0
        m0 = tl.where(empty, 0.0, m)
        total = tl.where(empty, 1.0, tl.exp(a - m0) + tl.exp(p - m0))  # >= 1 where not empty
        new_l = tl.where(empty, float("-inf"), m0 + tl.log(total))
        new0 = tl.where(empty, 0.0, new_l)
        wa = tl.where(empty, 0.0, tl.exp(a - new0))
        wp = tl.where(empty, 0.0, tl.exp(p - new0))
        d = tl.arange(0, BLOCK_D)
        mask = rmask[:, None] & (d < D)[None, :]
        ao_ptr = acc_o + (s * ao_s + b * ao_b + h * ao_h)[:, None] + d[None, :] * ao_d
        o_ptr = out + (s * o_s + b * o_b + h * o_h)[:, None] + d[None, :] * o_d
        acc = tl.load(ao_ptr, mask=mask, other=0.0)
        x = tl.load(o_ptr, mask=mask, other=0.0).to(tl.float32)
        tl.store(ao_ptr, acc * wa[:, None] + x * wp[:, None], mask=mask)
        tl.store(al_ptr, new_l, mask=rmask)

    return merge_kernel


def merge_into(acc_o: torch.Tensor, acc_l: torch.Tensor, out: torch.Tensor,
               lse: torch.Tensor) -> None:
    """Fold a partial (out [s, b, h, d], lse [b, h, s]) into the fp32 accumulators
    acc_o [s, b, h, d] and acc_l [b, h, s] (same s; row slices are fine), in place, in one
    kernel launch."""
    s, b, h, d = acc_o.shape
    if out.shape != acc_o.shape or lse.shape != acc_l.shape or acc_l.shape != (b, h, s):
        raise ValueError(f"merge: out {tuple(out.shape)} / lse {tuple(lse.shape)} do not fit "
                         f"accumulators {tuple(acc_o.shape)} / {tuple(acc_l.shape)}")
    n_rows = s * b * h
    if n_rows == 0:
        return
    import triton

    block_d = triton.next_power_of_2(d)
    block_r = max(1, ELEMENTS_PER_PROGRAM // block_d)
    kernel = _kernel(os.environ.get("TRITON_INTERPRET") == "1")
    kernel[(triton.cdiv(n_rows, block_r),)](
        acc_o, acc_l, out, lse, n_rows, b, h, d,
        *acc_o.stride(), *acc_l.stride(), *out.stride(), *lse.stride(),
        BLOCK_R=block_r, BLOCK_D=block_d,
    )
