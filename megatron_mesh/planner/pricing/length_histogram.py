"""Document lengths as a histogram file: what `python -m megatron_mesh.preprocess` writes
beside its dataset, and what `megatron-mesh plan --doc-length-dist histogram:FILE` draws
packed documents from.

The file is JSON: {"format": FORMAT, "documents": n, "tokens": t, "bins": [[first, last,
count], ...]}, a bin holding the documents of first .. last tokens (inclusive). Bins are
exact up to 17 tokens, then BINS_PER_OCTAVE per doubling (each about 9% wide), so a
corpus of any size gives a file of a few hundred bins at most.
"""
from __future__ import annotations

import bisect
import json
import math
import random
from dataclasses import dataclass
from typing import Iterable

FORMAT = "megatron-mesh document lengths 1"
BINS_PER_OCTAVE = 8
EXACT_UP_TO = 17


def bin_firsts(longest: int) -> list[int]:
    """The first length of each bin up to `longest`: 1 .. 17, then 8 a doubling."""
    firsts = list(range(1, min(longest, EXACT_UP_TO) + 1))
    k = BINS_PER_OCTAVE * 4  # 2^(k / 8) = 16
    while firsts[-1] < longest:
        nxt = math.ceil(2 ** ((k + 1) / BINS_PER_OCTAVE))
        if nxt > firsts[-1]:
            firsts.append(nxt)
        k += 1
    return [f for f in firsts if f <= longest]


@dataclass(frozen=True)
class LengthHistogram:
    """Counts of document lengths by bin: bins ((first, last, count), ...), none empty."""

    bins: tuple[tuple[int, int, int], ...]

    @classmethod
    def of(cls, lengths: Iterable[int]) -> LengthHistogram:
        """The histogram of positive document lengths."""
        lengths = list(lengths)
        if not lengths or min(lengths) < 1:
            raise ValueError("a length histogram needs at least one document of >= 1 token")
        firsts = bin_firsts(max(lengths))
        counts = [0] * len(firsts)
        for n in lengths:
            counts[bisect.bisect_right(firsts, n) - 1] += 1
        lasts = [f - 1 for f in firsts[1:]] + [max(lengths)]
        return cls(tuple((f, last, c) for f, last, c in zip(firsts, lasts, counts) if c))

    @property
    def documents(self) -> int:
        return sum(c for _, _, c in self.bins)

    def to_dict(self, tokens: int) -> dict:
        return {"format": FORMAT, "documents": self.documents, "tokens": tokens,
                "bins": [list(b) for b in self.bins]}

    def write(self, path: str, tokens: int) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(tokens), f)
            f.write("\n")

    @classmethod
    def read(cls, path: str) -> LengthHistogram:
        """The histogram in `path`; ValueError naming what is wrong."""
        try:
            with open(path) as f:
                data = json.load(f)
        except OSError as e:
            raise ValueError(f"{path}: {e.strerror or e}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not a JSON length histogram ({e})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"{path}: not a length histogram of this version (format "
                             f"{FORMAT!r}, as python -m megatron_mesh.preprocess writes)")
        bins = data.get("bins")
        ok = isinstance(bins, list) and bins and all(
            isinstance(b, list) and len(b) == 3 and all(isinstance(x, int) for x in b)
            and 1 <= b[0] <= b[1] and b[2] > 0 for b in bins)
        if not ok:
            raise ValueError(f"{path}: 'bins' must be [first, last, count] lists of positive "
                             "integers, first <= last")
        return cls(tuple(tuple(b) for b in bins))

    def draw(self, seq_length: int, seed: int = 0) -> tuple[int, ...]:
        """Document lengths drawn from the histogram (a bin by its count, a length uniformly
        in it) until they fill `seq_length` (the last one cut to fit); deterministic."""
        rnd = random.Random(seed)
        weights = [c for _, _, c in self.bins]
        out: list[int] = []
        left = seq_length
        while left > 0:
            first, last, _ = rnd.choices(self.bins, weights)[0]
            out.append(min(rnd.randint(first, last), left))
            left -= out[-1]
        return tuple(out)
