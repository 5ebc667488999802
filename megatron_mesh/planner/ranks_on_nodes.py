"""Where a grid's heads groups, rows and columns land on nodes (CP rank r = m A + a: heads
group of the A consecutive ranks of mesh rank m, which sits at (m // C, m % C))."""
from __future__ import annotations

from dataclasses import dataclass

from megatron_mesh.layer_plan import GridShape, dim_groups
from megatron_mesh.planner.hardware import Cluster


@dataclass(frozen=True)
class Placement:
    """How many nodes each row / column group spans (1 = it stays inside a node)."""

    rows: int
    cols: int
    gpus_per_node: int
    nodes: int
    row_nodes: int
    col_nodes: int
    heads: int = 1
    heads_nodes: int = 1
    sparse: bool = False  # a sliding window's sparse exchange: point to point, only used rows

    @property
    def rows_inside_node(self) -> bool:
        return self.row_nodes == 1

    @property
    def cols_inside_node(self) -> bool:
        return self.col_nodes == 1

    def describe(self) -> str:
        """Two lines (three with heads) for people: what travels where."""
        row = _where(self.row_nodes)
        col = _where(self.col_nodes)
        a2a = (f"heads: all-to-all over {self.heads} consecutive CP ranks "
               f"{_where(self.heads_nodes)}\n" if self.heads > 1 else "")
        ranks = f"CP ranks {self.heads} apart" if self.heads > 1 else "consecutive CP ranks"
        q_side, kv_side = (("the window's Q, dO, lse, D rows in, partial O and dQ rows back",
                            "the window's K,V rows in, dK,dV rows back") if self.sparse else
                           ("Q, dO, lse, D gathers, partial O exchange, dQ partials",
                            "K,V gathers, dK,dV partials"))
        rows = (f"rows: {self.cols} {ranks} each ({q_side}) {row}\n" if self.cols > 1
                else "rows: one rank each (no row traffic)\n")
        cols = (f"columns: {self.rows} CP ranks {self.cols * self.heads} apart ({kv_side}) "
                f"{col}" if self.rows > 1 else "columns: one rank each (no column traffic)")
        return a2a + rows + cols


def mesh_placement(rows: int, cols: int, cluster: Cluster, heads: int = 1,
                   sparse: bool = False) -> Placement:
    """The placement of a heads x rows x cols grid over `cluster` (most nodes any group
    spans); `sparse`: under a sliding window."""
    p = cluster.gpus
    GridShape(heads, rows, cols).check_cp_size(p)
    col_groups, row_groups, heads_groups = dim_groups(range(p), rows, cols, heads)

    def span(groups: list[list[int]]) -> int:
        return max(len({cluster.node_of(r) for r in g}) for g in groups)

    return Placement(
        rows=rows,
        cols=cols,
        gpus_per_node=cluster.gpus_per_node,
        nodes=cluster.nodes,
        row_nodes=span(row_groups),
        col_nodes=span(col_groups),
        heads=heads,
        heads_nodes=span(heads_groups),
        sparse=sparse,
    )


def _where(nodes: int) -> str:
    if nodes == 1:
        return "stay inside a node (intra-node links)"
    return f"span {nodes} nodes (inter-node links)"
