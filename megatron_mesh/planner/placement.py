"""Where a mesh's rows and columns land on nodes (CP rank r sits at (r // C, r % C))."""
from __future__ import annotations

from dataclasses import dataclass

from megatron_mesh.planner.hardware import Cluster
from megatron_mesh.planner.topology import consecutive_groups, strided_groups


@dataclass(frozen=True)
class Placement:
    """How many nodes each row / column group spans (1 = it stays inside a node)."""

    rows: int
    cols: int
    gpus_per_node: int
    nodes: int
    row_nodes: int
    col_nodes: int

    @property
    def rows_inside_node(self) -> bool:
        return self.row_nodes == 1

    @property
    def cols_inside_node(self) -> bool:
        return self.col_nodes == 1

    def describe(self) -> str:
        """Two lines for people: what travels where."""
        row = _where(self.row_nodes)
        col = _where(self.col_nodes)
        return (
            f"rows: {self.cols} consecutive CP ranks each (Q, dO, lse, D gathers, partial O "
            f"exchange, dQ reduce-scatter) {row}\n"
            f"columns: {self.rows} CP ranks {self.cols} apart (K,V gathers, dK,dV "
            f"reduce-scatter) {col}"
        )


def mesh_placement(rows: int, cols: int, cluster: Cluster) -> Placement:
    """The placement of a rows x cols grid over `cluster` (most nodes any group spans)."""
    p = cluster.gpus
    if rows * cols != p:
        raise ValueError(f"mesh shape {rows}x{cols} does not multiply to {p} GPUs")

    def span(groups: list[range]) -> int:
        return max(len({cluster.node_of(r) for r in g}) for g in groups)

    return Placement(
        rows=rows,
        cols=cols,
        gpus_per_node=cluster.gpus_per_node,
        nodes=cluster.nodes,
        row_nodes=span(consecutive_groups(p, cols)),
        col_nodes=span(strided_groups(p, rows)),
    )


def _where(nodes: int) -> str:
    if nodes == 1:
        return "stay inside a node (intra-node links)"
    return f"span {nodes} nodes (inter-node links)"
