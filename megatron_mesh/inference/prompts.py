"""This rank's share of a batch of prompts for the prefill: dense (each prompt right-padded
to the longest, rounded up to a multiple of 2P, cut by the zigzag) or packed (the prompts
one after another in one sequence, a padding document to a multiple of 2P, placed by
document with `place_documents`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..calls.layout import zigzag_split
from ..masks.document_placement import DocumentPlacement
from ..masks.document_placer import place_documents
from .packed import placed_positions


def _round_up(n: int, cp: int) -> int:
    return -(-n // (2 * cp)) * 2 * cp


@dataclass(frozen=True)
class Padded:
    """ids / positions [b, s]: this rank's zigzag share of the padded prompts."""

    ids: torch.Tensor
    positions: torch.Tensor
    total: int  # S_pad
    placement: None = None

    @classmethod
    def of(cls, prompts: list[list[int]], cp: int, rank: int, pad: int,
           device: torch.device) -> Padded:
        total = _round_up(max(len(p) for p in prompts), cp)
        tokens = torch.full((len(prompts), total), pad, dtype=torch.long)
        for i, p in enumerate(prompts):
            tokens[i, :len(p)] = torch.tensor(p)
        pos = zigzag_split(torch.arange(total), cp)[rank]
        return cls(tokens[:, pos].to(device), pos[None].expand(len(prompts), -1).to(device),
                   total)

    def last_rows(self, lengths: torch.Tensor) -> list[tuple[int, int] | None]:
        """(row, batch column) of each prompt's last token here, None where another rank
        holds it."""
        pos = self.positions[0].tolist()
        return [(pos.index(n - 1), i) if n - 1 in pos else None
                for i, n in enumerate(lengths.tolist())]


@dataclass(frozen=True)
class Packed:
    """ids / positions [1, t]: this rank's placed rows of the packed prompts (positions
    within each document)."""

    ids: torch.Tensor
    positions: torch.Tensor
    total: int  # T: the packed length with its padding document
    placement: DocumentPlacement
    documents: torch.Tensor  # [t] the document of each row

    @classmethod
    def of(cls, prompts: list[list[int]], cp: int, rank: int, pad: int,
           device: torch.device) -> Packed:
        lengths = [len(p) for p in prompts]
        total = _round_up(sum(lengths), cp)
        if total > sum(lengths):
            lengths.append(total - sum(lengths))  # a padding document, never continued
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        placement = place_documents(cu, cp)
        tokens = torch.tensor([t for p in prompts for t in p] + [pad] * (total - cu[len(prompts)]))
        rows = placement.token_indices(rank)
        docs, pos = placed_positions(placement, rank)
        return cls(tokens[rows][None].to(device), pos[None].to(device), total, placement, docs)

    def last_rows(self, lengths: torch.Tensor) -> list[tuple[int, int] | None]:
        """(row, 0) of each prompt's last token here, None where another rank holds it."""
        out: list[tuple[int, int] | None] = []
        docs, pos = self.documents.tolist(), self.positions[0].tolist()
        for i, n in enumerate(lengths.tolist()):
            hit = [r for r, (d, p) in enumerate(zip(docs, pos)) if d == i and p == n - 1]
            out.append((hit[0], 0) if hit else None)
        return out
