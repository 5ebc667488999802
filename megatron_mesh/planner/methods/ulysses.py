"""Ulysses, Megatron's cp_comm_type="a2a" (Transformer Engine's QKVO all-to-all).

All-to-alls switch between sequence-split and head-split layouts over the P ranks:
forward Q, K, V in and O out; backward dO in and dQ, dK, dV out, in the input dtype:

    forward (2q + kv) * e * (P-1)/P       backward (2q + kv) * e * (P-1)/P

Needs both head counts divisible by P. The all-to-alls sit before and after the attention
kernel, so nothing is hidden. Under a sliding window the all-to-alls move the same bytes
(each rank then holds the whole sequence for its heads); only the compute shrinks.
"""
from __future__ import annotations

from megatron_mesh.planner.cost import NotApplicable, PricedTransfer
from megatron_mesh.planner.hardware import Cluster
from megatron_mesh.planner.pricing.workload import Workload
from megatron_mesh.planner.topology import Groups, off_node_share


def check_heads(workload: Workload, size: int) -> None:
    """All-to-all over `size` ranks splits the heads: both head counts must divide."""
    if workload.num_heads % size or workload.num_kv_heads % size:
        raise NotApplicable(
            f"a2a over {size} GPUs needs num_heads ({workload.num_heads}) and num_kv_heads "
            f"({workload.num_kv_heads}) divisible by {size}"
        )


def a2a_bytes(workload: Workload, size: int, cp_size: int) -> tuple[int, int]:
    """(forward, backward) bytes one GPU sends in the all-to-alls over `size` ranks."""
    q, kv, _ = workload.attention_shape().local_elements(cp_size)
    per_pass = (2 * q + kv) * workload.dtype_bytes
    sent = per_pass * (size - 1) // size
    return sent, sent


def all_to_all_pair(fwd: int, bwd: int, dtype: str, groups: Groups,
                    cluster: Cluster) -> list[PricedTransfer]:
    """The forward (Q, K, V in, O out) and backward (dO in, dQ, dK, dV out) all-to-alls of
    `fwd` / `bwd` bytes per GPU over `groups`: exposed, each byte sent straight to its peer."""
    share = off_node_share(groups, cluster)
    return [
        PricedTransfer("forward", "a2a", f"all-to-all Q,K,V in, O out ({dtype})", fwd, share > 0,
                 False, off_node_share=share),
        PricedTransfer("backward", "a2a", f"all-to-all dO in, dQ,dK,dV out ({dtype})", bwd,
                 share > 0, False, off_node_share=share),
    ]


def a2a_pair(workload: Workload, cluster: Cluster, groups: Groups, size: int) -> list[PricedTransfer]:
    """The forward and backward all-to-all transfers over `groups` of `size` ranks."""
    fwd, bwd = a2a_bytes(workload, size, cluster.gpus)
    return all_to_all_pair(fwd, bwd, workload.dtype, groups, cluster)


def a2a_transfers(workload: Workload, cluster: Cluster) -> list[PricedTransfer]:
    check_heads(workload, cluster.gpus)
    return a2a_pair(workload, cluster, [range(cluster.gpus)], cluster.gpus)
