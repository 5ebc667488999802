"""Time model: what a list of transfers plus the tile compute costs per pass.

Per pass (forward, backward) and per GPU:

    compute = pass FLOPs / P / attention TFLOP/s                              (flat rate)
    compute = the rank's kernel calls priced by the GPU's profile             (--gpu)
              (`planner.tiles`, `GpuProfile.tile_seconds`)
    comm(t) = bytes(t) / bandwidth of the slowest link t's groups cross
              (all-to-all: max(off-node bytes / NIC, on-node bytes / intra-node link))
    time    = sum(comm of exposed t) + ring                                  (overlap on)
    ring    = w + (n-1) max(w, h / (n-1)) + r / (n-1)
    time    = compute + sum(comm of all t)                                   (overlap off)

A transfer is "hidden" when the method's schedule runs it while tiles compute, as a ring of
n members (ring p2p steps, the mesh's column or row ring): the ring takes n steps of
w = compute / n each, and the chunk for step t + 1 travels during step t, so the n - 1 hops
of the hidden transfers (h seconds in all) overlap n - 1 of the n steps, not all of the
compute. A partial that trails its chunk (dK, dV of the ring's backward, the mesh's
partial outputs and gradients) leaves after its last block: its last hop (r / (n-1) of its
r seconds) is exposed. All-to-alls, up-front gathers and final reductions are exposed.
Transfers of one pass share the GPU's links one after another (their times add).

The sparse exchange (windows, placed documents) starts its inbound rows (Q, K, V; Q, dO,
lse, D) and computes the rank's own block, which needs none of them, meanwhile: those
transfers ("under the own block", u seconds) cost max(0, u - own) where own is the own
block's compute (the least of any rank's, so the model errs slow), when the caller passes it:

    time    = compute + sum(comm of the other exposed t) + max(0, u - own)
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_mesh.planner.hardware import Cluster
from megatron_mesh.planner.pricing.tiles import TileCalls
from megatron_mesh.planner.pricing.workload import Workload

PHASES = ("forward", "backward")


class NotApplicable(ValueError):
    """A method cannot run this workload on this cluster (e.g. heads do not divide P)."""


@dataclass(frozen=True)
class PricedTransfer:
    """Bytes one GPU sends in one pass over one kind of group."""

    phase: str
    group: str
    tensors: str
    nbytes: int
    crosses_nodes: bool
    hidden: bool
    ring_size: int = 0  # hidden transfers: the members n of the ring that carries them
    trailing: bool = False  # a partial one hop behind its chunk: the last hop is exposed
    # an all-to-all: the share of its bytes that leaves the node through the NIC while the
    # rest moves over the intra-node links at the same time; None: every byte takes the
    # slowest link of the group (rings, gathers, reductions)
    off_node_share: float | None = None
    # the sparse exchange's inbound rows: in flight while the rank's own block computes
    under_own_block: bool = False

    @property
    def inter_node_nbytes(self) -> int:
        """The bytes that leave the node."""
        if not self.crosses_nodes:
            return 0
        return self.nbytes if self.off_node_share is None else round(self.nbytes * self.off_node_share)

    def seconds(self, cluster: Cluster) -> float:
        if self.off_node_share is None:
            return self.nbytes / cluster.bandwidth(self.crosses_nodes)
        return max(self.nbytes * self.off_node_share / cluster.bandwidth(True),
                   self.nbytes * (1 - self.off_node_share) / cluster.bandwidth(False))


@dataclass(frozen=True)
class Estimate:
    """Predicted traffic and time of one method (one mesh shape) for one attention layer."""

    method: str
    label: str
    transfers: tuple[PricedTransfer, ...]
    compute_s: dict[str, float]
    comm_s: dict[str, float]
    time_s: dict[str, float]
    mesh_shape: tuple[int, int] | None = None
    heads: int = 1  # the all-to-all size A of a heads x rows x cols mesh
    calls: TileCalls | None = None  # the rank's kernel calls, where a GPU profile prices them

    @property
    def grid_shape(self) -> tuple[int, int, int] | None:
        """(A, R, C) of a mesh estimate, None for the other methods."""
        return None if self.mesh_shape is None else (self.heads, *self.mesh_shape)

    def bytes(self, phase: str | None = None, group: str | None = None) -> int:
        """Bytes one GPU sends, optionally only in `phase` and / or over `group`."""
        return sum(
            t.nbytes
            for t in self.transfers
            if (phase is None or t.phase == phase) and (group is None or t.group == group)
        )

    @property
    def total_bytes(self) -> int:
        return self.bytes()

    @property
    def inter_node_bytes(self) -> int:
        return sum(t.inter_node_nbytes for t in self.transfers)

    @property
    def total_s(self) -> float:
        return self.time_s["forward"] + self.time_s["backward"]

    @property
    def total_comm_s(self) -> float:
        return self.comm_s["forward"] + self.comm_s["backward"]


@dataclass(frozen=True)
class Unavailable:
    """A method left out of the table, and why."""

    method: str
    reason: str


def price(
    method: str,
    label: str,
    transfers: list[PricedTransfer],
    workload: Workload,
    cluster: Cluster,
    overlap: bool,
    mesh_shape: tuple[int, int] | None = None,
    heads: int = 1,
    flops: dict[str, float] | None = None,
    own_block_flops: dict[str, float] | None = None,
    calls: TileCalls | None = None,
) -> Estimate:
    """Apply the time model of the module docstring to one method's transfers; `flops`:
    each pass's FLOPs on the busiest GPU (default: the workload's, shared by all GPUs);
    `own_block_flops`: each pass's FLOPs of the own block that the transfers under it
    overlap (None: they are exposed); `calls`: the rank's kernel calls, which the cluster's
    GPU profile prices (None, or no profile: the flat rate)."""
    if flops is None:
        flops = {"forward": workload.forward_flops() / cluster.gpus,
                 "backward": workload.backward_flops() / cluster.gpus}
    compute, comm, time = {}, {}, {}
    for phase in PHASES:
        compute[phase] = cluster.attention_seconds(phase, flops[phase], calls)
        mine = [t for t in transfers if t.phase == phase]
        hidden = [t for t in mine if overlap and t.hidden]
        under = sum(t.seconds(cluster) for t in mine if t.under_own_block)
        exposed = sum(t.seconds(cluster) for t in mine
                      if not (overlap and t.hidden) and not t.under_own_block)
        comm[phase] = exposed + under + sum(t.seconds(cluster) for t in hidden)
        own = (cluster.attention_seconds(phase, own_block_flops[phase],
                                         calls and calls.one_call())
               if overlap and own_block_flops else 0.0)
        time[phase] = exposed + max(0.0, under - own) + ring_seconds(hidden, compute[phase], cluster)
    return Estimate(method, label, tuple(transfers), compute, comm, time, mesh_shape, heads,
                    calls)


def ring_seconds(hidden: list[PricedTransfer], compute: float, cluster: Cluster) -> float:
    """The pass's compute with its hidden transfers pipelined under it (module docstring)."""
    h = sum(t.seconds(cluster) for t in hidden)
    n = max((t.ring_size for t in hidden), default=0)
    if n < 2:
        return max(compute, h)
    trailing = sum(t.seconds(cluster) for t in hidden if t.trailing)
    w = compute / n
    return w + (n - 1) * max(w, h / (n - 1)) + trailing / (n - 1)
