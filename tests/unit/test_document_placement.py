"""Document-aware placement (masks/document_placement.py, the value; masks/document_placer.py,
the search): invariants, balance, zigzag for one document, the work model against a dense
block-diagonal causal mask, bad inputs."""
from __future__ import annotations

import math
import random

import pytest
import torch

from megatron_mesh.calls.layout import zigzag_split
from megatron_mesh.masks.document_placement import DocumentPlacement, zigzag_placement
from megatron_mesh.masks.document_placer import enough_documents, place_documents

S = 65536  # tokens of the packed sequence in the mixes


def cumulative(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def lognormal_mix(seed: int, total: int = S, median: int = 1024, low: int = 128,
                  high: int = 8192, sigma: float = 1.0) -> list[int]:
    """Log-normal document lengths (median `median`, clipped to low..high) filling `total`
    tokens; the last document takes what is left (it may be shorter than `low`)."""
    rng = random.Random(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        n = min(high, max(low, round(median * math.exp(rng.gauss(0.0, sigma)))))
        lengths.append(min(n, total - sum(lengths)))
    return lengths


def long_beside_short(seed: int = 0, long: int = 32768, total: int = S) -> list[int]:
    """One 32K document among many short ones (128..1024 tokens), shuffled in."""
    rng = random.Random(seed)
    short: list[int] = []
    while long + sum(short) < total:
        short.append(min(rng.randint(128, 1024), total - long - sum(short)))
    lengths = short + [long]
    rng.shuffle(lengths)
    return lengths


def all_short(seed: int = 0, total: int = S) -> list[int]:
    rng = random.Random(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        lengths.append(min(rng.randint(16, 512), total - sum(lengths)))
    return lengths


MIXES = {
    **{f"lognormal{seed}": lognormal_mix(seed) for seed in range(8)},
    "long_beside_short": long_beside_short(),
    "all_short": all_short(),
    "equal_1024": [1024] * 64,
    "equal_6400": [6400] * 10,
    "equal_3000_and_rest": [3000] * 21 + [S - 63000],
    "one_token": [1] * 4096,
    "one_token_and_long": [1] * 2048 + [4096] * 3 + [S // 2 - 2048 - 4096 * 3 + S // 2],
}


def check_invariants(placement: DocumentPlacement, lengths: list[int]) -> None:
    """Every token once, equal tokens per rank, runs inside documents, spans consecutive
    (stepping over a rank only where pieces of other split or cut documents fill it), the
    value valid (from_runs rebuilds it equal)."""
    p, total = placement.cp_size, sum(lengths)
    assert placement.lengths == tuple(lengths)
    assert placement.total == total and placement.local_tokens == total // p
    for rank_runs in placement.runs:
        assert sum(n for _, _, n in rank_runs) == total // p
        for doc, first, n in rank_runs:
            assert n >= 1 and first >= 0 and first + n <= lengths[doc]
    indices = torch.cat([placement.token_indices(r) for r in range(p)])
    assert torch.equal(torch.sort(indices).values, torch.arange(total))
    for doc in range(len(lengths)):
        group = placement.spans(doc)
        for rank in set(range(group[0], group[-1] + 1)) - set(group):  # a rank full of pieces
            assert all(len(placement.spans(d)) > 1 for d, _, _ in placement.runs[rank]), (doc, group)
    assert DocumentPlacement.from_runs(p, lengths, placement.runs) == placement


def busiest_over_mean(placement: DocumentPlacement) -> float:
    works = [placement.work(r) for r in range(placement.cp_size)]
    return max(works) * placement.cp_size / sum(works)


@pytest.mark.parametrize("cp_size", [8, 16])
@pytest.mark.parametrize("mix", sorted(MIXES))
def test_mixes_hold_invariants_and_balance(mix: str, cp_size: int) -> None:
    lengths = MIXES[mix]
    placement = place_documents(cumulative(lengths), cp_size)
    check_invariants(placement, lengths)
    assert busiest_over_mean(placement) <= 1.10, placement.summary()


def test_balanced_when_there_are_enough_documents() -> None:
    """Random log-normal mixes (sizes, medians and spreads drawn): every one that meets
    `enough_documents` is balanced within 10%."""
    rng = random.Random(7)
    checked = 0
    for trial in range(80):
        cp_size = rng.choice([4, 8, 16, 32, 64])
        total = rng.choice([16384, 65536, 131072])
        lengths = lognormal_mix(trial, total=total, median=rng.choice([64, 256, 1024, 4096]),
                                low=1, high=total, sigma=rng.choice([0.5, 1.0, 1.5, 2.0]))
        lengths[-1] += -sum(lengths) % (2 * cp_size)
        if not enough_documents(lengths, cp_size):
            continue
        placement = place_documents(cumulative(lengths), cp_size)
        check_invariants(placement, lengths)
        assert busiest_over_mean(placement) <= 1.10, placement.summary()
        checked += 1
    assert checked >= 20, checked


def test_enough_documents() -> None:
    assert enough_documents([100] * 64, 8) and enough_documents(MIXES["all_short"], 16)
    assert not enough_documents([S // 2, S // 2], 8)
    assert not enough_documents([1024] * 64, 64)  # every document fills a rank


@pytest.mark.parametrize("cp_size", [2, 4, 64])
@pytest.mark.parametrize("mix", ["lognormal0", "long_beside_short", "all_short", "one_token"])
def test_invariants_at_other_sizes(mix: str, cp_size: int) -> None:
    lengths = MIXES[mix]
    check_invariants(place_documents(cumulative(lengths), cp_size), lengths)


def dense_causal_work(lengths: list[int], indices: torch.Tensor) -> int:
    """(query, key) pairs of the rows `indices` in a causal block-diagonal mask built from
    the documents (torch.tril per document)."""
    total = sum(lengths)
    mask = torch.zeros(total, total, dtype=torch.int64)
    for start, n in zip(cumulative(lengths), lengths):
        mask[start:start + n, start:start + n] = torch.tril(torch.ones(n, n, dtype=torch.int64))
    return int(mask[indices].sum())


@pytest.mark.parametrize("seed", range(6))
def test_work_matches_a_dense_causal_mask(seed: int) -> None:
    rng = random.Random(seed)
    cp_size = rng.choice([2, 3, 4, 8])
    lengths = [rng.choice([1, 2, 7, 30, 100, 300, 900]) for _ in range(rng.randint(1, 12))]
    lengths[-1] += -sum(lengths) % (2 * cp_size)
    placement = place_documents(cumulative(lengths), cp_size)
    check_invariants(placement, lengths)
    for rank in range(cp_size):
        assert placement.work(rank) == dense_causal_work(lengths, placement.token_indices(rank))


def test_work_of_the_zigzag_layout_matches_a_dense_mask() -> None:
    placement = zigzag_placement(96, 4)
    for rank in range(4):
        assert placement.work(rank) == dense_causal_work([96], placement.token_indices(rank))


@pytest.mark.parametrize("cp_size", [1, 2, 3, 8, 16])
def test_one_document_is_megatron_zigzag(cp_size: int) -> None:
    total = 2 * cp_size * 40
    placement = place_documents([0, total], cp_size)
    assert placement == zigzag_placement(total, cp_size)
    assert placement.key() == zigzag_placement(total, cp_size).key()
    shares = zigzag_split(torch.arange(total), cp_size)
    h = total // (2 * cp_size)
    for rank in range(cp_size):
        assert torch.equal(placement.token_indices(rank), shares[rank])
        want = ((0, rank * h, h), (0, (2 * cp_size - 1 - rank) * h, h)) if cp_size > 1 else ((0, 0, total),)
        assert placement.runs[rank] == want
    assert placement.crossing_tokens() == (total if cp_size > 1 else 0)


def test_deterministic_from_the_lengths() -> None:
    lengths = MIXES["lognormal3"]
    from_list = place_documents(cumulative(lengths), 16)
    from_tensor = place_documents(torch.tensor(cumulative(lengths), dtype=torch.int32), 16)
    assert from_list == from_tensor and from_list.key() == from_tensor.key()
    assert hash(from_list.key()) == hash(from_tensor.key())
    assert place_documents(cumulative(lengths), 8).key() != from_list.key()


def zigzag_pieces(placement: DocumentPlacement, doc: int) -> bool:
    """Whether the document is cut into 2g nearly equal pieces over its g ranks, member k
    holding pieces k and 2g-1-k (rows in document order)."""
    group, length = placement.spans(doc), placement.lengths[doc]
    g = len(group)
    base, extra = divmod(length, 2 * g)
    sizes = [base + (1 if j < extra else 0) for j in range(2 * g)]
    starts = cumulative(sizes)
    for k, rank in enumerate(group):
        held = sorted((first, n) for d, first, n in placement.runs[rank] if d == doc)
        if held != sorted((starts[j], sizes[j]) for j in (k, 2 * g - 1 - k) if sizes[j]):
            return False
    return True


@pytest.mark.parametrize("cp_size", [8, 16])
def test_long_document_zigzag_over_consecutive_ranks(cp_size: int) -> None:
    lengths = MIXES["long_beside_short"]
    placement = place_documents(cumulative(lengths), cp_size)
    long = lengths.index(32768)
    group = placement.spans(long)
    assert len(group) >= 32768 // placement.local_tokens
    assert zigzag_pieces(placement, long)


@pytest.mark.parametrize("mix", ["all_short", "lognormal0", "lognormal1", "equal_1024"])
def test_documents_that_fit_stay_whole(mix: str) -> None:
    """Only documents too long or too heavy for one rank are split; others are cut at most
    at a rank boundary (two per boundary: one dense, one light)."""
    cp_size = 8
    lengths = MIXES[mix]
    placement = place_documents(cumulative(lengths), cp_size)
    capacity = placement.local_tokens
    mean_work = sum(placement.work(r) for r in range(cp_size)) / cp_size
    cut = [d for d, n in enumerate(lengths) if len(placement.spans(d)) > 1
           and n <= capacity // 2 and n * (n + 1) / 2 <= mean_work / 2]
    assert len(cut) <= 2 * (cp_size - 1), (len(cut), placement.summary())
    if mix == "equal_1024":
        assert all(len(placement.spans(d)) == 1 for d in range(len(lengths)))


def test_short_mix_is_mostly_whole() -> None:
    lengths = MIXES["all_short"]
    placement = place_documents(cumulative(lengths), 8)
    assert placement.crossing_tokens() <= 2 * 7 * 512


@pytest.mark.parametrize("cp_size, gpus_per_node", [(16, 4), (16, 8), (64, 8)])
def test_groups_stay_inside_a_node(cp_size: int, gpus_per_node: int) -> None:
    lengths = lognormal_mix(5, total=S * cp_size // 8)
    placement = place_documents(cumulative(lengths), cp_size, gpus_per_node=gpus_per_node)
    check_invariants(placement, lengths)
    zigzagged = [d for d in range(len(lengths))
                 if len(placement.spans(d)) > 2 and zigzag_pieces(placement, d)]
    assert zigzagged, placement.summary()
    for doc in zigzagged:
        group = placement.spans(doc)
        if len(group) <= gpus_per_node:
            assert group[0] // gpus_per_node == group[-1] // gpus_per_node, (doc, group)
        else:
            assert group[0] % gpus_per_node == 0 and len(group) % gpus_per_node == 0, (doc, group)
    assert busiest_over_mean(placement) <= 1.10, placement.summary()


def test_refining_stops_at_the_promise_and_spreads_no_document_over_both_nodes() -> None:
    """The emulated cluster's log-normal mix (P = 16 as 2 x 8, 64K tokens in units of 32):
    refining balance past the promised 10% spread its two longest documents (6432 and 5504
    tokens) over all 16 ranks; now the busiest rank is within 10% and no document is spread
    over more ranks than a node has."""
    units = [27, 33, 64, 29, 132, 7, 42, 10, 30, 24, 24, 4, 35, 60, 172, 74, 4, 9, 82, 11,
             39, 7, 70, 103, 42, 42, 38, 17, 56, 31, 36, 52, 167, 201, 25, 55, 47, 135, 6, 6]
    lengths = [32 * n for n in units]
    assert sum(lengths) == S
    placement = place_documents(cumulative(lengths), 16, gpus_per_node=8)
    check_invariants(placement, lengths)
    assert busiest_over_mean(placement) <= 1.10, placement.summary()
    assert max(len(placement.spans(d)) for d in range(len(lengths))) <= 8, placement.summary()


def test_a_nodes_last_rank_cuts_no_dense_document() -> None:
    """A node's last rank cuts only a light document to fill its tokens: the documents
    whose rows cross the node boundary are short (here one of 875 tokens), not the dense
    ones (2778 tokens went from rank 7 to 9 before the rule)."""
    lengths = [289, 1642, 2550, 216, 651, 635, 179, 1780, 853, 1907, 1871, 1169, 419, 1274,
               879, 2778, 875, 466, 1241, 734, 2134, 281, 415, 937, 2724, 1428, 656, 2929,
               882, 1804, 4579, 2941, 2787, 2001, 711, 1873, 4228, 258, 359, 793, 1749, 749,
               5910]
    placement = place_documents(cumulative(lengths), 16, gpus_per_node=8)
    check_invariants(placement, lengths)
    crossing = [lengths[d] for d in range(len(lengths))
                if placement.spans(d)[0] < 8 <= placement.spans(d)[-1]]
    assert crossing and max(crossing) <= 1024, placement.summary()
    assert busiest_over_mean(placement) <= 1.10, placement.summary()


def test_the_longest_takes_the_whole_group() -> None:
    lengths = [S - 1024] + [128] * 8
    placement = place_documents(cumulative(lengths), 8, gpus_per_node=4)
    assert placement.spans(0) == tuple(range(8))


@pytest.mark.parametrize("bad, match", [
    (torch.tensor([0, 8, 16], dtype=torch.int64), "int32"),
    ([0, 8.0, 16], "8.0"),
    ([0, "8", 16], "'8'"),
    ([4, 8, 16], r"\[4, 8, 16\]"),
    ([0, 8, 8, 16], "strictly increasing"),
    ([0, 9, 7, 16], "strictly increasing"),
    ([0, 8, 18], "18 tokens"),
    ([0], "n \\+ 1 >= 2"),
    ("0,16", "str"),
    (torch.tensor([0, 8, 16], dtype=torch.int32, device="meta"), "meta device"),
])
def test_bad_cu_seqlens_raise(bad, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        place_documents(bad, 4)


@pytest.mark.parametrize("kwargs, match", [
    ({"cp_size": 0}, "cp_size=0"),
    ({"cp_size": 3}, "multiple of 2 x cp_size = 6"),
    ({"cp_size": 2, "gpus_per_node": 0}, "gpus_per_node=0"),
])
def test_bad_sizes_raise(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        place_documents([0, 8, 16], **kwargs)


def test_zigzag_placement_rejects_bad_totals() -> None:
    with pytest.raises(ValueError, match="multiple of 2 x cp_size = 8"):
        zigzag_placement(20, 4)


@pytest.mark.parametrize("runs, match", [
    ((((0, 0, 4),), ((0, 2, 4),)), "held twice"),
    ((((0, 0, 4),), ((1, 0, 4),)), "positions 4..7 of its 8 are held by no rank"),
    ((((0, 0, 4),), ((1, 0, 4), (0, 6, 2))), "position 4 is held by no rank"),
    ((((0, 0, 8), (1, 0, 2)), ((1, 2, 2),)), "ranks hold \\[10, 2\\] tokens"),
    ((((0, 0, 9),), ((1, 0, 4),)), "inside document 0 of 8 tokens"),
    ((((2, 0, 4),), ((1, 0, 4),)), "document 2"),
    ((((0, 0, 4),),), "one tuple of runs per CP rank"),
])
def test_from_runs_rejects_what_is_not_a_placement(runs, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DocumentPlacement.from_runs(2, (8, 4), runs)


def test_random_small_mixes_hold_invariants() -> None:
    """Any lengths (1-token documents, lengths beside or beyond a rank's tokens), any CP size
    (odd ones too) and node size."""
    rng = random.Random(3)
    for _ in range(150):
        cp_size = rng.choice([1, 2, 3, 5, 6, 8, 12, 16, 64])
        lengths = [rng.choice([1, 2, 3, 17, 64, 100, 333, 1000, 4000]) for _ in range(rng.randint(1, 40))]
        lengths[-1] += -sum(lengths) % (2 * cp_size)
        placement = place_documents(cumulative(lengths), cp_size,
                                    gpus_per_node=rng.choice([None, 1, 2, 3, 4, 100]))
        check_invariants(placement, lengths)


def test_direct_construction_fills_in_the_groups() -> None:
    placement = DocumentPlacement(2, (8, 4), (((1, 0, 2), (0, 4, 4)), ((0, 0, 4), (1, 2, 2))))
    assert placement.spans(0) == (0, 1) and placement.spans(1) == (0, 1)


def test_from_runs_keeps_the_local_order() -> None:
    runs = (((1, 0, 2), (0, 4, 4)), ((0, 0, 4), (1, 2, 2)))
    placement = DocumentPlacement.from_runs(2, (8, 4), runs)
    assert placement.runs == runs and placement.spans(0) == (0, 1)
    assert placement.token_indices(0).tolist() == [8, 9, 4, 5, 6, 7]
    assert placement.local_runs_by_document(0) == [[(2, 4, 4)], [(0, 0, 2)]]
    other = DocumentPlacement.from_runs(2, (8, 4), (runs[0][::-1], runs[1]))
    assert other != placement and other.key() != placement.key()


@pytest.mark.parametrize("mix", ["lognormal2", "one_token_and_long"])
def test_permute_and_merge_round_trip(mix: str) -> None:
    lengths = MIXES[mix]
    placement = place_documents(cumulative(lengths), 8)
    whole = torch.randn(sum(lengths), 3)
    shares = [placement.permute(whole, r) for r in range(8)]
    assert all(s.shape == (placement.local_tokens, 3) for s in shares)
    assert torch.equal(placement.merge(shares), whole)
    columns = [placement.permute(whole.t(), r, dim=1) for r in range(8)]
    assert torch.equal(placement.merge(columns, dim=1), whole.t())
    assert torch.equal(shares[5], whole[placement.token_indices(5)])


def test_local_runs_by_document_agree_with_token_indices() -> None:
    lengths = MIXES["lognormal4"]
    placement = place_documents(cumulative(lengths), 16)
    cu = cumulative(lengths)
    for rank in range(16):
        indices = placement.token_indices(rank)
        by_doc = placement.local_runs_by_document(rank)
        assert len(by_doc) == len(lengths)
        rows = 0
        for doc, runs in enumerate(by_doc):
            assert bool(runs) == (rank in placement.spans(doc))
            for row, first, n in runs:
                assert torch.equal(indices[row:row + n], torch.arange(n) + cu[doc] + first)
                rows += n
        assert rows == placement.local_tokens


def test_crossing_tokens_and_summary() -> None:
    lengths = MIXES["lognormal6"]
    placement = place_documents(cumulative(lengths), 8)
    owners = [set() for _ in lengths]
    doc_of = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    for rank in range(8):
        for doc in doc_of[placement.token_indices(rank)].unique().tolist():
            owners[doc].add(rank)
    crossing = sum(n for n, o in zip(lengths, owners) if len(o) > 1)
    assert placement.crossing_tokens() == crossing > 0
    assert [set(placement.spans(d)) for d in range(len(lengths))] == owners
    text = placement.summary()
    assert "busiest/mean" in text and f"crossing tokens {crossing}" in text


def test_placed_seq_params_checks_cu_seqlens_on_the_host(monkeypatch) -> None:
    """Building PlacedSeqParams from placed_seq_params copies no tensor back to the host."""
    from megatron_mesh.masks.document_placer import place_documents
    from megatron_mesh.megatron.placed_documents import placed_seq_params

    placement = place_documents([0, 5, 8, 16], 2)

    def no_copy(self):
        raise AssertionError("cu_seqlens copied to the host")

    monkeypatch.setattr(torch.Tensor, "tolist", no_copy)
    params = placed_seq_params(placement, 1)
    assert params.placement is placement


def test_placed_rope_reads_cu_seqlens_without_binding(monkeypatch) -> None:
    """An unplaced RoPE call goes straight to megatron-core's (no signature binding); a
    placed cu_seqlens is found by keyword or in its positional slot."""
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_mesh.megatron import rope

    calls = []

    def fake(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None):
        calls.append((t.shape, freqs.shape, cu_seqlens))
        return t

    monkeypatch.setattr(rope_utils, "apply_rotary_pos_emb", fake)
    t, freqs, plain = torch.zeros(3, 2, 4), torch.zeros(8, 1, 1, 4), torch.tensor([0, 3])
    with monkeypatch.context() as m:
        m.setattr(rope, "_signature", lambda f: (_ for _ in ()).throw(AssertionError("bound")))
        rope.placed_apply_rotary_pos_emb(t, freqs, None, cu_seqlens=plain)
        rope.placed_apply_rotary_pos_emb(t, freqs, None, plain)
    assert [c[2] is plain for c in calls] == [True, True]
    placed = torch.tensor([0, 3])
    setattr(placed, rope.POSITIONS, torch.tensor([0, 1, 2]))
    for call in ((None, placed), (None,)):
        kwargs = {} if len(call) == 2 else {"cu_seqlens": placed}
        assert rope.placed_apply_rotary_pos_emb(t, freqs, *call, **kwargs).shape == t.shape
        assert calls[-1] == (torch.Size([3, 1, 2, 4]), torch.Size([3, 1, 1, 4]), None)


@pytest.mark.parametrize("layout", ["balanced", "te"])
def test_packer_takes_host_lengths_and_reads_no_device_tokens(layout: str) -> None:
    """The driver reads a micro-batch's document lengths on the host before the batch goes
    to the device: the packer given them never reads the device tokens (here on meta,
    where reading them fails, as on a GPU it would wait for the device), and packs as it
    does from the tokens."""
    from megatron_mesh.training.data.document_ranks import DocumentPacker
    from megatron_mesh.training.data.packing import document_lengths

    packer = DocumentPacker(layout, 2, 1, 1, None)
    tokens = torch.tensor([[1, 2, 0, 3, 4, 5, 0, 6], [7, 0, 8, 9, 9, 9, 9, 0]])
    batch = {"tokens": tokens, "labels": tokens + 1, "position_ids": tokens * 0}
    lengths = document_lengths(tokens, 0)
    assert lengths == [3, 4, 1, 2, 6]  # from the definition: a document ends after EOD 0
    from_tokens, from_host = packer(batch, 0), packer(batch, 0, lengths)
    for key in ("tokens", "labels", "position_ids"):
        assert torch.equal(from_tokens[key], from_host[key]), key
    meta = {k: v.to("meta") for k, v in batch.items()}
    assert packer(meta, 0, lengths)["tokens"].shape == from_host["tokens"].shape
    with pytest.raises(NotImplementedError):  # without them it would read the tokens
        packer(meta, 0)
