"""The tokens each sequence of a batch has generated, and which have stopped (at the
end-of-document id, which is kept as the last token)."""
from __future__ import annotations

import torch


class Continuations:
    """ids and log-probabilities per sequence; a sequence stops after its EOD token."""

    def __init__(self, batch: int, eod: int) -> None:
        self.eod = eod
        self.ids: list[list[int]] = [[] for _ in range(batch)]
        self.logprobs: list[list[float]] = [[] for _ in range(batch)]
        self.done = [False] * batch

    def add(self, chosen: torch.Tensor, logprobs: torch.Tensor) -> None:
        """One step: chosen [b] token ids and their log-probabilities [b]; sequences that
        stopped earlier take nothing."""
        for i, (t, lp) in enumerate(zip(chosen.tolist(), logprobs.tolist())):
            if self.done[i]:
                continue
            self.ids[i].append(int(t))
            self.logprobs[i].append(float(lp))
            self.done[i] = int(t) == self.eod

    @property
    def finished(self) -> bool:
        return all(self.done)
