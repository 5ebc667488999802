"""Megatron's cp_comm_type="all_gather" (Transformer Engine's KV all-gather).

Forward all-gathers K,V over the whole CP group; backward all-gathers them again and
reduce-scatters dK,dV, in the input dtype:

    forward (P-1) * kv * e       backward (P-1) * kv * e + (P-1) * kv * e

This is the P x 1 mesh's traffic except that the mesh reduce-scatters dK,dV in fp32: for
fp32 inputs the two agree byte for byte. The gathers run before the tiles compute and the
reduce-scatter after, so nothing is hidden. Under a sliding window Transformer Engine still
gathers every K,V chunk (the bytes do not change; only the compute shrinks).
"""
from __future__ import annotations

from megatron_mesh.planner.cost import PricedTransfer
from megatron_mesh.planner.hardware import Cluster
from megatron_mesh.planner.pricing.workload import Workload
from megatron_mesh.planner.topology import crosses_nodes


def all_gather_transfers(workload: Workload, cluster: Cluster) -> list[PricedTransfer]:
    p = cluster.gpus
    piece = workload.kv_chunk_bytes(p)
    cross = crosses_nodes([range(p)], cluster)
    dtype = workload.dtype
    return [
        PricedTransfer("forward", "cp", f"all-gather K,V ({dtype})", (p - 1) * piece, cross, False),
        PricedTransfer("backward", "cp", f"all-gather K,V ({dtype})", (p - 1) * piece, cross, False),
        PricedTransfer(
            "backward", "cp", f"reduce-scatter dK,dV ({dtype})", (p - 1) * piece, cross, False
        ),
    ]
