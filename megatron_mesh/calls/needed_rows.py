"""Which rows of a peer's chunk a mesh rank's blocks use: what the sparse exchange moves
(`schedules/sparse.py`) and what its models count (`cost_models/sparse.py`)."""
from __future__ import annotations

import torch

from ..common.caches import per_documents
from .layout import AttentionMask, block_for


# per shape without documents; with them, for the last few micro-batches only (`caches.py`)
@per_documents(lambda mask, *_: mask.packing)
def needed_rows(mask: AttentionMask, rows: int, cols: int, local_len: int, mesh_rank: int,
                owner: int, side: str) -> tuple[int, ...]:
    """The local rows of `owner`'s chunk that rank `mesh_rank` of a rows x cols mesh uses:
    side 'q' (owner in its row: query rows of its blocks (owner, y) over its column) or
    'kv' (owner in its column: key rows of its blocks (x, owner) over its row)."""
    i, j = divmod(mesh_rank, cols)
    used = torch.zeros(local_len, dtype=torch.bool)
    for other in ([r * cols + j for r in range(rows)] if side == "q"
                  else [i * cols + c for c in range(cols)]):
        x, y = (owner, other) if side == "q" else (other, owner)
        blk = block_for(x, y, local_len, mask)
        if not blk.empty:
            used[blk.q_rows if side == "q" else blk.kv_rows] = True
    return tuple(used.nonzero().flatten().tolist())
