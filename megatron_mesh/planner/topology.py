"""Which CP ranks talk to each other, and whether their groups stay inside a node.

A collective is as fast as its slowest link, and the ranks of a layer wait for the slowest
group, so a group kind (every row, every column, ...) runs at intra-node speed only if each
of its groups lies inside one node.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from megatron_mesh.planner.hardware import Cluster

Groups = Sequence[Sequence[int]]


def consecutive_groups(size: int, group_size: int) -> list[range]:
    """Groups of `group_size` consecutive ranks: mesh rows, the a2a part of a2a+p2p."""
    _check_divides(size, group_size)
    return [range(g * group_size, (g + 1) * group_size) for g in range(size // group_size)]


def strided_groups(size: int, group_size: int) -> list[range]:
    """Groups of `group_size` ranks spaced size // group_size apart: mesh columns."""
    _check_divides(size, group_size)
    stride = size // group_size
    return [range(first, size, stride) for first in range(stride)]


def crosses_nodes(groups: Groups, cluster: Cluster) -> bool:
    """True if any group holds ranks of two different nodes."""
    return any(len({cluster.node_of(r) for r in group}) > 1 for group in groups)


def off_node_share(groups: Groups, cluster: Cluster) -> float:
    """An all-to-all sends equal parts to every other member of its group: the largest share
    of a member's bytes that leaves its node (0 for groups inside one node)."""
    worst = 0.0
    for group in groups:
        n = len(group)
        if n < 2:
            continue
        per_node = Counter(cluster.node_of(r) for r in group)
        worst = max(worst, (n - min(per_node.values())) / (n - 1))
    return worst


def _check_divides(size: int, group_size: int) -> None:
    if group_size < 1 or size % group_size:
        raise ValueError(f"group size {group_size} does not divide {size} ranks")
