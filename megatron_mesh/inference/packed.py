"""The KV cache of packed prompts: documents placed over the CP group by `place_documents`.

Each document of the packed prompt is one sequence that generation continues. Prefill runs
`mesh_attention` with the placement (causal within each document; documents held whole by
one rank cost no bytes), and each rank keeps exactly the rows the placement gave it: T / P
slots, each with its document and its position in it. Decode step n (one new token per
document) goes to rank n % P (`CacheLayout.owner`), slots T / P + (n // P) b .. + b - 1, as
in the dense cache, so every rank holds T / P + ceil(N / P) b slots: 1 / P of one GPU's
cache up to one step.

A model's mask (`attention_mask`: a `Mask` or `SliceMask` over one document's positions,
prompt and generated; None: causal) holds in every document: prefill runs `packed_mask`
(the documents' mask & the model's, each document's slices at its offset), decode reads a
new token's row of it over its document's slots (`PackedShard.visible`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention import mesh_attention
from ..masks.document_placement import DocumentPlacement
from ..masks.mask import Mask, as_attention_mask, documents_mask, each_document
from ..masks.seen import keeps, one_row
from ..masks.slices import SliceMask
from ..runtime.grid import MeshGrid
from .cache import EMPTY


@dataclass
class PackedShard:
    """k [slots, hkv, d], v [slots, hkv, dv], seq [slots] (the document of each slot) and pos
    [slots] (its position in the document; EMPTY: unwritten)."""

    k: torch.Tensor
    v: torch.Tensor
    seq: torch.Tensor
    pos: torch.Tensor
    documents: int
    prompt_slots: int
    cp_size: int
    used: int = 0

    @classmethod
    def allocate(cls, placement: DocumentPlacement, max_new: int, kv_heads: int, head_dim: int,
                 v_head_dim: int, dtype: torch.dtype, device: torch.device | str,
                 sequences: int | None = None) -> PackedShard:
        """Room for the placement's rows and `max_new` decode steps of `sequences` documents
        (the first ones; None: all; a last padding document is never continued)."""
        b, p = sequences or len(placement.lengths), placement.cp_size
        prompt = placement.local_tokens
        n = prompt + -(-max_new // p) * b
        return cls(torch.zeros(n, kv_heads, head_dim, dtype=dtype, device=device),
                   torch.zeros(n, kv_heads, v_head_dim, dtype=dtype, device=device),
                   torch.full((n,), EMPTY, dtype=torch.long, device=device),
                   torch.full((n,), EMPTY, dtype=torch.long, device=device), b, prompt, p)

    def write_prefill(self, k: torch.Tensor, v: torch.Tensor, placement: DocumentPlacement,
                      rank: int,
                      positions: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """This rank's placed rows k [t, hkv, d], v [t, hkv, dv] (t = T / P); `positions`:
        `placed_positions(placement, rank)` when the caller keeps them (on the shard's
        device: one build for every layer)."""
        seq, pos = positions if positions is not None else placed_positions(placement, rank)
        t = k.shape[0]
        self.k[:t].copy_(k)
        self.v[:t].copy_(v)
        self.seq[:t] = seq.to(self.seq.device)
        self.pos[:t] = pos.to(self.pos.device)
        self.used = max(self.used, t)

    def append(self, step: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Decode step `step`'s token of every document (on its owner): k [b, hkv, d], v
        [b, hkv, dv] at positions [b]."""
        first = self.prompt_slots + (step // self.cp_size) * self.documents
        rows = slice(first, first + self.documents)
        self.k[rows].copy_(k)
        self.v[rows].copy_(v)
        self.seq[rows] = torch.arange(self.documents, device=self.seq.device)
        self.pos[rows] = positions.to(self.pos.device)
        self.used = max(self.used, rows.stop)

    def visible(self, q_pos: torch.Tensor, window_left: int | None = None,
                attention_mask: Mask | SliceMask | None = None) -> torch.Tensor:
        """[b, n] bool (n = `used`): the slots document i's query at q_pos [b][i] sees: its
        own document's, by its row of `attention_mask` over the document's positions
        (`Mask.row`; None: the causal row, `seen.one_row`), within `window_left` keys when
        given; EMPTY never. The same for every layer of a step: every layer's shard has the
        same documents and positions."""
        n, b = self.used, self.documents
        own = self.seq[:n][None, :] == torch.arange(b, device=self.seq.device)[:, None]
        k_pos = torch.where(own, self.pos[:n][None, :], EMPTY)  # [b, n]: other documents unseen
        seen = keeps(one_row(q_pos, window_left), q_pos[:, None], k_pos)
        if attention_mask is not None:
            seen &= as_attention_mask(attention_mask).row(q_pos, k_pos)
        return seen

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.seq, self.pos))

    def tokens(self) -> int:
        """Key tokens a query may see here."""
        return int((self.pos[:self.used] != EMPTY).sum())


def placed_positions(placement: DocumentPlacement, rank: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(document [t], position in it [t]) of `rank`'s rows, in local order."""
    seq, pos = [], []
    for doc, first, n in placement.runs[rank]:
        seq.append(torch.full((n,), doc, dtype=torch.long))
        pos.append(torch.arange(first, first + n, dtype=torch.long))
    return torch.cat(seq), torch.cat(pos)


def packed_mask(attention_mask: Mask | SliceMask | None, placement: DocumentPlacement
                ) -> Mask:
    """The packed prompts' mask: each document under the model's `attention_mask` over its
    own positions (`mask.each_document`; None: causal), on the placement."""
    if attention_mask is None:
        return documents_mask(placement)
    return each_document(attention_mask, placement)


def prefill_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: MeshGrid,
                   shard: PackedShard, placement: DocumentPlacement,
                   softmax_scale: float | None = None,
                   window_size: tuple[int, int] | None = None,
                   softmax_offset: torch.Tensor | None = None,
                   positions: tuple[torch.Tensor, torch.Tensor] | None = None,
                   attention_mask: Mask | SliceMask | None = None,
                   **options: object) -> torch.Tensor:
    """q [t, hq, d], k [t, hkv, d], v [t, hkv, dv]: this rank's rows of the packed prompts
    (`placement.token_indices(cp_rank)`) -> out [t, hq, dv] (`mesh_attention` with the
    placement, no autograd state); K / V into `shard`. `positions`: this rank's
    `placed_positions`, when the caller built them once for every layer;
    `attention_mask`: the model's mask over one document's positions (`packed_mask`)."""
    with torch.no_grad():
        if attention_mask is None:
            out = mesh_attention(q, k, v, grid, causal=True, softmax_scale=softmax_scale,
                                 window_size=window_size, placement=placement,
                                 softmax_offset=softmax_offset, **options)
        else:
            out = mesh_attention(q, k, v, grid, mask=packed_mask(attention_mask, placement),
                                 softmax_scale=softmax_scale, window_size=window_size,
                                 softmax_offset=softmax_offset, **options)
    shard.write_prefill(k, v, placement, grid.cp_rank, positions)
    return out
