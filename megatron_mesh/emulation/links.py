"""Links shaped in wall-clock time at the project's communication boundary (`comm.py`).

Each emulated GPU has two links, used at once: an intra-node link (NVLink) to the GPUs of
its node and a NIC for traffic that leaves the node (one NIC per GPU, as the eight 400 Gb/s
NICs of an H100 node). A link carries one transfer after another (first come, first served):
a transfer started at t ends at max(t, link free) + bytes / rate. Point-to-point sends and
all-to-alls go straight to each peer, so their bytes split between the two links by where the
peer lives. All-gathers and reduce-scatters run as rings (as NCCL runs them): n-1 steps of
the piece size over the ring's slowest hop, the NIC when the group spans nodes.
`comm.Pending.wait` returns only when both the real gloo transfer and the emulated one are
done; the receiver of a point-to-point send is held by its own sends, not the sender's.
"""
from __future__ import annotations

import time
from typing import Mapping, Sequence

from megatron_mesh.emulation.cluster import Emulation
from megatron_mesh.runtime import comm

RING_COLLECTIVES = ("all_gather", "reduce_scatter")


class ShapedLinks(comm.Observing):
    """The links of global rank `rank` (on node rank // gpus_per_node), while the context is
    open: every collective of `megatron_mesh.runtime.comm` takes at least the emulated time.

        with ShapedLinks(emulation, dist.get_rank()) as links:
            mesh_attention(...).backward(dout)
        links.seconds  # emulated link time reserved, per link

    `shape=False` only counts (bytes per link, the seconds they would take): for links
    shaped outside the project (`scripts/netns_cluster.sh`: network namespaces and tbf).
    """

    def __init__(self, emulation: Emulation, rank: int, shape: bool = True) -> None:
        self.emulation = emulation
        self.rank = rank
        self.shape = shape  # False: count bytes and link seconds, hold nothing (real links)
        self.free_at = {"intra": 0.0, "inter": 0.0}
        self.seconds = {"intra": 0.0, "inter": 0.0}
        self.bytes = {"intra": 0, "inter": 0}

    def observe(self, transfer: comm.Transfer) -> float:
        """The `comm.Observer` hook: the transfer's sends reserved on this rank's links."""
        return self.reserve(transfer.op, transfer.sends(), transfer.group_ranks())

    def node_of(self, rank: int) -> int:
        return rank // self.emulation.modelled.gpus_per_node

    def reserve(self, op: str, sends: Mapping[int, int], group_ranks: Sequence[int]) -> float:
        """The time.monotonic() at which this rank's `sends` (peer -> bytes) are carried."""
        now = time.monotonic()
        me = self.node_of(self.rank)
        load = {"intra": 0, "inter": 0}
        if op in RING_COLLECTIVES:
            spans = len({self.node_of(r) for r in group_ranks}) > 1
            load["inter" if spans else "intra"] = sum(sends.values())
        else:
            for peer, nbytes in sends.items():
                load["intra" if self.node_of(peer) == me else "inter"] += nbytes
        done = now
        for link, nbytes in load.items():
            if nbytes:
                rate = (self.emulation.inter_node_rate if link == "inter"
                        else self.emulation.intra_node_rate)
                self.free_at[link] = max(now, self.free_at[link]) + nbytes / rate
                self.seconds[link] += nbytes / rate
                self.bytes[link] += nbytes
                done = max(done, self.free_at[link])
        return done if self.shape else now
