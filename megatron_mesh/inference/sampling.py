"""The next token of each sequence from its logits: greedy, or sampled with a temperature,
top-k and top-p (nucleus) from a seeded generator, so every rank and every CP size that
sees the same logits draws the same tokens."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """temperature 0: greedy (argmax); else softmax(logits / temperature) restricted to the
    top_k most likely (0: all) and to the smallest set whose mass reaches top_p (1.0: all)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got "
                             f"{self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: all tokens), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:  # nan fails too
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def next_tokens(logits: torch.Tensor, sampling: Sampling,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [b, V] -> token ids [b] int64: greedy on the logits' device (only the b ids
    need to leave it), sampled on the CPU (the generator lives there)."""
    if sampling.greedy:
        return logits.detach().argmax(dim=-1)
    logits = logits.detach().float().cpu()
    scores = logits / sampling.temperature
    if sampling.top_k > 0:
        kth = torch.topk(scores, min(sampling.top_k, scores.shape[-1]), dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1.0:
        ordered, order = torch.sort(scores, dim=-1, descending=True)
        mass = torch.softmax(ordered, dim=-1).cumsum(dim=-1)
        drop = mass - torch.softmax(ordered, dim=-1) >= sampling.top_p  # mass before it
        ordered = ordered.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(-1, order, ordered)
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]
