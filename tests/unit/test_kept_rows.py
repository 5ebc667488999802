"""`KeptRows`: a block's rows of the whole chunk read from the packed rows a peer sent
(`schedules/sparse.py`), against indexing the whole chunk."""
from __future__ import annotations

import pytest
import torch

from megatron_mesh.schedules.kept_rows import KeptRows


def test_kept_rows_read_what_the_whole_chunk_holds() -> None:
    chunk = torch.arange(40.0).view(20, 2)
    kept = (2, 3, 4, 5, 9, 10, 11, 17)
    packed = chunk[list(kept)]
    rows = KeptRows(kept, 20)
    for index in (slice(2, 6), slice(3, 5), slice(9, 12), slice(17, 18), slice(10, 10),
                  torch.tensor([17, 2, 10]), torch.tensor([], dtype=torch.int64)):
        got = packed[rows(index)]
        assert torch.equal(got, chunk[index]), index


def test_rows_not_kept_are_named() -> None:
    rows = KeptRows((2, 3, 4, 5, 9), 20)
    with pytest.raises(ValueError, match=r"rows 4\.\.9 are not all kept; kept: 2\.\.5, 9\.\.9"):
        rows(slice(4, 10))
    with pytest.raises(ValueError, match="rows 0..1 are not all kept; kept: 2..5"):
        rows(slice(0, 2))
    with pytest.raises(ValueError, match="step 2"):
        rows(slice(2, 6, 2))
