"""The length histogram preprocess writes and the planner draws from: bins hold every
length once, the file round-trips, draws fill the sequence from the bins' lengths."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_mesh.planner.pricing.length_histogram import LengthHistogram, bin_firsts


def test_bins_hold_each_length_once() -> None:
    lengths = [1, 2, 2, 17, 18, 19, 100, 101, 4096, 70000]
    hist = LengthHistogram.of(lengths)
    assert hist.documents == len(lengths)
    for first, last, count in hist.bins:
        assert count == sum(first <= n <= last for n in lengths) > 0
    spans = [(f, last) for f, last, _ in hist.bins]
    assert all(a[1] < b[0] for a, b in zip(spans, spans[1:]))  # disjoint, in order
    assert hist.bins[-1][1] == 70000
    firsts = bin_firsts(1 << 20)
    assert firsts[:17] == list(range(1, 18)) and len(firsts) < 160
    assert all(b / a < 1.12 for a, b in zip(firsts[17:], firsts[18:]))  # 2^(1 / 8) rounded up


def test_file_round_trip_and_draws(tmp_path: Path) -> None:
    hist = LengthHistogram.of([5] * 30 + [1000] * 10)
    path = tmp_path / "lengths.json"
    hist.write(str(path), 30 * 5 + 10 * 1000)
    assert LengthHistogram.read(str(path)) == hist
    drawn = hist.draw(65536, seed=3)
    assert sum(drawn) == 65536 and drawn == hist.draw(65536, seed=3)
    spans = [(f, last) for f, last, _ in hist.bins]
    assert all(any(f <= n <= last for f, last in spans) for n in drawn[:-1])
    short = sum(n == 5 for n in drawn[:-1])
    assert 0.6 < short / len(drawn[:-1]) < 0.9  # 3 in 4 drawn from the short bin


@pytest.mark.parametrize("content, words", [
    ("{", "not a JSON length histogram"),
    (json.dumps({"format": "other"}), "not a length histogram of this version"),
    (json.dumps({"format": "megatron-mesh document lengths 1", "bins": [[3, 2, 1]]}),
     "first <= last"),
])
def test_bad_files_are_named(tmp_path: Path, content: str, words: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=words):
        LengthHistogram.read(str(path))
    with pytest.raises(ValueError, match="No such file"):
        LengthHistogram.read(str(tmp_path / "missing.json"))
