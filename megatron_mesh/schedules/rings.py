"""The two ring mechanisms of the streamed schedules, over one ring of a grid (row or column).

`ring_steps`: chunks travel around the ring; at step t a rank holds the chunks of ring
position i - t while the next ones are already on their way.
`TrailingPartial`: a partial result (an output or a gradient) follows its chunk one hop
behind, gaining each member's contribution, and lands at the chunk's owner after n-1 hops
(the bytes of a reduce-scatter or an all-to-all over the ring).
"""
from __future__ import annotations

from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from ..runtime import comm

Tensors = tuple[torch.Tensor, ...]


def ring_steps(
    chunks: Sequence[torch.Tensor], steps: int, next_rank: int, prev_rank: int,
    group: dist.ProcessGroup | None, phase: comm.Phase, direction: comm.Direction,
) -> Iterator[tuple[int, Tensors]]:
    """Yield (t, chunks held at step t) for t < steps; step t + 1's arrive meanwhile.

    Two receive buffers take turns (the input chunks are never written), so the chunks
    yielded at step t are valid until the next step only; at the last step, which receives
    nothing, only the chunks in hand are held.
    """
    chunks, spare = tuple(chunks), None
    for t in range(steps):
        if t < steps - 1:
            arriving = spare or tuple(torch.empty_like(c, memory_format=torch.contiguous_format)
                                      for c in chunks)
            pending = comm.ring_exchange(chunks, arriving, next_rank, prev_rank, group, phase,
                                         direction)
        yield t, chunks
        if t < steps - 1:
            pending.wait()  # also ends the send of this step's chunks: their buffer is free
            spare = chunks if 0 < t < steps - 2 else None  # receives again at t + 1
            chunks = arriving


def add_partial(mine: Tensors, arriving: Tensors) -> None:
    """Fold for gradients: sum in place (fp32)."""
    mine[0].add_(arriving[0])


class TrailingPartial:
    """Partials that follow their chunks one hop behind around a ring.

    At every step t >= 1 call `pass_on` with this step's partial (of the chunk held at t):
    the partial of the same chunk, sent by the previous member at t - 1, is folded in and
    the sum goes on. After the last step `land` folds in this rank's own chunk's partial.
    """

    def __init__(self, next_rank: int, prev_rank: int, group: dist.ProcessGroup | None,
                 phase: comm.Phase, direction: comm.Direction,
                 fold: Callable[[Tensors, Tensors], None] = add_partial) -> None:
        self.ring = (next_rank, prev_rank, group, phase, direction)
        self.fold = fold
        self.arriving: Tensors | None = None
        self.pending = comm.Pending([])

    def pass_on(self, partial: Tensors, dtype: torch.dtype | None = None) -> None:
        """Fold the arriving partial into `partial` (in place) and send it on, its first
        tensor in `dtype` when given."""
        self.pending.wait()
        if self.arriving is not None:
            self.fold(partial, self.arriving)
            self.arriving = None  # folded: gone before the next one is allocated
        sending = partial if dtype is None else (partial[0].to(dtype), *partial[1:])
        self.arriving = tuple(torch.empty_like(t) for t in sending)
        self.pending = comm.ring_exchange(sending, self.arriving, *self.ring, partial=True)

    def land(self, own: Tensors) -> None:
        """Fold this rank's own chunk's partial, back from its hops, into `own`."""
        self.pending.wait()
        if self.arriving is not None:
            self.fold(own, self.arriving)


def held_at(ranks: Sequence[int], index: int, t: int) -> int:
    """The member whose chunks the member at `index` of a ring of `ranks` holds at step t
    of `ring_steps`."""
    return ranks[(index - t) % len(ranks)]
