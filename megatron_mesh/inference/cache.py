"""One CP rank's share of one layer's KV cache, and where each token's K / V lives.

Prefill writes the rank's zigzag share of the (right-padded) prompts: slots 0 .. s - 1
hold sub-chunks r and 2P-1-r, s = S_pad / P. Decode step n (one new token per sequence)
goes to rank n % P, slot s + n // P: round robin, so every rank holds s + ceil(N / P)
slots after N steps, 1 / P of what one device holds (up to one slot). Each slot keeps the
global position of its token per sequence; -1 marks a slot no query may see (prompt padding,
or not written yet), so masks (causal, window) are read from positions alone.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..calls.layout import zigzag_split

EMPTY = -1  # the position of a slot no query sees


@dataclass(frozen=True)
class CacheLayout:
    """Which rank and slot hold each token. `prompt_len`: S_pad, the padded prompt length
    (a multiple of 2P); `max_new`: decode steps the cache has room for."""

    cp_size: int
    cp_rank: int
    prompt_len: int
    max_new: int

    def __post_init__(self) -> None:
        if self.prompt_len % (2 * self.cp_size):
            raise ValueError(f"the padded prompt length {self.prompt_len} must be a multiple "
                             f"of 2P = {2 * self.cp_size}")
        if not 0 <= self.cp_rank < self.cp_size:
            raise ValueError(f"cp_rank {self.cp_rank} outside 0 .. {self.cp_size - 1}")

    @property
    def prompt_slots(self) -> int:
        """s = S_pad / P: the slots of this rank's zigzag share of the prompts."""
        return self.prompt_len // self.cp_size

    @property
    def slots(self) -> int:
        """Slots this rank holds: its prompt share and every step it owns, s + ceil(N / P)
        (the same on every rank)."""
        return self.prompt_slots + -(-self.max_new // self.cp_size)

    def prompt_positions(self) -> torch.Tensor:
        """[s] int64: the global positions of this rank's zigzag share."""
        return zigzag_split(torch.arange(self.prompt_len), self.cp_size)[self.cp_rank]

    def owner(self, step: int) -> int:
        """The CP rank that keeps decode step `step`'s K / V (round robin)."""
        return step % self.cp_size

    def slot(self, step: int) -> int:
        """The slot of decode step `step` on its owner."""
        return self.prompt_slots + step // self.cp_size


@dataclass
class KVShard:
    """One layer's cache on one rank: k [slots, b, hkv, d], v [slots, b, hkv, dv] and the
    global position of each slot per sequence, pos [slots, b] int64 (EMPTY: unseen)."""

    k: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor
    used: int = 0  # slots 0 .. used - 1 may hold keys

    @classmethod
    def allocate(cls, layout: CacheLayout, batch: int, kv_heads: int, head_dim: int,
                 v_head_dim: int, dtype: torch.dtype, device: torch.device | str) -> KVShard:
        """An empty shard with room for `layout.slots` slots."""
        n = layout.slots
        return cls(torch.zeros(n, batch, kv_heads, head_dim, dtype=dtype, device=device),
                   torch.zeros(n, batch, kv_heads, v_head_dim, dtype=dtype, device=device),
                   torch.full((n, batch), EMPTY, dtype=torch.long, device=device))

    def write_prefill(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                      lengths: torch.Tensor) -> None:
        """This rank's prompt share: k [s, b, hkv, d], v [s, b, hkv, dv] at global positions
        [s]; a position at or past sequence b's length lengths[b] is padding (EMPTY)."""
        s = k.shape[0]
        self.k[:s].copy_(k)
        self.v[:s].copy_(v)
        pos = positions.to(self.pos.device)[:, None].expand(s, self.pos.shape[1])
        real = pos < lengths.to(self.pos.device)[None, :]
        self.pos[:s] = torch.where(real, pos, torch.full_like(pos, EMPTY))
        self.used = max(self.used, s)

    def append(self, slot: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """One new token per sequence into `slot`: k [b, hkv, d], v [b, hkv, dv] at
        positions [b]."""
        self.k[slot].copy_(k)
        self.v[slot].copy_(v)
        self.pos[slot] = positions.to(self.pos.device)
        self.used = max(self.used, slot + 1)

    def view(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """k [n, b, hkv, d], v [n, b, hkv, dv], pos [n, b] of the slots written so far."""
        return self.k[:self.used], self.v[:self.used], self.pos[:self.used]

    @property
    def nbytes(self) -> int:
        """Bytes this shard holds (K, V and positions)."""
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.pos))

    def tokens(self) -> int:
        """Key tokens (slot x sequence pairs) a query may see here."""
        return int((self.pos[:self.used] != EMPTY).sum())
