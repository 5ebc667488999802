"""Caches of block data that stay bounded over a run of weeks.

The blocks of packed documents (index tensors, segments, sliding-window masks on the tiles'
device) depend on the micro-batch's documents, and a run sees new documents every
micro-batch. `per_documents` keeps such entries for the last `KEEP_DOCUMENTS` documents
values only (one micro-batch's blocks are reused by every layer, forward and backward, and
pipeline schedules keep a few micro-batches in flight) and drops every entry of an older
one together (a documents value: any hashable value that names what a micro-batch's
blocks depend on, its documents, their placement or its mask); a backward that finds its
micro-batch dropped makes its blocks again (the same values). Entries without documents
depend on shapes only and sit in an LRU of `dense_size`. `held_bytes` counts what the
caches hold (tensors by storage, numpy arrays by size, tuples of ints at 8 bytes an
element; a dataclass by its fields and the values it made once). `BytesLRU` bounds a
per-shape cache of tensors by bytes (a band's additive mask: shapes vary with the
documents, and one can be hundreds of MiB).
"""
from __future__ import annotations

import dataclasses
import functools
from collections import OrderedDict
from typing import Any, Callable, Hashable, Iterator

import numpy as np
import torch

KEEP_DOCUMENTS = 4  # micro-batches whose blocks are kept
_MISSING = object()
_CACHES: list[PerDocuments | BytesLRU] = []


class PerDocuments:
    """Memoizes fn(*args) (hashable args): entries of the last `keep` documents values that
    `documents_of(*args)` names, and an LRU of `dense_size` entries where it names None."""

    def __init__(self, fn: Callable, documents_of: Callable[..., Hashable | None],
                 keep: int = KEEP_DOCUMENTS, dense_size: int = 4096) -> None:
        functools.update_wrapper(self, fn)
        self.fn, self.documents_of = fn, documents_of
        self.keep, self.dense_size = keep, dense_size
        self.by_documents: OrderedDict[Hashable, dict[Hashable, Any]] = OrderedDict()
        self.dense: OrderedDict[Hashable, Any] = OrderedDict()
        _CACHES.append(self)

    def _table(self, documents: Hashable | None) -> dict:
        if documents is None:
            return self.dense
        table = self.by_documents.get(documents)
        if table is None:
            table = self.by_documents[documents] = {}
            while len(self.by_documents) > self.keep:
                self.by_documents.popitem(last=False)  # the oldest micro-batch's blocks
        else:
            self.by_documents.move_to_end(documents)
        return table

    def __call__(self, *args: Hashable) -> Any:
        documents = self.documents_of(*args)
        table = self._table(documents)
        value = table.get(args, _MISSING)
        if value is _MISSING:
            return self.put(self.fn(*args), *args)
        if documents is None:
            self.dense.move_to_end(args)
        return value

    def kept(self, *args: Hashable) -> Any:
        """fn(*args) where it is kept (as a call finds it), else None; nothing is made."""
        documents = self.documents_of(*args)
        value = self._table(documents).get(args)
        if value is not None and documents is None:
            self.dense.move_to_end(args)
        return value

    def holds(self, *args: Hashable) -> bool:
        """Whether fn(*args) is kept."""
        documents = self.documents_of(*args)
        return args in (self.dense if documents is None else self.by_documents.get(documents, {}))

    def put(self, value: Any, *args: Hashable) -> Any:
        """Keep `value` as fn(*args) (made elsewhere: several in one pass) and return it."""
        self._table(self.documents_of(*args))[args] = value
        while len(self.dense) > self.dense_size:
            self.dense.popitem(last=False)
        return value

    def cache_clear(self) -> None:
        self.by_documents.clear()
        self.dense.clear()

    def values(self) -> Iterator[Any]:
        yield from self.dense.values()
        for table in self.by_documents.values():
            yield from table.values()


class BytesLRU:
    """Memoizes fn(*args) -> tensor (hashable args) in an LRU holding at most `max_bytes` of
    tensors in all; a tensor larger than that is returned uncached (made on every call)."""

    def __init__(self, fn: Callable[..., torch.Tensor], max_bytes: int) -> None:
        functools.update_wrapper(self, fn)
        self.fn, self.max_bytes = fn, max_bytes
        self.entries: OrderedDict[Hashable, torch.Tensor] = OrderedDict()
        self.held = 0
        _CACHES.append(self)

    def __call__(self, *args: Hashable) -> torch.Tensor:
        if args in self.entries:
            self.entries.move_to_end(args)
            return self.entries[args]
        value = self.fn(*args)
        size = value.untyped_storage().nbytes()
        if size <= self.max_bytes:
            self.entries[args] = value
            self.held += size
            while self.held > self.max_bytes:
                _, old = self.entries.popitem(last=False)
                self.held -= old.untyped_storage().nbytes()
        return value

    def cache_clear(self) -> None:
        self.entries.clear()
        self.held = 0

    def values(self) -> Iterator[Any]:
        yield from self.entries.values()


def per_documents(documents_of: Callable[..., Hashable | None], keep: int = KEEP_DOCUMENTS,
                  dense_size: int = 4096) -> Callable[[Callable], PerDocuments]:
    """Decorator form of `PerDocuments`."""
    return lambda fn: PerDocuments(fn, documents_of, keep, dense_size)


def held_bytes() -> int:
    """Bytes the caches of this module hold: every tensor's storage once, tuples of ints at
    8 bytes an element (what a run's memory of them grows with)."""
    seen: set[tuple[str, int]] = set()
    return sum(_bytes(value, seen) for cache in _CACHES for value in cache.values())


def _bytes(value: Any, seen: set[tuple[str, int]]) -> int:
    if isinstance(value, torch.Tensor):
        storage = value.untyped_storage()
        key = (str(value.device), storage.data_ptr())
        if key in seen:
            return 0
        seen.add(key)
        return storage.nbytes()
    if isinstance(value, np.ndarray):  # a block's runs and slices as arrays
        return value.nbytes
    if isinstance(value, bytes):  # a call's runs as bytes (`SideRuns.key`)
        return len(value)
    if isinstance(value, (tuple, list)):
        return sum(_bytes(v, seen) if not isinstance(v, int) else 8 for v in value)
    if isinstance(value, dict):  # e.g. a call's bias per device (`TileSlices`)
        return sum(_bytes(v, seen) for v in value.values())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        # its fields and what it made once when asked (cached properties: a documents
        # call's offsets as tensors, a call's runs)
        held = vars(value) if hasattr(value, "__dict__") else {
            f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        return sum(_bytes(v, seen) for v in held.values())
    return 0
