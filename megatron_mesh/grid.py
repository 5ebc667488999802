"""The R x C grid over a context-parallel group and its row / column process groups.

CP rank r sits at (r // C, r % C): a row holds C consecutive CP ranks, a column holds
every C-th one. Rank (i, j) gathers Q over its row and K/V over its column.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Sequence

import torch.distributed as dist

from .traffic import mesh_shapes


@dataclass(frozen=True)
class MeshGrid:
    """This rank's place in one CP group's mesh, with the groups it talks over."""

    rows: int
    cols: int
    cp_rank: int
    cp_ranks: tuple[int, ...]  # global ranks of the CP group, in CP-rank order
    cp_group: dist.ProcessGroup | None
    row_group: dist.ProcessGroup | None
    col_group: dist.ProcessGroup | None

    @property
    def cp_size(self) -> int:
        return self.rows * self.cols

    @property
    def row_index(self) -> int:
        return self.cp_rank // self.cols

    @property
    def col_index(self) -> int:
        return self.cp_rank % self.cols

    @property
    def row_cp_ranks(self) -> list[int]:
        """CP ranks of this rank's row: the query owners of its tile, by column index."""
        return [self.row_index * self.cols + j for j in range(self.cols)]

    @property
    def col_cp_ranks(self) -> list[int]:
        """CP ranks of this rank's column: the key/value owners of its tile, by row index."""
        return [i * self.cols + self.col_index for i in range(self.rows)]

    def col_neighbors(self) -> tuple[int, int]:
        """Global ranks (next, previous) of this rank in its column's ring."""
        col, i = column_of(self.cp_ranks, self.cols, self.col_index), self.row_index
        return col[(i + 1) % self.rows], col[(i - 1) % self.rows]

    def row_neighbors(self) -> tuple[int, int]:
        """Global ranks (next, previous) of this rank in its row's ring."""
        row, j = row_of(self.cp_ranks, self.cols, self.row_index), self.col_index
        return row[(j + 1) % self.cols], row[(j - 1) % self.cols]

    @classmethod
    def build(
        cls,
        rows: int,
        cols: int,
        group: dist.ProcessGroup | None = None,
        timeout: datetime.timedelta | None = None,
    ) -> "MeshGrid":
        """Collective: the grid over `group` (default: the whole default process group).

        With group=None every rank of the default group calls it. With an explicit group only
        that group's members call it (its row and column groups are created locally).
        `timeout` bounds every collective of the new groups (torch's default when None).
        """
        if group is None:
            grid = cls.build_many([list(range(dist.get_world_size()))], rows, cols, timeout=timeout)
            assert grid is not None
            return grid
        ranks = dist.get_process_group_ranks(group)
        check_shape(rows, cols, len(ranks))
        cp_rank = ranks.index(dist.get_rank())
        i, j = divmod(cp_rank, cols)
        return cls(
            rows, cols, cp_rank, tuple(ranks), group,
            dist.new_group(row_of(ranks, cols, i), timeout=timeout, use_local_synchronization=True),
            dist.new_group(column_of(ranks, cols, j), timeout=timeout,
                           use_local_synchronization=True),
        )

    @classmethod
    def build_many(
        cls,
        cp_groups: Sequence[Sequence[int]],
        rows: int,
        cols: int,
        cp_group: dist.ProcessGroup | None = None,
        timeout: datetime.timedelta | None = None,
    ) -> "MeshGrid | None":
        """Collective over ALL ranks: the grids of many CP groups (global ranks, CP order).

        Every rank creates every row and column group in the same order, as
        torch.distributed requires; it returns the grid of the CP group holding this rank,
        or None when no group holds it. `cp_group`, when every rank passes its existing CP
        process group (Megatron's), is reused instead of creating the CP groups again.
        `timeout` bounds every collective of the new groups (torch's default when None).
        """
        world = dist.get_world_size()
        seen: set[int] = set()
        for ranks in cp_groups:
            check_shape(rows, cols, len(ranks))
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
            ranks = list(ranks)
            group = cp_group if cp_group is not None else dist.new_group(ranks, timeout=timeout)
            row_groups = [dist.new_group(row_of(ranks, cols, i), timeout=timeout)
                          for i in range(rows)]
            col_groups = [dist.new_group(column_of(ranks, cols, j), timeout=timeout)
                          for j in range(cols)]
            if me in ranks:
                cp_rank = ranks.index(me)
                i, j = divmod(cp_rank, cols)
                mine = cls(rows, cols, cp_rank, tuple(ranks), group, row_groups[i], col_groups[j])
        return mine


def row_of(ranks: Sequence[int], cols: int, i: int) -> list[int]:
    """Row i of a grid of `ranks` (CP order) with `cols` columns: C consecutive ranks."""
    return list(ranks[i * cols:(i + 1) * cols])


def column_of(ranks: Sequence[int], cols: int, j: int) -> list[int]:
    """Column j of a grid of `ranks` (CP order) with `cols` columns: every C-th rank."""
    return list(ranks[j::cols])


def check_shape(rows: int, cols: int, cp_size: int) -> None:
    """Raise ValueError unless rows x cols is a grid of exactly cp_size ranks."""
    for name, value in (("rows", rows), ("cols", cols)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"mesh {name}={value!r} must be a positive integer")
    if rows * cols != cp_size:
        valid = ", ".join(f"{r}x{c}" for r, c in reversed(mesh_shapes(cp_size)))
        raise ValueError(
            f"mesh shape {rows}x{cols} has {rows * cols} ranks but the CP group has {cp_size}; "
            f"valid shapes: {valid}"
        )
