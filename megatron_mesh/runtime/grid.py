"""The A x R x C grid over a context-parallel group and the process groups it talks over.

CP rank r has head index a = r % A and mesh rank m = r // A: the A consecutive CP ranks of
one mesh rank share an all-to-all (heads) group, and the P / A ranks with the same head
index form an R x C mesh, in which mesh rank m sits at (m // C, m % C). A row holds C
consecutive mesh ranks, a column every C-th one; rank (i, j) gathers Q over its row and
K/V over its column. With A = 1 (the default) mesh ranks are CP ranks.

The groups come from one `torch.distributed.device_mesh.DeviceMesh` per CP group, with
named dims "column" (the R ranks of a column, which pass K/V), "row" (the C ranks of a row,
which pass Q) and, when A > 1, "heads" (the A ranks of an all-to-all): `layer_plan.AXES`.
"""
from __future__ import annotations

import datetime
import functools
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..layer_plan import AXES, COLUMN, HEADS, ROW, GridShape, dim_groups, shape_text

# The per-call agreement (`agreement.py`) runs on the CPU: it never waits for a GPU stream.
AGREEMENT_BACKEND = "gloo"


@dataclass(frozen=True)
class MeshGrid:
    """This rank's place in one CP group's grid, with the groups it talks over."""

    rows: int
    cols: int
    cp_rank: int
    cp_ranks: tuple[int, ...]  # global ranks of the CP group, in CP-rank order
    row_group: dist.ProcessGroup | None
    col_group: dist.ProcessGroup | None
    heads: int = 1
    heads_group: dist.ProcessGroup | None = None
    device_mesh: DeviceMesh | None = None  # dims of `AXES` with more than one rank
    # the whole CP group on gloo, for the per-call agreement of `agreement.py` (None: it
    # reduces over the row, column and heads groups in turn)
    agreement_group: dist.ProcessGroup | None = None

    @property
    def cp_size(self) -> int:
        return self.heads * self.rows * self.cols

    @property
    def head_index(self) -> int:
        """Which 1/A of the heads this rank computes (its place in the heads group)."""
        return self.cp_rank % self.heads

    @property
    def mesh_rank(self) -> int:
        """This rank's place in the R x C mesh: its zigzag position after the all-to-all."""
        return self.cp_rank // self.heads

    @property
    def row_index(self) -> int:
        return self.mesh_rank // self.cols

    @property
    def col_index(self) -> int:
        return self.mesh_rank % self.cols

    @property
    def mesh_ranks(self) -> list[int]:
        """Global ranks of this rank's mesh, by mesh rank."""
        return list(self.cp_ranks[self.head_index::self.heads])

    @property
    def row_mesh_ranks(self) -> list[int]:
        """Mesh ranks of this rank's row: the query owners of its tile, by column index."""
        return [self.row_index * self.cols + j for j in range(self.cols)]

    @property
    def col_mesh_ranks(self) -> list[int]:
        """Mesh ranks of this rank's column: the key/value owners of its tile, by row index."""
        return [i * self.cols + self.col_index for i in range(self.rows)]

    @functools.cached_property
    def row_order(self) -> tuple[int, ...] | None:
        """Rank in `row_group` of the row member at each column index (None: the same)."""
        return group_order(self.row_group, row_of(self.mesh_ranks, self.cols, self.row_index))

    @functools.cached_property
    def col_order(self) -> tuple[int, ...] | None:
        """Rank in `col_group` of the column member at each row index (None: the same)."""
        return group_order(self.col_group, column_of(self.mesh_ranks, self.cols,
                                                     self.col_index))

    @functools.cached_property
    def heads_order(self) -> tuple[int, ...] | None:
        """Rank in `heads_group` of the member at each head index (None: the same)."""
        first = self.mesh_rank * self.heads
        return group_order(self.heads_group, self.cp_ranks[first:first + self.heads])

    def col_neighbors(self) -> tuple[int, int]:
        """Global ranks (next, previous) of this rank in its column's ring."""
        col, i = column_of(self.mesh_ranks, self.cols, self.col_index), self.row_index
        return col[(i + 1) % self.rows], col[(i - 1) % self.rows]

    def row_neighbors(self) -> tuple[int, int]:
        """Global ranks (next, previous) of this rank in its row's ring."""
        row, j = row_of(self.mesh_ranks, self.cols, self.row_index), self.col_index
        return row[(j + 1) % self.cols], row[(j - 1) % self.cols]

    @property
    def shape_text(self) -> str:
        """'AxRxC' ('RxC' when A = 1), as the flags write it."""
        return shape_text(self.heads, self.rows, self.cols)

    @classmethod
    def build(
        cls,
        rows: int,
        cols: int,
        group: dist.ProcessGroup | None = None,
        timeout: datetime.timedelta | None = None,
        heads: int = 1,
    ) -> "MeshGrid":
        """Collective: the grid over `group` (default: the whole default process group).

        heads x rows x cols must equal the group's size. With group=None every rank of the
        default group calls it. With an explicit group only that group's members call it (its
        groups are created locally). `timeout` bounds every collective of the new groups
        (torch's default when None).
        """
        if group is None:
            grid = cls.build_many([list(range(dist.get_world_size()))], rows, cols,
                                  timeout=timeout, heads=heads)
            assert grid is not None
            return grid
        ranks = dist.get_process_group_ranks(group)
        GridShape(heads, rows, cols).check_cp_size(len(ranks))
        cp_rank = ranks.index(dist.get_rank())
        mine = [next(g for g in dim if dist.get_rank() in g)
                for dim in dim_groups(ranks, rows, cols, heads)[:3 if heads > 1 else 2]]
        new = [dist.new_group(g, timeout=timeout, use_local_synchronization=True) for g in mine]
        agreeing = group if "gloo" in str(dist.get_backend(group)) else dist.new_group(
            ranks, timeout=timeout, backend=AGREEMENT_BACKEND, use_local_synchronization=True)
        return cls(rows, cols, cp_rank, tuple(ranks), new[1], new[0], heads,
                   new[2] if heads > 1 else None, agreement_group=agreeing)

    @classmethod
    def build_many(
        cls,
        cp_groups: Sequence[Sequence[int]],
        rows: int,
        cols: int,
        cp_group: dist.ProcessGroup | None = None,
        timeout: datetime.timedelta | None = None,
        heads: int = 1,
    ) -> "MeshGrid | None":
        """Collective over ALL ranks: the grids of many CP groups (global ranks, CP order).

        Every rank builds every CP group's DeviceMesh (and its gloo group for the per-call
        agreement, `agreement.py`) in the same order, as torch.distributed requires; the
        ranks of a group may come in any order. It returns the grid of the CP group holding
        this rank, or None when no group holds it. `cp_group`, when every rank passes its
        existing CP process group (Megatron's), is checked against the CP group holding this
        rank. `timeout` bounds every collective of the new groups (torch's default when None).
        """
        world = dist.get_world_size()
        seen: set[int] = set()
        for ranks in cp_groups:
            GridShape(heads, rows, cols).check_cp_size(len(ranks))
            for rank in ranks:
                if not 0 <= rank < world or rank in seen:
                    raise ValueError(
                        f"CP groups {list(map(list, cp_groups))} must hold distinct ranks in "
                        f"[0, {world}); rank {rank} is repeated or out of range"
                    )
                seen.add(rank)
        me = dist.get_rank()
        if cp_group is not None:
            held = [list(r) for r in cp_groups if me in r]
            given = dist.get_process_group_ranks(cp_group)
            if held != [given]:
                raise ValueError(
                    f"cp_group has ranks {given} but the CP group holding rank {me} in "
                    f"cp_groups is {held[0] if held else None}"
                )
        mine: MeshGrid | None = None
        for ranks in cp_groups:
            mesh, groups = grid_device_mesh(ranks, rows, cols, heads, timeout)
            agreeing = None if len(ranks) == 1 else dist.new_group(
                list(ranks), timeout=timeout, backend=AGREEMENT_BACKEND)
            if me in ranks:
                mine = cls(rows, cols, list(ranks).index(me), tuple(ranks), groups[ROW],
                           groups[COLUMN], heads, groups.get(HEADS), mesh, agreeing)
        return mine


def grid_device_mesh(
    ranks: Sequence[int], rows: int, cols: int, heads: int,
    timeout: datetime.timedelta | None = None,
) -> tuple[DeviceMesh | None, dict[str, dist.ProcessGroup]]:
    """Collective over ALL ranks: the DeviceMesh of one CP group (global ranks, CP order)
    over its dims of more than one rank, of "column" (R), "row" (C) and "heads" (A), and
    this rank's group of each dim ("heads" only when A > 1). A dim of one rank gets a group of
    this rank alone, created locally; no rank outside the CP group creates one."""
    sizes = dict(zip(AXES, (rows, cols, heads)))
    names = tuple(n for n, size in sizes.items() if size > 1)
    mesh = None
    if names:
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        override = None
        if timeout is not None:
            options = (dist.ProcessGroupNCCL.Options() if device == "cuda"
                       else dist.ProcessGroupGloo._Options())
            options._timeout = timeout
            override = ((None, options),) * len(names)
        layout = torch.tensor(list(ranks)).view(rows, cols, heads).squeeze()
        mesh = DeviceMesh(device, layout.view([sizes[n] for n in names]), mesh_dim_names=names,
                          backend_override=override)
    me = dist.get_rank()
    if me not in ranks:
        return mesh, {}
    groups = {n: mesh.get_group(n) for n in names}
    for n in (COLUMN, ROW) + ((HEADS,) if heads > 1 else ()):
        if n not in groups:
            groups[n] = dist.new_group([me], timeout=timeout, use_local_synchronization=True)
    return mesh, groups


def group_order(group: dist.ProcessGroup | None, members: Sequence[int]
                ) -> tuple[int, ...] | None:
    """The rank in `group` of each of `members` (global ranks in grid order), or None when
    that is 0, 1, 2, ... (or the group has one rank). torch numbers a group's ranks in
    ascending global order, while a CP group given as, e.g., [1, 0, 2, 3] puts rank 1 first:
    the collectives use this order to read and write their pieces in grid order
    (`comm.all_gather`'s `order`)."""
    if group is None or len(members) <= 1:
        return None
    order = tuple(dist.get_group_rank(group, rank) for rank in members)
    return None if order == tuple(range(len(order))) else order


def row_of(ranks: Sequence[int], cols: int, i: int) -> list[int]:
    """Row i of a mesh of `ranks` (mesh order) with `cols` columns: C consecutive ranks."""
    return list(ranks[i * cols:(i + 1) * cols])


def column_of(ranks: Sequence[int], cols: int, j: int) -> list[int]:
    """Column j of a mesh of `ranks` (mesh order) with `cols` columns: every C-th rank."""
    return list(ranks[j::cols])

