"""Ring attention as Megatron's cp_comm_type="p2p" runs it (Transformer Engine's KV-P2P).

Forward: P-1 steps, each passes one K,V chunk to the next rank.
Backward: K,V go around again (P-1 sends) and dK,dV travel with them, accumulating, until
they are home (P-1 sends). All in the input dtype (TE accumulates dK,dV in it too):

    forward (P-1) * kv * e       backward 2 * (P-1) * kv * e       total 3 (P-1) kv e

Each step is overlapped with one block's compute, so all of it is "hidden" (a ring of P;
dK,dV trail their K,V).
"""
from __future__ import annotations

from megatron_mesh.planner.cost import NotApplicable, PricedTransfer
from megatron_mesh.planner.hardware import Cluster
from megatron_mesh.planner.pricing.workload import Workload
from megatron_mesh.planner.topology import crosses_nodes


def check_takes_window(workload: Workload, method: str) -> None:
    """Transformer Engine's rings (p2p, a2a+p2p) refuse sliding windows and masks given
    as slices."""
    if workload.window is not None:
        raise NotApplicable(
            f"Transformer Engine's {method} refuses sliding windows (window_size); Megatron "
            "runs windowed layers with cp_comm_type all_gather or a2a")
    if workload.slices is not None:
        raise NotApplicable(f"Transformer Engine's {method} takes no mask given as slices")


def ring_transfers(workload: Workload, cluster: Cluster) -> list[PricedTransfer]:
    check_takes_window(workload, "p2p ring")
    p = cluster.gpus
    return ring_kv_transfers(workload, p, cross=crosses_nodes([range(p)], cluster),
                             chunk_bytes=workload.kv_chunk_bytes(p))


def ring_kv_transfers(workload: Workload, ring_size: int, cross: bool,
                      chunk_bytes: int) -> list[PricedTransfer]:
    """A K,V ring of `ring_size` ranks: K,V forward, again in backward with dK,dV trailing,
    (ring_size - 1) chunks of `chunk_bytes` each, all hidden behind the blocks."""
    sent, dtype = (ring_size - 1) * chunk_bytes, workload.dtype
    return [
        PricedTransfer("forward", "ring", f"K,V ({dtype})", sent, cross, True, ring_size),
        PricedTransfer("backward", "ring", f"K,V ({dtype})", sent, cross, True, ring_size),
        PricedTransfer("backward", "ring", f"dK,dV ({dtype})", sent, cross, True, ring_size,
                       trailing=True),
    ]
