"""The modelled cluster and the slowdown at which this machine emulates it."""
from __future__ import annotations

from dataclasses import dataclass, replace

from megatron_mesh.emulation.compute import EmulatedKernel
from megatron_mesh.planner.hardware import GB, TFLOP, Cluster


@dataclass(frozen=True)
class Emulation:
    """`modelled` (e.g. H100 nodes: NVLink inside a node, one 400 Gb/s NIC per GPU) played
    `slowdown` times slower: every link rate and the attention FLOP/s are divided by it (a
    GPU profile's rates too, its fixed times per call multiplied), so the ratio of compute
    to communication is the modelled cluster's."""

    modelled: Cluster
    slowdown: float

    def __post_init__(self) -> None:
        if not self.slowdown > 0:
            raise ValueError(f"slowdown must be a positive number, got {self.slowdown!r}")

    @property
    def cluster(self) -> Cluster:
        """The emulated cluster: what the links and the kernel enforce, and the planner prices."""
        m = self.modelled
        return replace(
            m,
            intra_node_bw=m.intra_node_bw / self.slowdown,
            inter_node_bw=m.inter_node_bw / self.slowdown,
            attention_tflops=m.attention_tflops / self.slowdown,
            gpu=None if m.gpu is None else m.gpu.scaled(rate=1 / self.slowdown,
                                                        time=self.slowdown),
        )

    @property
    def intra_node_rate(self) -> float:
        """Bytes per second over an emulated intra-node link (NVLink, one per GPU)."""
        return self.cluster.intra_node_bw * GB

    @property
    def inter_node_rate(self) -> float:
        """Bytes per second through an emulated GPU's NIC (traffic leaving its node)."""
        return self.cluster.inter_node_bw * GB

    @property
    def flops_rate(self) -> float:
        """Attention FLOP per second of an emulated GPU."""
        return self.cluster.attention_tflops * TFLOP

    def kernel(self) -> EmulatedKernel:
        """The tile kernel that plays this cluster's compute: by its GPU profile when it
        has one, else at its flat FLOP/s."""
        return EmulatedKernel(self.flops_rate, self.cluster.gpu)

    def describe(self) -> str:
        m, c = self.modelled, self.cluster
        if m.gpu is not None:
            return (
                f"EMULATED cluster: {m.nodes} node(s) x {m.gpus_per_node} GPUs; modelled links "
                f"{m.intra_node_bw:g} GB/s intra-node, {m.inter_node_bw:g} GB/s per GPU "
                f"inter-node, attention by kernel calls ({m.gpu.describe()}), played "
                f"{self.slowdown:g}x slower ({c.intra_node_bw * 1e3:.4g} / "
                f"{c.inter_node_bw * 1e3:.4g} MB/s)"
            )
        return (
            f"EMULATED cluster: {m.nodes} node(s) x {m.gpus_per_node} GPUs; modelled links "
            f"{m.intra_node_bw:g} GB/s intra-node, {m.inter_node_bw:g} GB/s per GPU inter-node, "
            f"{m.attention_tflops:g} TFLOP/s attention, played {self.slowdown:g}x slower "
            f"({c.intra_node_bw * 1e3:.4g} / {c.inter_node_bw * 1e3:.4g} MB/s, "
            f"{c.attention_tflops * 1e3:.4g} GFLOP/s)"
        )
