"""The structure of a Megatron indexed dataset's ``.idx`` file, checked against its ``.bin``.

The format (little-endian), as megatron-core's IndexedDatasetBuilder writes it:

    magic        9 bytes   b"MMIDIDX\\x00\\x00"
    version      uint64    1
    dtype code   uint8     1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32,
                           8 uint16: the token ids' type in the .bin
    sequences    uint64    N
    documents    uint64    D + 1 (the document index starts with 0)
    lengths      int32[N]  tokens per sequence
    pointers     int64[N]  byte offset of each sequence in the .bin
    doc index    int64[D + 1]  first sequence of each document, then N
    modes        int8[N]   only in multimodal indexes

`read_index` checks every count against the file size, every sequence against the .bin
(pointers ascending, each sequence inside it) and the document index (ascending from 0 to
N), in chunks, so a damaged index fails at start-up with one line instead of at a batch.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
HEADER_BYTES = 34
TOKEN_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
                6: np.float64, 7: np.float32, 8: np.uint16}
_CHUNK = 1 << 22  # entries checked at a time


class DamagedIndex(ValueError):
    """A damaged .idx; the message says what is wrong (the caller names the file)."""


@dataclass(frozen=True)
class IndexSummary:
    dtype: np.dtype
    tokens: int     # sum of the sequence lengths
    sequences: int
    documents: int


def _header(path: str) -> tuple[int, int, int]:
    """(dtype code, sequences N, document index length D + 1) from the 34-byte header."""
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
    if not head:
        raise DamagedIndex("empty file")
    if len(head) < HEADER_BYTES or head[:9] != MAGIC:
        raise DamagedIndex("bad header")
    version = int.from_bytes(head[9:17], "little")
    if version != 1:
        raise DamagedIndex(f"format version {version}, 1 expected")
    code = head[17]
    if code not in TOKEN_DTYPES:
        raise DamagedIndex(f"unknown dtype code {code}")
    return code, int.from_bytes(head[18:26], "little"), int.from_bytes(head[26:34], "little")


def _chunks(n: int):
    for start in range(0, n, _CHUNK):
        yield start, min(n, start + _CHUNK)


def read_index(path: str, bin_bytes: int) -> IndexSummary:
    """Check the .idx at `path` against a .bin of `bin_bytes` bytes; raises DamagedIndex."""
    code, n, d1 = _header(path)
    size = os.path.getsize(path)
    plain = HEADER_BYTES + 12 * n + 8 * d1
    if d1 < 1 or size not in (plain, plain + n):  # + n: the multimodal modes array
        raise DamagedIndex(f"its counts ({n} sequences, {d1 - 1} documents) need {plain} bytes "
                          f"but the file has {size} (cut short or a damaged header)")
    dtype = np.dtype(TOKEN_DTYPES[code])
    item = dtype.itemsize
    lengths = np.memmap(path, np.int32, "r", HEADER_BYTES, (n,)) if n else np.zeros(0, np.int32)
    pointers = (np.memmap(path, np.int64, "r", HEADER_BYTES + 4 * n, (n,)) if n
                else np.zeros(0, np.int64))
    docs = np.memmap(path, np.int64, "r", HEADER_BYTES + 12 * n, (d1,))
    tokens, previous = 0, 0
    for lo, hi in _chunks(n):
        length = lengths[lo:hi].astype(np.int64)
        pointer = np.asarray(pointers[lo:hi])
        if (length < 0).any():
            i = lo + int(np.argmax(length < 0))
            raise DamagedIndex(f"sequence {i} has a negative length {int(lengths[i])}")
        starts = np.concatenate(([previous], pointer[:-1] + length[:-1] * item))
        ends = pointer + length * item
        outside = (ends > bin_bytes) | (pointer < 0)
        backwards = pointer < starts
        if outside.any() or backwards.any():
            i = int(np.argmax(outside | backwards))
            if outside[i]:
                raise DamagedIndex(f"sequence {lo + i} (bytes {int(pointer[i])} .. {int(ends[i])}) "
                                   f"lies outside the .bin's {bin_bytes} bytes")
            raise DamagedIndex(f"sequence {lo + i} starts at byte {int(pointer[i])}, before the end "
                               f"of the one before it ({int(starts[i])}; pointers must ascend)")
        previous = int(ends[-1])
        tokens += int(length.sum())
    for lo, hi in _chunks(d1):
        doc = np.asarray(docs[lo:hi])
        before = np.concatenate(([docs[lo - 1] if lo else 0], doc[:-1]))
        if (doc < before).any() or (doc > n).any() or (lo == 0 and doc[0] != 0):
            raise DamagedIndex(f"its document index is not ascending from 0 to the {n} sequences")
    if int(docs[d1 - 1]) != n:
        raise DamagedIndex(f"its document index ends at {int(docs[d1 - 1])}, not at the {n} "
                          "sequences")
    return IndexSummary(dtype, tokens, n, d1 - 1)
