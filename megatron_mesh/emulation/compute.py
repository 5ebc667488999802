"""A tile kernel whose compute is emulated: it sleeps for the tile's modelled time.

The interface of `megatron_mesh.kernels.base.TileKernel`; the results are zeros of the right
shapes and dtypes (out [sq, b, hq, dv], lse [b, hq, sq] fp32; dq, dk, dv like q, k, v), so
every schedule runs its real communication and merging around tiles that cost what the
planner's compute model says: forward 4 sq sk hq d b FLOPs (half when causal), backward
`BACKWARD_FLOPS_RATIO` times that, at the emulated GPU's attention FLOP/s. A call with
slices (`TileSlices`: packed documents, a sliding window's band, any slices) costs 4 hq d b
per (query, key) pair they keep (`TileSlices.pairs`), as the planner prices windows
(`planner.windows.kept_pairs`): a varlen call over documents their in-document pairs only,
never the dense sq x sk.
Given a GPU profile (`planner.gpu_profile`), a call sleeps its share of a tile on that GPU
instead (`GpuProfile.share_seconds`: the larger of the host's time per call and the call's
GPU time plus its merge, at the call's FLOPs, query rows, heads and dtype), as the planner
prices calls with that profile.
"""
from __future__ import annotations

import time

import torch

from megatron_mesh.calls.tile_slices import TileSlices
from megatron_mesh.dtypes import DTYPE_NAMES
from megatron_mesh.kernels.base import check_call
from megatron_mesh.kernels.caps import KernelCaps
from megatron_mesh.layer_plan import BACKWARD_FLOPS_RATIO, attention_flops
from megatron_mesh.planner.gpu_profile import GpuProfile


def tile_flops(q: torch.Tensor, k: torch.Tensor, causal: bool,
               slices: TileSlices | None = None) -> float:
    """Forward FLOPs of one call: q [sq, b, hq, d] against k [sk, b, hkv, d]; with
    `slices`, of the pairs they keep."""
    sq, b, hq, d = q.shape
    if slices is not None:
        return 4.0 * slices.pairs * b * hq * d
    return attention_flops(sq, k.shape[0], b, hq, d, causal)


class EmulatedKernel:
    """TileKernel that sleeps `flops / flops_rate` seconds per call, or the call's share of
    a tile on `profile`'s GPU (EMULATED compute). Takes tile masks (priced by the pairs they
    keep), packed documents (priced by their in-document pairs) and V's own head dim."""

    name = "emulated"
    caps = KernelCaps(documents=True, tile_mask=True, window=True, v_head_dim=True)

    def __init__(self, flops_rate: float, profile: GpuProfile | None = None) -> None:
        if not flops_rate > 0:
            raise ValueError(f"flops_rate must be a positive number, got {flops_rate!r}")
        self.flops_rate = flops_rate
        self.profile = profile
        self.seconds = 0.0  # emulated compute time slept so far
        self.calls = 0  # calls made so far

    def _compute(self, phase: str, flops: float, q: torch.Tensor) -> None:
        if self.profile is None:
            seconds = flops / self.flops_rate
        else:
            sq, b, hq, _ = q.shape
            dtype = DTYPE_NAMES.get(q.dtype, str(q.dtype))
            seconds = self.profile.share_seconds(phase, flops, sq, hq, b, dtype)
        self.seconds += seconds
        self.calls += 1
        time.sleep(seconds)

    def forward(self, q, k, v, causal: bool, softmax_scale: float, *,
                slices: TileSlices | None = None):
        """Zeros: out [sq, b, hq, dv] in q's dtype, lse [b, hq, sq] fp32."""
        check_call(self, q, v, slices)
        self._compute("forward", tile_flops(q, k, causal, slices), q)
        sq, b, hq, _ = q.shape
        out = torch.zeros(sq, b, hq, v.shape[-1], dtype=q.dtype, device=q.device)
        return out, torch.zeros(b, hq, sq, dtype=torch.float32, device=q.device)

    def backward(self, dout, q, k, v, out, lse, causal: bool, softmax_scale: float, *,
                 slices: TileSlices | None = None):
        """Zeros like q, k, v."""
        check_call(self, q, v, slices)
        self._compute("backward", BACKWARD_FLOPS_RATIO * tile_flops(q, k, causal, slices), q)
        return (torch.zeros(q.shape, dtype=q.dtype, device=q.device),
                torch.zeros(k.shape, dtype=k.dtype, device=k.device),
                torch.zeros(v.shape, dtype=v.dtype, device=v.device))
