"""The machine the planner prices: GPUs, nodes, link bandwidths and attention speed.

Attention is priced at a flat `attention_tflops` (FLOPs / rate), or, given a GPU profile
(`gpu`, `gpu_profile.load_profile`), by the rank's kernel calls as measured on that GPU
(`GpuProfile.tile_seconds`: a fixed cost per call, and a rate that falls for small calls).

Bandwidths are GB/s (10^9 bytes/s) that ONE GPU achieves when every GPU sends at once:
`inter_node_bw` is therefore a node's NIC bandwidth divided by the GPUs that share it
(e.g. 8 GPUs with one 400 Gb/s NIC each: about 45 GB/s achieved per GPU). The defaults
describe an H100 SXM node (NVLink 4, 8 x 400 Gb/s) with achieved, not peak, numbers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_mesh.layer_plan import check_positive_int
from megatron_mesh.planner.gpu_profile import GpuProfile

if TYPE_CHECKING:
    from megatron_mesh.planner.pricing.tiles import TileCalls

DEFAULT_GPUS_PER_NODE = 8
DEFAULT_INTRA_NODE_BW = 360.0
DEFAULT_INTER_NODE_BW = 45.0
DEFAULT_ATTENTION_TFLOPS = 400.0
GB = 1e9
TFLOP = 1e12


@dataclass(frozen=True)
class Cluster:
    """`gpus` CP ranks, `gpus_per_node` per node; rank r lives on node r // gpus_per_node."""

    gpus: int
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE
    intra_node_bw: float = DEFAULT_INTRA_NODE_BW
    inter_node_bw: float = DEFAULT_INTER_NODE_BW
    attention_tflops: float = DEFAULT_ATTENTION_TFLOPS
    gpu: GpuProfile | None = None  # None: attention at the flat attention_tflops

    def __post_init__(self) -> None:
        for name in ("gpus", "gpus_per_node"):
            check_positive_int(name, getattr(self, name))
        for name in ("intra_node_bw", "inter_node_bw", "attention_tflops"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")

    @property
    def nodes(self) -> int:
        return -(-self.gpus // self.gpus_per_node)

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def bandwidth(self, crosses_nodes: bool) -> float:
        """Bytes per second one GPU sends over the slowest link a collective crosses."""
        return (self.inter_node_bw if crosses_nodes else self.intra_node_bw) * GB

    def compute_seconds(self, flops: float) -> float:
        """`flops` at the flat attention rate."""
        return flops / (self.attention_tflops * TFLOP)

    def attention_seconds(self, phase: str, flops: float, calls: TileCalls | None = None) -> float:
        """One rank's attention time in `phase` for `flops` in `calls`: by the GPU profile
        where there is one and the calls are known, else at the flat rate."""
        if self.gpu is None or calls is None:
            return self.compute_seconds(flops)
        return self.gpu.tile_seconds(phase, flops, calls.count(phase), calls.rows, calls.heads,
                                     calls.batch, calls.dtype)

    @property
    def attention_text(self) -> str:
        """How attention is priced, for people."""
        if self.gpu is None:
            return f"attention {self.attention_tflops:g} TFLOP/s per GPU"
        return f"attention by kernel calls, {self.gpu.describe()}"
