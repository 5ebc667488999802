"""Traffic of each context-parallel method, as `PricedTransfer` lists the cost model prices.

Element counts per GPU follow `megatron_mesh.cost_models.traffic`: q = (S/P) * b * Hq * d (one Q or O
chunk), kv = 2 * (S/P) * b * Hkv * d (K and V chunks), e = bytes of the input dtype.
Byte convention (also that of the byte counters): a GPU "sends" (n-1) * m bytes in an
all-gather or reduce-scatter of m-byte pieces over n ranks, M * (n-1) / n bytes in an
all-to-all of an M-byte input, and m bytes per p2p step.
"""
from megatron_mesh.planner.methods.all_gather import all_gather_transfers
from megatron_mesh.planner.methods.hierarchical import a2a_p2p_transfers, a2a_sizes
from megatron_mesh.planner.methods.mesh import mesh_transfers
from megatron_mesh.planner.methods.ring import ring_transfers
from megatron_mesh.planner.methods.ulysses import a2a_transfers

__all__ = [
    "a2a_p2p_transfers",
    "a2a_sizes",
    "a2a_transfers",
    "all_gather_transfers",
    "mesh_transfers",
    "ring_transfers",
]
