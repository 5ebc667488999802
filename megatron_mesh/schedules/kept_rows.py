"""A chunk held in part: only the rows some block uses, packed in order (the sparse
exchange's received rows, `schedules/sparse.py`). The blocks' calls name rows of the whole
chunk; `KeptRows` turns them into rows of the packed tensors."""
from __future__ import annotations

from bisect import bisect_left

import torch


class KeptRows:
    """Rows `kept` (sorted, of a chunk of `local_len` rows) held packed: the packed
    tensors' row i is the chunk's row kept[i]."""

    def __init__(self, kept: tuple[int, ...], local_len: int) -> None:
        self.kept = kept
        self.local_len = local_len
        self._lut: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.kept)

    def __call__(self, index: slice | torch.Tensor) -> slice | torch.Tensor:
        """The packed rows of a block's chunk rows `index` (a slice or an int64 index
        tensor), each of which must be kept."""
        if isinstance(index, slice):
            span = range(self.local_len)[index]
            if span.step != 1:
                raise ValueError(f"rows {index} have step {span.step}; a block's rows have "
                                 "step 1")
            start = bisect_left(self.kept, span.start)
            if len(span) and (start + len(span) > len(self.kept)
                              or self.kept[start] != span.start
                              or self.kept[start + len(span) - 1] != span[-1]):
                raise ValueError(f"rows {span.start}..{span.stop - 1} are not all kept; "
                                 f"kept: {self._runs()}")
            return slice(start, start + len(span))
        return self._table(index.device).index_select(0, index)

    def _runs(self, most: int = 4) -> str:
        """The kept rows as runs 'a..b', the first `most` of them."""
        runs: list[list[int]] = []
        for row in self.kept:
            if runs and runs[-1][1] == row - 1:
                runs[-1][1] = row
            else:
                runs.append([row, row])
        text = ", ".join(f"{a}..{b}" for a, b in runs[:most])
        return (text or "none") + (f" and {len(runs) - most} more runs" if len(runs) > most
                                   else "")

    def _table(self, device: torch.device) -> torch.Tensor:
        """[local_len] int64: each kept row's packed place (-1 elsewhere)."""
        if self._lut is None or self._lut.device != device:
            lut = torch.full((self.local_len,), -1, dtype=torch.int64, device=device)
            kept = torch.tensor(self.kept, dtype=torch.int64, device=device)
            lut[kept] = torch.arange(len(self.kept), dtype=torch.int64, device=device)
            self._lut = lut
        return self._lut
