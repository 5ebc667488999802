"""a2a+p2p: Ulysses all-to-all inside groups of A consecutive ranks, a ring across them.

Megatron's cp_comm_type="a2a+p2p" with hierarchical_context_parallel_sizes [A, P/A]. After
the all-to-all each rank holds A times the tokens for 1/A of the heads, so the ring passes
chunks of the same kv elements as plain ring attention, over P/A ranks (stride A):

    all-to-all (A ranks)  forward (2q + kv) e (A-1)/A    backward the same      exposed
    ring (P/A ranks)      forward (P/A-1) kv e           backward 2 (P/A-1) kv e hidden
"""
from __future__ import annotations

from megatron_mesh.planner.cost import NotApplicable, PricedTransfer
from megatron_mesh.planner.hardware import Cluster
from megatron_mesh.planner.methods.ring import check_takes_window, ring_kv_transfers
from megatron_mesh.planner.methods.ulysses import a2a_pair, check_heads
from megatron_mesh.planner.pricing.workload import Workload
from megatron_mesh.planner.topology import consecutive_groups, crosses_nodes, strided_groups


def a2a_sizes(workload: Workload, cp_size: int) -> list[int]:
    """Every all-to-all size A with 1 < A < P that divides P and both head counts."""
    return [
        a
        for a in range(2, cp_size)
        if cp_size % a == 0 and workload.num_heads % a == 0 and workload.num_kv_heads % a == 0
    ]


def a2a_p2p_transfers(workload: Workload, cluster: Cluster, a2a_size: int) -> list[PricedTransfer]:
    check_takes_window(workload, "a2a+p2p")
    p = cluster.gpus
    if not 1 < a2a_size < p or p % a2a_size:
        raise NotApplicable(
            f"a2a+p2p needs an all-to-all size A with 1 < A < {p} dividing {p}, got {a2a_size}"
        )
    check_heads(workload, a2a_size)
    ring_size = p // a2a_size
    transfers = a2a_pair(workload, cluster, consecutive_groups(p, a2a_size), a2a_size)
    cross = crosses_nodes(strided_groups(p, ring_size), cluster)
    return transfers + ring_kv_transfers(workload, ring_size, cross, workload.kv_chunk_bytes(p))
