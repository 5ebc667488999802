"""Masks given as slices (`masks/slices.py`), on one process: the checks, the cut and the
intersection against the definition, every rank-block's kernel calls against the dense
mask, the prefix-LM builder, and that a prefix-LM mask is one file."""
from __future__ import annotations

import ast
import random
import re
from pathlib import Path

import pytest
import torch

import megatron_mesh as mm
from megatron_mesh.calls.layout import AttentionMask, block_for, zigzag_split
from megatron_mesh.masks import slices as slices_module
from megatron_mesh.masks.seen import sees
from megatron_mesh.masks.slices import Slice, SliceMask
from megatron_mesh.masks.window import Window, windowed

from reference import block_pairs

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "megatron_mesh"


def dense(slices, seq: int) -> torch.Tensor:
    """[seq, seq] bool from the definition: query i sees key j iff a slice holds (i, j) and,
    causal, j - k_start <= i - q_start + (k_end - k_start) - (q_end - q_start); with a
    window (left, right), flash-attention's bottom-right band: -left <= (j - i) - (k_end -
    q_end) <= right (-1: unbounded)."""
    i = torch.arange(seq)[:, None]
    j = torch.arange(seq)[None, :]
    seen = torch.zeros(seq, seq, dtype=torch.bool)
    for q0, q1, k0, k1, kind, *window in slices:
        inside = (i >= q0) & (i < q1) & (j >= k0) & (j < k1)
        if kind == "causal":
            inside &= (j - k0) <= (i - q0) + (k1 - k0) - (q1 - q0)
        if window:
            left, right = window[0]
            shift = (j - i) - (k1 - q1)
            if left >= 0:
                inside &= shift >= -left
            if right >= 0:
                inside &= shift <= right
        seen |= inside
    return seen


def random_slices(seq: int, count: int, rng: random.Random, windows: bool = False
                  ) -> list[tuple]:
    """Up to `count` random non-overlapping slices (rejection sampling); `windows`: some
    with a window band (left, right)."""
    out: list[tuple] = []
    for _ in range(20 * count):
        if len(out) == count:
            break
        q0, k0 = rng.randrange(seq), rng.randrange(seq)
        q1, k1 = rng.randint(q0 + 1, min(seq, q0 + seq // 2)), rng.randint(k0 + 1, seq)
        s = (q0, q1, k0, k1, rng.choice(("full", "causal")))
        if windows and rng.random() < 0.6:
            s += ((rng.randint(-1, seq // 4), rng.randint(-1, seq // 4)),)
        if not any(a < q1 and q0 < b and c < k1 and k0 < d for a, b, c, d, *_ in out):
            out.append(s)
    return out


def test_cut_keeps_exactly_the_pairs_of_the_definition():
    rng = random.Random(0)
    seq = 24
    for _ in range(300):
        s = random_slices(seq, 1, rng)[0]
        q_lo, k_lo = rng.randrange(seq), rng.randrange(seq)
        q_hi, k_hi = rng.randint(q_lo + 1, seq), rng.randint(k_lo + 1, seq)
        parts = Slice(*s).cut(q_lo, q_hi, k_lo, k_hi)
        want = dense([s], seq)
        want[:q_lo] = want[q_hi:] = False
        want[:, :k_lo] = want[:, k_hi:] = False
        got = torch.zeros(seq, seq, dtype=torch.int64)
        for p in parts:
            got += dense([p.as_tuple], seq).long()
            block = dense([p.as_tuple], seq)[p.q_start:p.q_end, p.k_start:p.k_end]
            assert bool(block.any(1).all()) and bool(block.any(0).all()), (s, p)
        assert len(parts) <= 2 and torch.equal(got, want.long()), (s, (q_lo, q_hi, k_lo, k_hi))
        assert Slice(*s).pairs == int(dense([s], seq).sum())


def test_windowed_slices_cut_keep_exactly_the_pairs_of_the_definition():
    """A window band on a slice: written one way (the same pairs), cut into at most two
    slices whose rows each see a key, banded further, and its pairs counted in closed form."""
    rng = random.Random(1)
    seq = 24
    i, j = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
    for _ in range(600):
        s = random_slices(seq, 1, rng, windows=True)[0]
        written = Slice(*s) if len(s) == 5 else SliceMask([s]).slices[0]
        assert torch.equal(dense([written.as_tuple], seq), dense([s], seq)), (s, written)
        assert written.window is None or (written.kind == "full"
                                          and written.window not in ((-1, -1), (-1, 0)))
        q_lo, k_lo = rng.randrange(seq), rng.randrange(seq)
        q_hi, k_hi = rng.randint(q_lo + 1, seq), rng.randint(k_lo + 1, seq)
        want = dense([s], seq)
        want[:q_lo] = want[q_hi:] = False
        want[:, :k_lo] = want[:, k_hi:] = False
        got = torch.zeros(seq, seq, dtype=torch.int64)
        parts = written.cut(q_lo, q_hi, k_lo, k_hi)
        for p in parts:
            got += dense([p.as_tuple], seq).long()
            block = dense([p.as_tuple], seq)[p.q_start:p.q_end, p.k_start:p.k_end]
            assert bool(block.any(1).all()) and bool(block.any(0).all()), (s, p)
        assert len(parts) <= 2 and torch.equal(got, want.long()), (s, (q_lo, q_hi, k_lo, k_hi))
        assert written.pairs == int(dense([s], seq).sum()), s
        lo, hi = rng.choice([None, rng.randint(-9, 9)]), rng.choice([None, rng.randint(-9, 9)])
        band = dense([s], seq)
        if lo is not None:
            band &= j - i >= lo
        if hi is not None:
            band &= j - i <= hi
        got = sum((dense([p.as_tuple], seq).long() for p in written.banded(lo, hi)),
                  torch.zeros(seq, seq, dtype=torch.int64))
        assert torch.equal(got, band.long()), (s, lo, hi)


def test_sees_is_the_definition_on_any_positions():
    """`seen.sees` on query and key positions in any order, some outside every slice
    (negative: padding), keys shared or each query's own."""
    rng = random.Random(2)
    seq = 32
    for _ in range(60):
        slices = random_slices(seq, 8, rng, windows=True)
        mask = SliceMask(slices)
        want = dense(slices, seq)
        assert mask.pairs == int(want.sum())
        q_pos, k_pos = torch.randperm(seq + 4) - 2, torch.randperm(seq + 4) - 2
        inside = lambda p: (p >= 0) & (p < seq)  # noqa: E731
        q, k = q_pos.clamp(0, seq - 1), k_pos.clamp(0, seq - 1)
        expect = want[q[:, None], k[None, :]] & inside(q_pos)[:, None] & inside(k_pos)[None, :]
        assert torch.equal(sees(mask, q_pos, k_pos), expect)
        own = torch.stack([torch.randperm(seq) for _ in range(len(q_pos))])
        assert torch.equal(sees(mask, q_pos, own), want[q[:, None], own] & inside(q_pos)[:, None])


def test_prefix_lm_builder_is_the_three_slices():
    mask = mm.prefix_lm_mask(seq_len=1024, prefix_len=256)
    given = mm.SliceMask([(0, 256, 0, 256, "full"), (256, 1024, 0, 256, "full"),
                          (256, 1024, 256, 1024, "causal")], seq_len=1024)
    assert mask == given and hash(mask) == hash(given)
    seen = dense([s.as_tuple for s in mask.slices], 1024)
    i, j = torch.arange(1024)[:, None], torch.arange(1024)[None, :]
    assert torch.equal(seen, (j < 256) | (j <= i))
    assert mask.pairs == int(seen.sum())
    assert mm.prefix_lm_mask(8, 8).slices == (Slice(0, 8, 0, 8, "full"),)
    for bad, words in (((8, 0), "prefix_len=0"), ((8, 9), "at most seq_len=8"),
                       ((0, 1), "seq_len=0")):
        with pytest.raises(ValueError, match=re.escape(words)):
            mm.prefix_lm_mask(*bad)


@pytest.mark.parametrize("slices, words", [
    ([(0, 4, 0, 4, "full"), (2, 6, 3, 8, "causal")], "slices 0 (0, 4, 0, 4, 'full') and 1 "
                                                     "(2, 6, 3, 8, 'causal') overlap"),
    ([(4, 8, 0, 2, "full"), (0, 8, 6, 8, "full"), (0, 2, 0, 7, "full")],
     "slices 1 (0, 8, 6, 8, 'full') and 2 (0, 2, 0, 7, 'full') overlap"),
    ([(0, 4, 0, 4, "diag")], "kind 'diag' is not one of"),
    ([(0, 4, 4, 4, "full")], "slice 0 (0, 4, 4, 4, 'full') must have"),
    ([(0, 4, -1, 4, "full")], "0 <= k_start"),
    ([(0, 4, 0, 4)], "must be (q_start, q_end, k_start, k_end, kind)"),
    ([(0, 4.0, 0, 4, "full")], "bounds must be ints"),
    ([(0, 4, 0, 4, "full", (-2, 0))], "its window (-2, 0) must be a pair (left, right) of ints"),
    ([(0, 4, 0, 4, "full", 3)], "its window 3 must be"),
    ("0, 4", "takes a list of slices"),
])
def test_bad_slices_are_named(slices, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        SliceMask(slices)


def test_bounds_name_the_slice_and_the_length():
    mask = SliceMask([(0, 8, 0, 8, "causal"), (8, 16, 0, 17, "full")])
    with pytest.raises(ValueError, match=re.escape("slice (8, 16, 0, 17, 'full') reaches past "
                                                   "the sequence of 16 tokens")):
        mask.check_length(16)
    mask.check_length(17)
    with pytest.raises(ValueError, match="built for a sequence of 32 tokens, but the call's "
                                         "sequence has 16"):
        mm.prefix_lm_mask(32, 4).check_length(16)
    with pytest.raises(ValueError, match="reaches past the sequence of 8 tokens"):
        SliceMask([(0, 9, 0, 2, "full")], seq_len=8)


def test_masks_are_equal_whatever_the_order_given():
    a = SliceMask([(4, 8, 0, 4, "full"), (0, 4, 0, 4, "causal")])
    b = SliceMask([Slice(0, 4, 0, 4, "causal"), Slice(4, 8, 0, 4, "full")])
    assert a == b and a.agreement_key() == b.agreement_key()
    assert a.agreement_key() != SliceMask([(0, 4, 0, 4, "full"), (4, 8, 0, 4, "full")]).key
    assert "2 slices [(0, 4, 0, 4, 'causal'), (4, 8, 0, 4, 'full')]" in a.text()


def _masks(seq: int) -> dict[str, list[tuple]]:
    rng = random.Random(seq)
    docs, start = [], 0
    for n in [3, 1, 5, 2, 7, 4, 6, 2, 9, 1] * seq:
        if start >= seq:
            break
        end = min(seq, start + n)
        docs.append((start, end, start, end, "causal" if n % 2 else "full"))
        start = end
    return {
        "prefix": [s.as_tuple for s in mm.prefix_lm_mask(seq, seq // 3).slices],
        "documents": docs,
        "random": random_slices(seq, 12, rng),
        "empty rows": [(0, seq // 4, 0, seq // 8, "causal"), (seq // 2, seq, seq // 2, seq,
                                                               "full")],
        "unequal": [(0, seq // 2, seq // 4, seq, "causal"), (seq // 2, seq, 0, seq // 3, "full"),
                    (seq // 2 + 1, seq, seq // 3, seq - 2, "causal")],
        "windowed": random_slices(seq, 12, rng, windows=True),
        "sliding window": [(0, seq, 0, seq, "causal", (seq // 5, 0))],
        "windowed documents": [s.as_tuple for s in windowed(SliceMask(docs), Window(3, 1)).slices],
    }


@pytest.mark.parametrize("ranks", [1, 2, 4, 8])
def test_every_block_calls_each_pair_of_the_mask_once(ranks):
    """The kernel calls of all blocks, laid back on positions, cover every pair the mask keeps
    exactly once, and nothing else; an empty block has no call."""
    seq = 16 * ranks
    local = seq // ranks
    position = zigzag_split(torch.arange(seq), ranks)
    for name, slices in _masks(seq).items():
        mask = AttentionMask(False, ranks=ranks, slices=SliceMask(slices))
        got = torch.zeros(seq, seq, dtype=torch.int64)
        for x in range(ranks):
            for y in range(ranks):
                block = block_for(x, y, local, mask)
                for call in block.calls:
                    pq, pk = position[x][call.q_rows], position[y][call.kv_rows]
                    seen = call.seen()
                    assert bool(seen.any(1).all()), (name, x, y)  # every row sees a key
                    got[pq[:, None], pk[None, :]] += seen.long()
        want = dense(slices, seq)
        assert torch.equal(got, want.long()), (name, ranks)


def test_short_documents_are_one_variable_length_call():
    """Short causal documents: one variable-length call of them all, holding their bounds
    only (no mask of rows x keys); a causal piece of more keys than queries joins the
    square before it when together they are one causal document; an empty block has no
    call."""
    mask = AttentionMask(False, ranks=2, slices=SliceMask(
        [(n, n + 2, n, n + 2, "causal") for n in range(0, 30, 2)] + [(30, 32, 28, 32, "causal")]))
    (call,) = block_for(0, 0, 16, mask).calls  # rank 0: positions 0..7, 24..31
    assert (call.q_rows, call.kv_rows) == (slice(0, 16), slice(0, 16)) and call.causal
    assert call.slices.form == "documents" and call.slices._bias == {}
    assert call.slices.cu_q == call.slices.cu_kv == (0, 2, 4, 6, 8, 10, 12, 16)  # 28..31
    assert block_for(0, 1, 16, mask).calls == ()
    (call,) = block_for(1, 1, 16, mask).calls
    assert call.slices.cu_q == tuple(range(0, 17, 2))


# ---- a new mask kind is one file ----

# The modules that say which (query, key) pairs a mask keeps: `slices.py` defines what a
# slice means, `calls/tile_slices.py` holds the one rule (`keeps`, read by `seen.py` on
# positions and by kernel calls on their rows) and a band's closed form, and `seen.py`
# applies the rule to any positions. Every mask kind, and every block's calls
# (`slice_blocks.py`), is made of slices and codes no rule of its own.
MASK_RULE_FILES = {"masks/slices.py", "masks/seen.py", "calls/tile_slices.py"}
# What coding a mask rule looks like: a causal or band shape cut from a matrix, a comparison
# of key and query positions, or of their difference.
RULE_PATTERN = re.compile(
    r"\.(tril|triu)\("
    r"|(<=|>=|<|>)\s*(\w+_pos|pos_\w+)\b|\b(\w+_pos|pos_\w+)(\[[^\]]*\])?\s*(<=|>=|<|>)"
    r"|\bdelta\s*(<=|>=|<|>)")
# The modules that build slices: every mask kind given as slices.
SLICE_BUILDERS = {"masks/slices.py", "masks/prefix.py", "masks/window.py", "masks/documents.py",
                  "calls/layout.py", "masks/placed_documents.py", "masks/mask.py", "masks/chunked.py",
                  "masks/packed.py"}


def _sources() -> dict[str, str]:
    return {str(p.relative_to(PACKAGE)): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def test_mask_rule_files_exist():
    assert MASK_RULE_FILES <= set(_sources())


def test_every_module_coding_a_mask_rule_is_listed():
    """A module that compares key and query positions, or cuts a causal or band shape, says
    which pairs a mask keeps: it is one of `MASK_RULE_FILES` (a new mask kind is a builder
    of slices, read by `seen.py`, and adds none)."""
    coding = {name for name, text in _sources().items() if RULE_PATTERN.search(text)}
    assert coding <= MASK_RULE_FILES, sorted(coding - MASK_RULE_FILES)
    assert RULE_PATTERN.search("seen &= pos_kv[None, :] <= pos_q[:, None]")
    assert RULE_PATTERN.search("ok = (k != EMPTY) & (k <= q_pos[:, None])")
    assert RULE_PATTERN.search("mask = torch.ones(sq, sk).tril(sk - sq)")
    assert not RULE_PATTERN.search("return keeps(one_row(q_pos, window_left), q_pos, k_pos)")


def test_only_the_builders_make_slices():
    """A module that constructs a Slice or SliceMask is a mask builder (`SLICE_BUILDERS`);
    every other module reads slices."""
    makers = set()
    for name, text in _sources().items():
        for node in ast.walk(ast.parse(text)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("Slice", "SliceMask")):
                makers.add(name)
    # slice_blocks moves cut slices to local rows, which is no new mask
    assert makers - {"calls/slice_blocks.py"} == SLICE_BUILDERS


def test_the_prefix_lm_mask_is_one_file():
    """Only masks/prefix.py knows the prefix-LM mask (the package's __init__ exports it), and
    it imports nothing of the package but slices."""
    mentions = {name for name, text in _sources().items()
                if re.search(r"prefix[_ -]?lm", text, re.IGNORECASE)}
    assert mentions == {"masks/prefix.py", "__init__.py"}, mentions
    tree = ast.parse((PACKAGE / "masks/prefix.py").read_text())
    project = {node.module for node in ast.walk(tree)
               if isinstance(node, ast.ImportFrom) and node.level}
    plain = {a.name for node in ast.walk(tree) if isinstance(node, ast.Import)
             for a in node.names}
    assert project == {"slices"} and not {n for n in plain if n.startswith("megatron_mesh")}


# ---- every mask kind as slices, read by one rule ----

def test_decode_masks_are_one_row_slices():
    """A decode step's query sees its keys by its one-row causal slice (window or not): the
    dense cache's `visible` and the packed cache's `PackedShard.visible` against `sees` on a
    SliceMask of that slice, and against the rule written out (causal, window, no EMPTY)."""
    from megatron_mesh.inference.cache import EMPTY
    from megatron_mesh.inference.decode import visible
    from megatron_mesh.inference.packed import PackedShard

    gen = torch.Generator().manual_seed(3)
    b, n = 5, 40
    q_pos = torch.randint(0, 30, (b,), generator=gen)
    k_pos = torch.randint(0, 36, (n, b), generator=gen)
    k_pos[torch.rand(n, b, generator=gen) < 0.2] = EMPTY
    for left in (None, -1, 0, 3):
        got = visible(q_pos, k_pos, left)
        k = k_pos.t()
        want = (k != EMPTY) & (k <= q_pos[:, None])
        if left is not None and left >= 0:
            want &= k >= q_pos[:, None] - left
        assert torch.equal(got, want), left
        for row in range(b):
            p = int(q_pos[row])
            one = SliceMask([(p, p + 1, 0, p + 1, "causal", (-1 if left is None else left, -1))])
            assert torch.equal(sees(one, q_pos[row:row + 1], k_pos[:, row]), got[row:row + 1])

    shard = PackedShard(torch.zeros(n, 1, 2), torch.zeros(n, 1, 2),
                        torch.randint(0, b, (n,), generator=gen), k_pos[:, 0].clone(), b, n, 1, n)
    for left in (None, 2):
        got = shard.visible(q_pos, left)
        want = ((shard.seq[None, :] == torch.arange(b)[:, None]) & (shard.pos[None, :] != EMPTY)
                & (shard.pos[None, :] <= q_pos[:, None]))
        if left is not None:
            want &= shard.pos[None, :] >= q_pos[:, None] - left
        assert torch.equal(got, want), left


def _pairs_by_definition(mask, q_rank: int, kv_rank: int, local_len: int) -> torch.Tensor:
    """[local_len, local_len] bool from each row's (position in its document, document):
    the same document (not padding), causal on positions, the window on positions."""
    from megatron_mesh.masks.placed_documents import positions
    from megatron_mesh.masks.window import token_positions

    def rows(rank):
        if mask.placement is not None:
            return positions(mask.placement, rank)
        return token_positions(mask.ranks, rank, local_len, mask.documents)

    (pq, dq), (pk, dk) = rows(q_rank), rows(kv_rank)
    seen = (dq[:, None] == dk[None, :]) & (dq[:, None] >= 0)
    delta = pk[None, :] - pq[:, None]
    if mask.causal:
        seen &= delta <= 0
    if mask.window is not None:
        if mask.window.left >= 0:
            seen &= delta >= -mask.window.left
        if mask.window.right >= 0:
            seen &= delta <= mask.window.right
    return seen


@pytest.mark.parametrize("kind", ["dense", "documents", "placed"])
def test_every_mask_kind_is_its_slices(kind):
    """The dense zigzag, THD documents (padded) and placed documents, with and without a
    window: `layout.block_pairs` (their slices, `mask_slices`, read by `seen.sees` on the
    rows' positions) keeps the pairs of the definition on every block."""
    from megatron_mesh.calls.layout import mask_slices
    from megatron_mesh.masks.document_placer import place_documents
    from megatron_mesh.masks.documents import Documents

    ranks = 4
    cu = [0, 40, 56, 120, 128, 200, 256]
    windows = [None, Window(5, 0), Window(0, 0), Window(3, 4), Window(-1, 2)]
    for window in windows:
        for causal in ((True, False) if window is None or window.right <= 0 else (False,)):
            if kind == "dense":
                mask, local = AttentionMask(causal, ranks=ranks, window=window), 64
            elif kind == "documents":
                padded = [0, 48, 64, 128, 136, 208, 256]  # multiples of 2P = 8
                actual = [0, 43, 59, 116, 121, 191, 232]  # 43, 16, 57, 5, 70, 41 tokens
                docs = Documents.from_cu_seqlens(actual, padded)
                mask, local = AttentionMask(causal, docs, ranks, window), 64
            else:
                placement = place_documents(cu, ranks)
                mask = AttentionMask(causal, ranks=ranks, window=window, placement=placement)
                local = placement.local_tokens
            assert len(mask_slices(mask, local)) >= 1
            for x in range(ranks):
                for y in range(ranks):
                    want = _pairs_by_definition(mask, x, y, local)
                    assert torch.equal(block_pairs(mask, x, y, local), want), (kind, window, x, y)


# ---- one mask value: the keywords and `&` build it, its slices are the intersection ----

def test_intersection_keeps_the_pairs_both_masks_keep():
    """`a & b` of two SliceMasks (windows, causal and full slices of unequal lengths) keeps
    exactly the pairs of the definition that both keep; `leading` the first n positions."""
    rng = random.Random(11)
    seq = 40
    for _ in range(30):
        a = random_slices(seq, 6, rng, windows=True)
        b = random_slices(seq, 6, rng, windows=True)
        both = SliceMask(a) & SliceMask(b)
        assert torch.equal(dense([s.as_tuple for s in both.slices], seq),
                           dense(a, seq) & dense(b, seq))
        n = rng.randint(1, seq)
        head = SliceMask(a).leading(n)
        assert head.seq_len == n
        assert torch.equal(dense([s.as_tuple for s in head.slices], n), dense(a, seq)[:n, :n])


def _pairs(slices) -> set[tuple[int, int]]:
    """The (query, key) pairs of slices, one by one from the definition (`dense`'s rule)."""
    kept = set()
    for q0, q1, k0, k1, kind, *window in slices:
        for i in range(q0, q1):
            for j in range(k0, k1):
                if kind == "causal" and (j - k0) > (i - q0) + (k1 - k0) - (q1 - q0):
                    continue
                shift = (j - i) - (k1 - q1)
                if window and ((window[0][0] >= 0 and shift < -window[0][0])
                               or (window[0][1] >= 0 and shift > window[0][1])):
                    continue
                kept.add((i, j))
    return kept


@pytest.mark.parametrize("at_once", [1 << 20, 5])
def test_intersecting_documents_with_slices_keeps_the_pairs_both_keep(monkeypatch, at_once):
    """Documents (causal or full) & random slices (windows too), and random & random, on
    small sequences: the pairs of the definition both keep, each slice's rows seeing a key
    and its keys seen; with 5 slice pairs compared at once too (blocks of `a`)."""
    monkeypatch.setattr(slices_module, "_PAIRS_AT_ONCE", at_once)
    rng = random.Random(17)
    for trial in range(120):
        seq = rng.randint(2, 28)
        cuts = sorted({0, seq, *rng.sample(range(1, seq), min(seq - 1, rng.randint(0, 6)))})
        documents = [(x, y, x, y, rng.choice(("causal", "full"))) for x, y in zip(cuts, cuts[1:])]
        a = documents if trial % 3 else random_slices(seq, rng.randint(1, 8), rng, windows=True)
        b = random_slices(seq, rng.randint(1, 8), rng, windows=True)
        got = [s.as_tuple for s in (SliceMask(a) & SliceMask(b)).slices]
        assert _pairs(got) == _pairs(a) & _pairs(b), (a, b)
        for s in got:
            kept = _pairs([s])
            assert {i for i, _ in kept} == set(range(s[0], s[1])), s
            assert {j for _, j in kept} == set(range(s[2], s[3])), s


def test_the_keywords_build_the_same_mask():
    """mesh_attention's keywords (`resolve_mask`) build the value the builders and `&` do:
    causal, documents (THD, placed), a window, slices; `&` is commutative, causal if either
    is, and refuses two different packed sequences or causal beside a mask."""
    from megatron_mesh.masks.document_placer import place_documents
    from megatron_mesh.masks.mask import resolve_mask

    docs = mm.Documents.from_cu_seqlens([0, 5, 12], [0, 8, 16])
    placement = place_documents([0, 5, 16], 2)
    user = mm.prefix_lm_mask(16, 3)
    assert resolve_mask(None, None, None, None, None) == mm.Mask()
    assert resolve_mask(None, False, docs, None, (3, 0)) == \
        mm.documents_mask([0, 5, 12], [0, 8, 16], causal=False) & \
        mm.sliding_window_mask(3, 0, causal=False)
    assert resolve_mask(None, None, docs, None, (3, -1)) == \
        mm.documents_mask(docs) & mm.sliding_window_mask(3)
    assert resolve_mask(None, None, None, placement, None) == mm.documents_mask(placement)
    assert resolve_mask(user, None, None, None, None) == mm.Mask(False, slices=user)
    assert resolve_mask(user, None, docs, None, (2, 1)) == \
        mm.documents_mask(docs, causal=False) & user & mm.sliding_window_mask(2, 1, False)
    a, b = mm.documents_mask(docs, causal=False) & user, user & mm.documents_mask(docs, causal=False)
    assert a == b and not a.causal
    assert (mm.Mask() & user).causal and (mm.Mask() & user).slices == user
    assert (mm.sliding_window_mask(4) & mm.sliding_window_mask(2, 5, False)).window == Window(2, 0)
    with pytest.raises(ValueError, match="different documents"):
        mm.documents_mask(docs) & mm.documents_mask([0, 16])
    with pytest.raises(ValueError, match="causal=True was given with a mask"):
        resolve_mask(user, True, None, None, None)
    with pytest.raises(ValueError, match="cu_seqlens_padded was given with a placement"):
        mm.documents_mask(placement, [0, 8, 16])


@pytest.mark.parametrize("kind", ["dense", "documents", "placed"])
def test_a_users_slices_compose_with_every_mask_kind(kind):
    """A user's slices over the (packed) sequence's positions, with the documents (THD,
    placed) or the dense sequence and a window: every block keeps the pairs of the
    definition that the slices keep too."""
    from megatron_mesh.calls.layout import global_positions
    from megatron_mesh.masks.document_placer import place_documents
    from megatron_mesh.masks.documents import Documents

    ranks, rng = 4, random.Random(5)
    for window in (None, Window(6, 0), Window(3, 4)):
        causal = window is None or window.right == 0
        user = SliceMask(random_slices(256, 8, rng, windows=True))
        if kind == "dense":
            mask, local = AttentionMask(causal, ranks=ranks, window=window, slices=user), 64
        elif kind == "documents":
            docs = Documents.from_cu_seqlens([0, 43, 59, 116, 121, 191, 232],
                                             [0, 48, 64, 128, 136, 208, 256])
            mask, local = AttentionMask(causal, docs, ranks, window, slices=user), 64
        else:
            placement = place_documents([0, 40, 56, 120, 128, 200, 256], ranks)
            mask = AttentionMask(causal, ranks=ranks, window=window, placement=placement,
                                 slices=user)
            local = placement.local_tokens
        kept = dense([s.as_tuple for s in user.slices], 256)
        for x in range(ranks):
            for y in range(ranks):
                want = _pairs_by_definition(mask, x, y, local)
                px, py = global_positions(mask, x, local), global_positions(mask, y, local)
                want &= kept[px.clamp(min=0)][:, py.clamp(min=0)]
                assert torch.equal(block_pairs(mask, x, y, local), want), (kind, window, x, y)


def test_a_mask_row_is_its_slices_row():
    """`Mask.row` (decode: a token's row over cached keys) equals the mask's slices read by
    `sees` on the same positions, for causal, windows, full and a user's slices; empty
    slots (-1) are never seen."""
    gen = torch.Generator().manual_seed(4)
    seq, b, n = 48, 6, 30
    q_pos = torch.randint(0, seq, (b,), generator=gen)
    k_pos = torch.randint(-1, seq, (b, n), generator=gen)
    user = SliceMask(random_slices(seq, 6, random.Random(2), windows=True), seq)
    for mask in (mm.Mask(), mm.Mask(False), mm.sliding_window_mask(5),
                 mm.sliding_window_mask(3, 2, causal=False), mm.Mask(False, slices=user),
                 mm.Mask(slices=mm.prefix_lm_mask(seq, 7)) & mm.sliding_window_mask(9),
                 mm.sliding_window_mask(-1, 4, causal=False) & user):
        want = sees(mask.sequence_slices(seq), q_pos, k_pos.clamp(min=0)) & (k_pos >= 0)
        assert torch.equal(mask.row(q_pos, k_pos), want), mask.describe()


# ---- chunked attention (Llama 4's local layers) ----

def _chunked_by_definition(seq: int, chunk: int, cu: list[int] | None = None) -> torch.Tensor:
    """[seq, seq] bool: query i sees key j iff j <= i and i // chunk == j // chunk, positions
    counted from the start of their document (the same document only, with `cu`)."""
    cu = [0, seq] if cu is None else cu
    doc = torch.bucketize(torch.arange(seq), torch.tensor(cu[1:]), right=True)
    pos = torch.arange(seq) - torch.tensor(cu)[doc]
    i, j = pos[:, None], pos[None, :]
    same = doc[:, None] == doc[None, :]
    return same & (j <= i) & (i // chunk == j // chunk)


@pytest.mark.parametrize("seq,chunk,cu", [(64, 8, None), (64, 5, None), (30, 64, None),
                                          (1, 1, None), (40, 6, [0, 7, 7, 26, 40]),
                                          (48, 4, [0, 48])])
def test_chunked_mask_is_the_definition(seq, chunk, cu):
    mask = mm.chunked_mask(seq, chunk, cu)
    assert torch.equal(dense([s.as_tuple for s in mask.slices], seq),
                       _chunked_by_definition(seq, chunk, cu))
    assert mask == mm.chunked_mask(seq, chunk, cu) and mask.seq_len == seq
    if chunk >= seq and cu is None:  # one chunk: the plain causal mask
        assert [s.as_tuple for s in mask.slices] == [(0, seq, 0, seq, "causal")]


@pytest.mark.parametrize("args,words", [((0, 4), "seq_len=0"), ((8, 0), "chunk=0"),
                                        ((8, True), "chunk=True"),
                                        ((8, 4, [0, 9]), "must rise from 0 to seq_len=8"),
                                        ((8, 4, [0, 5, 3, 8]), "must rise")])
def test_chunked_mask_names_bad_values(args, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        mm.chunked_mask(*args)


def test_the_chunked_mask_is_one_file():
    """Outside the Megatron integration (megatron/, training/, inference/megatron/) only
    masks/chunked.py (and the package's __init__, which exports it) knows chunked attention;
    it imports nothing of the package but slices."""
    mentions = {name for name, text in _sources().items()
                if re.search(r"chunked_mask", text)
                and not name.startswith(("megatron/", "training/", "inference/megatron/"))}
    assert mentions == {"masks/chunked.py", "__init__.py"}, mentions
    tree = ast.parse((PACKAGE / "masks/chunked.py").read_text())
    project = {node.module for node in ast.walk(tree)
               if isinstance(node, ast.ImportFrom) and node.level}
    assert project == {"slices"}


def test_chunked_bytes_per_rank_stay_o_of_the_chunk():
    """The sparse exchange of a chunked mask on 2x2 moves about the same bytes (the rank
    sending most) whatever the sequence length, a chunk's rows per boundary, while the dense
    exchange's grow with it; chunks that are whole sub-chunks move nothing."""
    from megatron_mesh.cost_models.plan import resolve_plan
    from megatron_mesh.cost_models.sparse import sparse_traffic
    from megatron_mesh.cost_models.traffic import mesh_traffic
    from megatron_mesh.layer_plan import AttentionShape, Exchange

    def moved(seq: int, chunk: int) -> tuple[int, int]:
        shape = AttentionShape(seq, 1, 8, 8, 128, 2)
        plan = resolve_plan(shape, 2, 2, "streamed", "mixed", exchange=Exchange.SPARSE)
        mask = AttentionMask(False, ranks=4, slices=mm.chunked_mask(seq, chunk))
        sparse = sparse_traffic(shape, 1, 2, 2, mask, None, plan.dq_bytes(2), plan.dkv_bytes(2))
        return sparse.total, mesh_traffic(shape, resolve_plan(shape, 2, 2, "streamed",
                                                              "mixed")).total

    (short, dense_short), (long, dense_long) = moved(32768, 1000), moved(131072, 1000)
    assert 0 < long < 1.1 * short and dense_long > 3.5 * dense_short
    assert long < 0.02 * dense_long
    assert moved(65536, 4096)[0] == 0  # 4096 = S / 2P: each chunk is one sub-chunk


def _overlapping_pairs(rects: list[tuple]) -> set[tuple[int, int]]:
    """Every pair of slices whose rectangles meet, by comparing all pairs."""
    return {(i, j) for i, a in enumerate(rects) for j, b in enumerate(rects) if i < j
            and a[0] < b[1] and b[0] < a[1] and a[2] < b[3] and b[2] < a[3]}


@pytest.mark.parametrize("seed", range(40))
def test_overlap_sweep_agrees_with_all_pairs(seed):
    """The sweep finds an overlap exactly where comparing every pair does, and names a
    pair that does overlap: random rectangles sharing query ranges, nested, touching at an
    edge (no overlap), equal starts, strips of one column."""
    rng = random.Random(seed)
    n, size = rng.randint(2, 30), rng.choice((4, 16, 64))
    rects = []
    for _ in range(n):
        q0, k0 = rng.randrange(size), rng.randrange(size)
        shape = rng.random()
        q1 = size if shape < 0.3 else rng.randint(q0 + 1, size)  # long shared query ranges
        k1 = k0 + 1 if shape > 0.7 else rng.randint(k0 + 1, size)  # one-column strips
        rects.append((q0, q1, k0, k1, rng.choice(("full", "causal"))))
    pairs = _overlapping_pairs(rects)
    if not pairs:
        assert len(SliceMask(rects)) == n
        return
    with pytest.raises(ValueError, match="overlap") as raised:
        SliceMask(rects)
    named = re.match(r"slices (\d+) .* and (\d+) ", str(raised.value))
    assert (int(named[1]), int(named[2])) in pairs


def test_overlap_sweep_on_strips_and_their_last_overlap():
    """10,000 column strips over the whole query range (the case a quadratic check is slow
    on) pass; one more strip meeting only the last one is named with it; strips that touch
    without meeting, and slices that end where another starts in q, do not overlap."""
    strips = [(0, 1 << 20, 10 * i, 10 * i + 10, "full") for i in range(10_000)]
    assert len(SliceMask(strips)) == 10_000
    with pytest.raises(ValueError, match=re.escape("slices 9999 (0, 1048576, 99990, 100000, "
                                                   "'full') and 10000 (5, 6, 99999, 100001")):
        SliceMask(strips + [(5, 6, 99_999, 100_001, "full")])
    assert len(SliceMask([(0, 4, 0, 4, "full"), (4, 8, 0, 4, "full"), (0, 8, 4, 5, "causal"),
                          (2, 3, 5, 6, "full")])) == 4


def test_keeps_written_in_place_is_the_rule() -> None:
    """`seen.keeps` with `out` (the flex mask's blocks are made so) and without it: per pair,
    i in [q_start, q_end), j in [k_start, k_end) and lo <= j - i <= hi, checked here pair by
    pair for random bounds of a batch of slices."""
    from megatron_mesh.masks.seen import Bounds, keeps

    g = torch.Generator().manual_seed(7)
    n, size = 5, 12
    q0, k0 = (torch.randint(0, size, (n, 1, 1), generator=g) for _ in range(2))
    q1, k1 = q0 + torch.randint(0, size, (n, 1, 1), generator=g), k0 + 6
    lo = torch.randint(-size, size, (n, 1, 1), generator=g)
    hi = lo + torch.randint(0, size, (n, 1, 1), generator=g)
    bounds, i = Bounds(q0, q1, k0, k1, lo, hi), torch.arange(size)
    out = torch.ones(n, size, size, dtype=torch.bool)
    assert keeps(bounds, i[:, None], i, out=out) is out
    want = torch.tensor([[[bool(q0[m] <= r < q1[m] and k0[m] <= c < k1[m]
                                and lo[m] <= c - r <= hi[m]) for c in range(size)]
                          for r in range(size)] for m in range(n)])
    assert torch.equal(out, want) and torch.equal(keeps(bounds, i[:, None], i), want)
