"""One mask value: what every query of a call sees, whatever built it.

A `Mask` keeps the pairs all of its parts keep: causal or not (query i sees key j only where
j <= i), the packed documents (THD `Documents` or a `DocumentPlacement`: a query sees only
its own document), a sliding window (`Window`, on positions) and a user's slices
(`SliceMask`, over the same positions: the dense sequence's, or the packed sequence's with
documents, padded for THD). `&` intersects two masks; the fields stay what the fast paths
read (the documents for the THD layout and variable-length calls, the window for the halo
exchange, the placement for placed runs), and `slices` gives the one form every path can
read (`layout.mask_slices` cuts the blocks from it, the planner prices it, decode reads a
generated token's row).

    mm.documents_mask(cu_seqlens) & mm.sliding_window_mask(128)
    mm.documents_mask(cu_seqlens, causal=False) & mm.SliceMask([...], S)

`mesh_attention`'s keywords (causal, cu_seqlens, cu_seqlens_padded, placement, window_size)
build the same value (`resolve_mask`).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable

import torch

from .document_placement import DocumentPlacement
from .documents import Documents
from .placed_documents import placed_slices
from .seen import keeps, one_row, sees
from .slices import CAUSAL, FULL, Slice, SliceMask, as_mask, intersect
from .window import Window, window_of, windowed


@dataclass(frozen=True)
class Mask:
    """What every query sees: the pairs that `causal`, the `documents` or `placement` (at
    most one), the `window` and the user's `slices` all keep (None: that part limits
    nothing). Build it with `documents_mask`, `sliding_window_mask`, `as_attention_mask`
    and `&`; `Mask()` is the causal mask of one dense sequence."""

    causal: bool = True
    documents: Documents | None = None
    placement: DocumentPlacement | None = None
    window: Window | None = None  # a window that limits something (`window.window_of`)
    slices: SliceMask | None = None  # a user's slices, over the same positions

    def __post_init__(self) -> None:
        if not isinstance(self.causal, bool):
            raise ValueError(f"causal={self.causal!r} must be True or False")
        if self.documents is not None and self.placement is not None:
            raise ValueError("a mask holds packed documents as cu_seqlens (THD) or as a "
                             "placement, not both")
        if self.documents is not None and not isinstance(self.documents, Documents):
            raise ValueError(f"documents must be a Documents value, got "
                             f"{type(self.documents).__name__} (documents_mask builds one)")
        if self.placement is not None and not isinstance(self.placement, DocumentPlacement):
            raise ValueError(f"placement must be a DocumentPlacement (from place_documents), "
                             f"got {type(self.placement).__name__}")
        if self.window is not None and not isinstance(self.window, Window):
            raise ValueError(f"window must be a Window, got {type(self.window).__name__} "
                             "(sliding_window_mask builds one)")
        if self.slices is not None and not isinstance(self.slices, SliceMask):
            object.__setattr__(self, "slices", as_mask(self.slices))
        if self.causal and self.window is not None:  # written one way (`window_of`)
            object.__setattr__(self, "window", window_of((self.window.left, 0), True))

    @property
    def packing(self) -> Documents | DocumentPlacement | None:
        """The packed documents, THD or placed (None: one dense sequence)."""
        return self.documents if self.documents is not None else self.placement

    def __and__(self, other: object) -> Mask:
        """The pairs both masks keep: causal if either is, their documents (ValueError where
        both hold different ones), the windows' common band, the slices' intersection."""
        if isinstance(other, (SliceMask, list, tuple)):
            other = Mask(False, slices=as_mask(other))
        if not isinstance(other, Mask):
            return NotImplemented
        documents = _same("documents", self.documents, other.documents)
        placement = _same("placement", self.placement, other.placement)
        causal = self.causal or other.causal
        slices = (self.slices if other.slices is None else other.slices if self.slices is None
                  else intersect(self.slices, other.slices))
        return Mask(causal, documents, placement, _both(self.window, other.window), slices)

    __rand__ = __and__

    def sequence_slices(self, seq_len: int) -> SliceMask:
        """The mask as slices over a sequence of `seq_len` positions (the packed sequence's,
        padded for THD, with documents): the base (the documents', or one slice of the dense
        sequence), the user's slices intersected with it, the window laid on them."""
        if self.placement is not None:
            base = placed_slices(self.placement, self.causal)
        elif self.documents is not None:
            base = self.documents.slices(self.causal)
        elif self.slices is not None and not self.causal:
            base = None  # the user's slices alone
        else:
            base = SliceMask([(0, seq_len, 0, seq_len, CAUSAL if self.causal else FULL)],
                             seq_len)
        if self.slices is not None:
            base = self.slices if base is None else intersect(base, self.slices)
        return windowed(base, self.window)

    def leading(self, length: int) -> Mask:
        """The mask of the first `length` positions (a prompt's, of a mask written for the
        whole generated sequence): the user's slices cut there (`SliceMask.leading`)."""
        return self if self.slices is None else replace(self, slices=self.slices.leading(length))

    def check_one_sequence(self, what: str) -> None:
        """ValueError, naming `what`, where the mask packs documents: its rows are then not
        rows over one sequence's positions, which decode reads (`row`)."""
        if self.packing is not None:
            raise ValueError(
                f"{what} ({self.describe()}) packs documents: decode reads a token's row over "
                "one sequence's positions; give the model's mask over one document's "
                "positions, and pack the prompts as documents with a placement instead")

    def row(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """bool [b, n]: which keys at positions k_pos [b, n] the query at q_pos [b] sees: its
        row of the mask over one dense sequence (decode: a generated token's, over the
        cached keys; `seen.one_row` for causal and the window, `seen.sees` for the slices).
        Keys at negative positions (empty slots) are never seen. ValueError for a mask of
        packed documents (`check_one_sequence`)."""
        self.check_one_sequence("the mask")
        left = None if self.window is None else self.window.left
        right = 0 if self.causal else -1 if self.window is None else self.window.right
        seen = keeps(one_row(q_pos, left, right), q_pos[:, None], k_pos)
        if self.slices is not None:
            seen &= sees(self.slices, q_pos, k_pos)
        return seen

    def describe(self) -> str:
        """The mask as it reads in a message."""
        parts = ["causal" if self.causal else "full"]
        if self.documents is not None:
            parts.append(f"{self.documents.count} documents (cu_seqlens)")
        if self.placement is not None:
            parts.append(f"{len(self.placement.lengths)} placed documents")
        if self.window is not None:
            parts.append(f"window ({self.window.left}, {self.window.right})")
        if self.slices is not None:
            parts.append(self.slices.text())
        return " & ".join(parts)


def _same(name: str, a: object, b: object) -> object:
    if a is not None and b is not None and a != b:
        raise ValueError(f"two masks of different {name} cannot be composed: a call has one "
                         f"packed sequence (build both from the same {name})")
    return a if a is not None else b


def _both(a: Window | None, b: Window | None) -> Window | None:
    """The band both windows keep (-1: unbounded)."""
    if a is None or b is None:
        return a if b is None else b

    def tighter(x: int, y: int) -> int:
        return y if x < 0 else x if y < 0 else min(x, y)

    return Window(tighter(a.left, b.left), tighter(a.right, b.right))


def documents_mask(documents: torch.Tensor | list[int] | Documents | DocumentPlacement,
                   cu_seqlens_padded: torch.Tensor | list[int] | None = None,
                   causal: bool = True) -> Mask:
    """The mask of packed documents: `documents` as cumulative lengths (int32 [n + 1], with
    the padded ones in `cu_seqlens_padded`: Transformer Engine's THD layout), a `Documents`
    value, or a `DocumentPlacement` (`place_documents`); each query sees its own document,
    causally where `causal`."""
    if isinstance(documents, DocumentPlacement):
        if cu_seqlens_padded is not None:
            raise ValueError("cu_seqlens_padded was given with a placement; placed documents "
                             "are not padded")
        return Mask(causal, placement=documents)
    return Mask(causal, documents=packed_documents(documents, cu_seqlens_padded))


def each_document(mask: Mask | SliceMask | Iterable, placement: DocumentPlacement) -> Mask:
    """`mask`, written over one document's own positions, kept by every document of
    `placement`: its slices laid at each document's offset in the packed sequence (a
    document of n tokens keeps `mask.leading(n)`), on the placement."""
    model = as_attention_mask(mask)
    parts, start = [], 0
    for n in placement.lengths:
        for s in model.leading(n).sequence_slices(n).slices:
            parts.append(Slice(s.q_start + start, s.q_end + start, s.k_start + start,
                               s.k_end + start, s.kind, s.window))
        start += n
    return Mask(False, placement=placement, slices=SliceMask(parts, start))


def sliding_window_mask(left: int, right: int = 0, causal: bool = True) -> Mask:
    """Flash-attention's sliding window: query i sees keys i - left .. i + right (-1:
    unbounded on that side; right 0 or -1 when `causal`), on positions (within each
    document where composed with documents)."""
    return Mask(causal, window=window_of((left, right), causal))


def as_attention_mask(mask: Mask | SliceMask | Iterable) -> Mask:
    """`mask` as a `Mask`: a `SliceMask` or a list of slices is the mask of those slices
    alone (not causal beyond them)."""
    return mask if isinstance(mask, Mask) else Mask(False, slices=as_mask(mask))


def packed_documents(cu_seqlens: torch.Tensor | list[int] | Documents | None,
                     cu_seqlens_padded: torch.Tensor | list[int] | None = None
                     ) -> Documents | None:
    """The `Documents` of Megatron's cumulative lengths (None without them); a `Documents`
    value is taken as it is. Reads the tensors once (a device-to-host copy on a GPU): a
    caller that runs many layers on one packed batch resolves it once and passes the value."""
    if cu_seqlens is None:
        if cu_seqlens_padded is not None:
            raise ValueError("cu_seqlens_padded was given without cu_seqlens")
        return None
    if isinstance(cu_seqlens, Documents):
        if cu_seqlens_padded is not None:
            raise ValueError("cu_seqlens is a Documents value, which holds the padded lengths "
                             f"already (cu_padded {list(cu_seqlens.cu_padded)}); pass "
                             "cu_seqlens_padded=None with it, or both as cumulative lengths")
        return cu_seqlens
    return Documents.from_cu_seqlens(cu_seqlens, cu_seqlens_padded)


def resolve_mask(mask: Mask | SliceMask | Iterable | None, causal: bool | None,
                 documents: Documents | None, placement: DocumentPlacement | None,
                 window_size: tuple[int, int] | None) -> Mask:
    """The one `Mask` of a call's keywords: `causal` (None: True without a mask), the
    documents (THD or placed) and `window_size` build it, composed (`&`) with `mask` where
    one is given; with a mask the documents and window only cut it (not causal beyond it).
    ValueError where `causal` comes with a mask, or the keywords' documents differ from the
    mask's."""
    if mask is None:
        causal = True if causal is None else causal
        return Mask(causal, documents, placement, window_of(window_size, causal))
    if causal is not None:
        raise ValueError(f"causal={causal!r} was given with a mask; the mask alone says what "
                         "each query sees (compose it with mm.Mask(causal=True) where it "
                         "should be causal): pass one of them")
    built = Mask(False, documents, placement, window_of(window_size, False))
    return as_attention_mask(mask) & built
