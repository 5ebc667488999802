"""One generation's state on one CP rank: the cache layout, every layer's shard, where the
batch stands (prefill, or decode step n) and each sequence's prompt length.

A core-attention module holding a session calls `attend` with its layer number; the session
runs the prefill through the mesh (writing the shard) or a decode step over the shards. The
CP ranks agree on the decode steps (`decode_agreement.py`); a step past the cache's room is
refused on every rank before any collective.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..masks.document_placement import DocumentPlacement
from ..masks.mask import Mask, as_attention_mask
from ..masks.sink import check_offset
from ..masks.slices import SliceMask
from ..runtime import agreement
from ..runtime.grid import MeshGrid
from .cache import CacheLayout, KVShard
from .decode import EXCHANGES, decode_attention
from .decode_agreement import DecodeAgreement, DecodeOptions
from .packed import PackedShard, placed_positions, prefill_packed
from .prefill import prefill_attention

PREFILL, DECODE = "prefill", "decode"


@dataclass
class InferenceSession:
    """The cache and position of one batch. `lengths` [b]: each prompt's real length;
    `group`: the CP group the decode exchange runs over (None: the default group);
    `placement`: packed prompts placed by `place_documents` (its first b documents are the
    prompts, a last one may be padding), None for dense prompts (the zigzag share);
    `attention_mask`: the model's mask over the whole generated sequence (a `Mask` or
    `SliceMask`, e.g. a bidirectional prefix; None: causal; with packed prompts, over each
    document's own positions), which prefill runs on the prompts and decode reads a row of
    per new token."""

    layout: CacheLayout
    lengths: torch.Tensor
    group: dist.ProcessGroup | None = None
    shards: dict[int, KVShard | PackedShard] = field(default_factory=dict)
    phase: str = PREFILL
    step: int = 0  # the decode step running (its new tokens sit at lengths + step)
    options: dict = field(default_factory=dict)  # mesh_attention's backend / schedule
    exchange: str = "all_gather"  # how decode merges the partials (`decode.EXCHANGES`)
    placement: DocumentPlacement | None = None
    attention_mask: Mask | SliceMask | None = None
    # built on the first prefill layer, on its device, and kept for the others: the zigzag
    # share's positions [s] (dense) or the placed rows' (documents [t], positions [t])
    _prompt_positions: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = field(
        default=None, repr=False)
    _masks: dict[tuple[int, int | None], torch.Tensor] = field(default_factory=dict, repr=False)
    _agreement: DecodeAgreement = field(default_factory=DecodeAgreement, repr=False)

    def __post_init__(self) -> None:
        if self.attention_mask is not None:  # here, before any layer's collective
            as_attention_mask(self.attention_mask).check_one_sequence("attention_mask")

    @property
    def batch(self) -> int:
        return int(self.lengths.numel())

    def decode_positions(self) -> torch.Tensor:
        """[b] the global positions of this decode step's new tokens."""
        return self.lengths + self.step

    def cache_bytes(self) -> int:
        """Bytes of every layer's shard on this rank."""
        return sum(s.nbytes for s in self.shards.values())

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               grid: MeshGrid, scale: float, window: tuple[int, int] | None = None,
               softmax_offset: torch.Tensor | None = None) -> torch.Tensor:
        """Layer `layer`'s attention: prefill q [s, b, hq, d], k / v [s, b, hkv, d] (this
        rank's zigzag share of the padded prompts) or decode q [1, b, hq, d], k / v
        [1, b, hkv, d] (the step's new tokens, the same on every rank) -> out [s | 1, b,
        hq, dv]."""
        if self.phase == PREFILL and self.placement is not None:
            return self._prefill_packed(layer, q, k, v, grid, scale, window, softmax_offset)
        if self.phase == PREFILL:
            shard = KVShard.allocate(self.layout, self.batch, k.shape[2], k.shape[3],
                                     v.shape[3], k.dtype, k.device)
            self.shards[layer] = shard
            if self._prompt_positions is None:
                self._prompt_positions = self.layout.prompt_positions().to(k.device)
            return prefill_attention(q, k, v, grid, shard, self._prompt_positions,
                                     self.lengths, scale, window, softmax_offset,
                                     self.attention_mask, **self.options)
        return self._decode(layer, q, k, v, grid, scale, window, softmax_offset)

    def check_room(self) -> None:
        """ValueError unless the cache has room for decode step `step` (every rank holds the
        same step and layout, so every rank raises alike, before any collective)."""
        room = self.layout.max_new
        if not 0 <= self.step < room:
            raise ValueError(f"decode step {self.step} is past the KV cache's room: it was "
                             f"allocated for {room} new tokens per sequence (steps 0 .. "
                             f"{room - 1}); start the session with a larger max_new")

    def _check_decode(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      softmax_offset: torch.Tensor | None) -> None:
        """ValueError naming what this rank cannot decode."""
        if q.dim() != 4 or q.shape[0] != 1 or k.shape[0] != 1 or v.shape[0] != 1:
            raise ValueError(f"a decode step takes one new token per sequence: q [1, b, hq, "
                             f"d], got q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}")
        if q.shape[1] != self.batch:
            raise ValueError(f"a decode step of this session takes {self.batch} sequences, "
                             f"got {q.shape[1]}")
        if layer not in self.shards:
            raise ValueError(f"layer {layer} decodes without its prefill (layers with a "
                             f"cache: {sorted(self.shards)})")
        if self.exchange not in EXCHANGES:
            raise ValueError(f"exchange {self.exchange!r}: valid values are "
                             f"{', '.join(EXCHANGES)}")
        check_offset(softmax_offset, q.shape[2])

    def _decode(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                grid: MeshGrid, scale: float, window: tuple[int, int] | None,
                softmax_offset: torch.Tensor | None) -> torch.Tensor:
        """Decode step `step` of layer `layer`: q [1, b, hq, d], k / v [1, b, hkv, d] ->
        [1, b, hq, dv]; the ranks agree first where `decode_agreement` says."""
        self.check_room()
        left = None if window is None else window[0]
        layout = self.layout
        kind = "packed" if self.placement is not None else "dense"
        if self.attention_mask is not None:
            kind += f" (mask {self._mask_text()})"
        options = DecodeOptions.of(layer, q, k, v, scale, left, softmax_offset, self.exchange,
                                   (layout.cp_size, layout.prompt_len, layout.max_new, kind))
        try:
            self._check_decode(layer, q, k, v, softmax_offset)
        except ValueError as error:
            if self._agreement.agrees(layer):
                agreement.refuse(grid, error)  # every rank raises it
            raise
        exchange = self._agreement.before_exchange(grid, self.step, options)
        shard = self.shards[layer]
        pos = self.decode_positions().to(k.device)
        if layout.owner(self.step) == layout.cp_rank:
            where = self.step if isinstance(shard, PackedShard) else self.layout.slot(self.step)
            shard.append(where, k[0], v[0], pos)
        mask = None
        if isinstance(shard, PackedShard):
            # every layer's packed shard holds the same documents and positions: one mask a
            # step per window (layers may differ in window: sliding and full layers)
            if any(step != self.step for step, _ in self._masks):
                self._masks.clear()
            mask = self._masks.get((self.step, left))
            if mask is None:
                mask = self._masks[(self.step, left)] = shard.visible(pos, left,
                                                                      self.attention_mask)
        out = decode_attention(q[0], shard, pos, scale, self.group, self.layout.cp_size, left,
                               softmax_offset, exchange, mask, self.attention_mask)
        return out[None]

    def _mask_text(self) -> str:
        """The session's mask as every rank's agreement compares it."""
        mask = self.attention_mask
        return mask.text() if isinstance(mask, SliceMask) else as_attention_mask(mask).describe()

    def _prefill_packed(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        grid: MeshGrid, scale: float, window: tuple[int, int] | None,
                        softmax_offset: torch.Tensor | None) -> torch.Tensor:
        """Packed prompts: q [t, 1, hq, d], k / v [t, 1, hkv, d] are this rank's placed rows."""
        assert self.placement is not None
        shard = PackedShard.allocate(self.placement, self.layout.max_new, k.shape[2],
                                     k.shape[3], v.shape[3], k.dtype, k.device,
                                     sequences=self.batch)
        self.shards[layer] = shard
        if self._prompt_positions is None:
            seq, pos = placed_positions(self.placement, grid.cp_rank)
            self._prompt_positions = (seq.to(k.device), pos.to(k.device))
        out = prefill_packed(q[:, 0], k[:, 0], v[:, 0], grid, shard, self.placement, scale,
                             window, softmax_offset, self._prompt_positions,
                             self.attention_mask, **self.options)
        return out[:, None]
