"""Every rank of a CP group agrees on each mesh-attention call before any of its collectives.

Ranks that pass different shapes, dtype, documents, causal, softmax_scale, schedule,
gradient dtypes, window or window exchange (or run under different MESH_GROUP_TOKENS, which
can resolve 'streamed' to another schedule) would hang or compute wrong results, and an
input rejected on some ranks only would leave the others waiting. So a call checks its input
locally without raising, then takes part in ONE all_reduce (MAX) of three int64 over the CP
group (`max_over_cp`): a 63-bit digest d of its `CallSignature`, -d, and a flag "rejected
here"; the digests are equal iff max(d) == -max(-d). Only when they differ, or a rank
rejected its input, a second collective gathers every rank's signature (as text) and error,
and every rank raises a ValueError naming the values that differ, or the rejection.

Every call (forward only: backward follows the forward) takes part, on a gloo group on the
CPU (`grid.AGREEMENT_BACKEND`; `scripts/bench_agreement.py` measures it): nothing is cached,
since a rank that skipped a cached agreement would enter the attention's collectives while
another waits in the agreement. Decode steps agree through their own `Signature`, once
per generated token (`inference/decode_agreement.py`). The mask is compared by what the
caller gave (causal, the documents' or placement's digest, the window, a `SliceMask`'s
digest), not by its slices (`layout.mask_slices`): these fields determine the slices, name
the value that differs, and need no O(documents) slicing per call (nor masks/ imported here).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, ClassVar, NoReturn, Protocol

import torch
import torch.distributed as dist

from .grid import MeshGrid

# what every rank of a CP group must pass alike, as named in the messages
FIELDS = ("shapes", "documents", "causal", "softmax_scale", "MESH_GROUP_TOKENS", "schedule",
          "grad_reduce_dtype", "window_size", "window_exchange", "grid", "softmax_offset",
          "backward", "mask")
_DIGEST_MASK = 0x7FFF_FFFF_FFFF_FFFF


class Agreed(Protocol):
    """A value the ranks compare by a digest every process computes alike (the masks:
    `Documents`, `DocumentPlacement`, `SliceMask`)."""

    def agreement_key(self) -> int: ...


class DocumentsValue(Agreed, Protocol):
    """A call's documents as the messages name them: `Documents` or `DocumentPlacement`."""

    lengths: tuple[int, ...]

    @property
    def total(self) -> int: ...


class MaskValue(Agreed, Protocol):
    """A mask given as slices (`masks/slices.py`: `SliceMask`)."""

    def text(self) -> str: ...


@dataclass(frozen=True)
class CallSignature:
    """One call's decisions that must be the same on every rank (not its tile backend,
    which may differ per rank and computes the same attention)."""

    q: tuple[int, ...]  # [s, b, hq, d] (after the THD view of packed documents)
    k: tuple[int, ...]  # [s, b, hkv, d]
    dv: int  # V's head dim
    dtype: torch.dtype
    documents: DocumentsValue | None  # THD documents or placed ones
    causal: bool
    softmax_scale: float
    schedule: str  # the plan's (resolved) schedule
    grad_reduce_dtype: str
    window: tuple[int, int] | None  # the checked window (`window.window_of`), None: none
    window_exchange: str  # the plan's exchange under a window: 'sparse' rows or 'dense'
    grid: tuple[int, int, int]  # (A, R, C)
    sink: bool = False  # a softmax_offset is passed (its values are a replicated parameter)
    backward: bool = False  # autograd records the call: its backward's collectives will run
    mask: MaskValue | None = None  # a mask given as slices (`masks/slices.py`)
    # the grouped calls' cap from the environment (None: unset); it decides the schedule
    # 'streamed' resolves to, so a rank launched with another value plans other collectives
    group_tokens: int | None = None
    SUBJECT: ClassVar[str] = "mesh attention"  # what the ranks pass arguments to, in messages
    SAME: ClassVar[str] = ("the same shapes, dtype, cu_seqlens, causal, softmax_scale, "
                           "schedule, grad_reduce_dtype, window_size, window_exchange and mask, "
                           "and run with the same MESH_GROUP_TOKENS")

    def values(self) -> tuple:
        """The fields as values whose repr is the same on every process: the documents by
        `Documents.agreement_key`, the scale by its exact repr."""
        docs = None if self.documents is None else self.documents.agreement_key()
        return (self.q, self.k, self.dv, str(self.dtype), docs, self.causal,
                repr(self.softmax_scale), self.schedule, self.grad_reduce_dtype, self.window,
                self.window_exchange, self.grid, self.sink, self.backward,
                None if self.mask is None else self.mask.agreement_key(), self.group_tokens)

    def digest(self) -> int:
        """A 63-bit digest of `values` (blake2b: python's hash of a str differs per process)."""
        data = repr(self.values()).encode()
        return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") \
            & _DIGEST_MASK

    def texts(self) -> dict[str, str]:
        """Each of `FIELDS` as it reads in a message (different values read differently)."""
        s, b, hq, d = self.q
        hkv = self.k[2]
        kv = (f"k/v [{s}, {b}, {hkv}, {d}]" if self.dv == d
              else f"k [{s}, {b}, {hkv}, {d}] dv {self.dv}")
        return {
            "shapes": f"q [{s}, {b}, {hq}, {d}] {kv} {str(self.dtype).removeprefix('torch.')}",
            "documents": "none" if self.documents is None else _documents_text(self.documents),
            "causal": repr(self.causal),
            "softmax_scale": repr(self.softmax_scale),
            "MESH_GROUP_TOKENS": "unset" if self.group_tokens is None else str(self.group_tokens),
            "schedule": repr(self.schedule),
            "grad_reduce_dtype": repr(self.grad_reduce_dtype),
            "window_size": "none" if self.window is None else repr(self.window),
            "window_exchange": repr(self.window_exchange),
            "grid": "x".join(map(str, self.grid)),
            "softmax_offset": "given" if self.sink else "none",
            "backward": "to run (inputs need gradients)" if self.backward else "none",
            "mask": "none" if self.mask is None else self.mask.text(),
        }


def _documents_text(documents: DocumentsValue, shown: int = 6) -> str:
    cu = [0]
    for n in documents.lengths:
        cu.append(cu[-1] + n)
    more = ", ..." if len(cu) > shown else ""
    return (f"cu_seqlens [{', '.join(map(str, cu[:shown]))}{more}] padded total "
            f"{documents.total} (#{documents.agreement_key():x})")


class Signature(Protocol):
    """What `agree` compares: a `CallSignature`, or another collective call's (a decode
    step's, `inference/decode_agreement.py`)."""

    SUBJECT: ClassVar[str]
    SAME: ClassVar[str]

    def digest(self) -> int: ...

    def texts(self) -> dict[str, str]: ...


def agree(grid: MeshGrid, signature: Signature) -> None:
    """Collective over the CP group (one small all_reduce): returns when every rank passed
    this signature; else ValueError on every rank naming the values that differ (each of
    `signature.texts()`)."""
    if grid.cp_size == 1:
        return
    d = signature.digest()
    high, neg_low, rejected = max_over_cp(grid, [d, -d, 0])
    if high != -neg_low or rejected:
        _fail(grid, signature, None)


def refuse(grid: MeshGrid, error: Exception) -> NoReturn:
    """Collective over the CP group (the same all_reduce as `agree`): this rank rejected its
    input with `error`; every rank raises ValueError naming it (a group of one: `error`)."""
    if not isinstance(grid, MeshGrid) or grid.cp_size == 1:
        raise error
    max_over_cp(grid, [0, 0, 1])
    _fail(grid, None, error)


def max_over_cp(grid: MeshGrid, values: list[int]) -> list[int]:
    """Element-wise max of int64 `values` over the CP group: one all_reduce on its agreement
    group, or (a grid built without one) over the row, column and heads groups in turn."""
    t = torch.tensor(values, dtype=torch.int64)
    if grid.agreement_group is not None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=grid.agreement_group)
        return t.tolist()
    for group in _groups(grid):
        on = t.to(_device_of(group))
        dist.all_reduce(on, op=dist.ReduceOp.MAX, group=group)
        t = on.cpu()
    return t.tolist()


def _groups(grid: MeshGrid) -> list[dist.ProcessGroup]:
    """The row, column and heads groups with more than one rank: together the CP group."""
    return [g for g in (grid.row_group, grid.col_group, grid.heads_group)
            if g is not None and dist.get_world_size(g) > 1]


def _device_of(group: dist.ProcessGroup) -> torch.device:
    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_over_cp(grid: MeshGrid, item: Any) -> list[Any]:
    """Every CP rank's `item` (picklable), in no particular order."""
    if grid.agreement_group is not None:
        out: list[Any] = [None] * dist.get_world_size(grid.agreement_group)
        dist.all_gather_object(out, item, group=grid.agreement_group)
        return out
    items = [item]
    for group in _groups(grid):
        parts: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, items, group=group)
        items = [x for part in parts for x in part]
    return items


def _fail(grid: MeshGrid, signature: Signature | None, error: Exception | None) -> NoReturn:
    """The second collective: gather every rank's signature and error; raise on every rank."""
    mine = (grid.cp_rank, None if signature is None else signature.texts(),
            None if error is None else str(error) or type(error).__name__)
    every = sorted(gather_over_cp(grid, mine), key=lambda item: item[0])
    wording = {} if signature is None else {"subject": signature.SUBJECT,
                                            "same": signature.SAME}
    raise ValueError(message(grid.shape_text, mine, every, **wording)) from error


def _ranks(ranks: list[int]) -> str:
    return f"CP rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, sorted(ranks)))}"


def message(shape: str, mine: tuple, every: list[tuple], subject: str = CallSignature.SUBJECT,
            same: str = CallSignature.SAME) -> str:
    """The error every rank raises: the rejections (this rank's first), else each field that
    differs, with this rank's value and the others'. Items: (CP rank, texts or None, error
    text or None); `subject` and `same` word the call (the signature's)."""
    rejected: dict[str, list[int]] = {}
    for rank, _, error in every:
        if error is not None:
            rejected.setdefault(error, []).append(rank)
    if rejected:
        first = mine[2] if mine[2] is not None else next(iter(rejected))
        parts = [f"{first} ({_ranks(rejected[first])} of the {shape} grid)"]
        parts += [f"{e} ({_ranks(r)})" for e, r in rejected.items() if e != first]
        return ("; ".join(parts) + "; every rank of the CP group raises, since a call "
                "rejected on some ranks would leave the others waiting")
    me, texts, _ = mine
    differ = []
    for field in texts:
        others: dict[str, list[int]] = {}
        for rank, their, _ in every:
            if their[field] != texts[field]:
                others.setdefault(their[field], []).append(rank)
        if others:
            differ.append(f"{field} {texts[field]} here (CP rank {me}), " + ", ".join(
                f"{value} on {_ranks(r)}" for value, r in sorted(others.items())))
    if not differ:  # digests differ for equal texts: cannot happen unless a field is missing
        differ.append("signature digests differ")
    return (f"ranks of one {shape} grid pass different arguments to {subject}: "
            + "; ".join(differ) + f"; every rank of a CP group must pass {same}")
