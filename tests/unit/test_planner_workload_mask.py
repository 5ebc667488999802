"""A `Workload` carries one mask (documents, a window, slices, composed): its compute is the
pairs the mask keeps, in closed form only where that equals the count from its slices, and
every method prices it; a window inside THD documents is priced, not refused, by the
planner and `megatron-mesh plan`, whose flags name the THD layout it priced."""
from __future__ import annotations

import shlex

import pytest

import megatron_mesh as mm
from megatron_mesh.cli import main
from megatron_mesh.layer_plan import AttentionShape
from megatron_mesh.masks.window import window_of
from megatron_mesh.planner import plan
from megatron_mesh.planner.hardware import Cluster
from megatron_mesh.planner.methods.sparse import mask_estimate
from megatron_mesh.planner.pricing.masked import block_pair_counts
from megatron_mesh.planner.pricing.workload import Workload

SHAPE = dict(seq_length=512, num_heads=4, num_kv_heads=2, head_dim=16)
DOCS = (37, 200, 16, 259)


def _workloads() -> dict[str, Workload]:
    win = window_of((24, 0), True)
    return {
        "THD documents": Workload(**SHAPE, doc_lengths=DOCS),
        "THD documents, not causal": Workload(**SHAPE, doc_lengths=DOCS, causal=False),
        "window": Workload(**SHAPE, window=win),
        "THD documents & window": Workload(**SHAPE, doc_lengths=DOCS, window=win),
        "two-sided window in documents": Workload(**SHAPE, doc_lengths=DOCS, causal=False,
                                                  window=window_of((9, 30), False)),
        "prefix-LM": Workload(**SHAPE, causal=False, slices=mm.prefix_lm_mask(512, 40)),
    }


@pytest.mark.parametrize("name", list(_workloads()))
def test_compute_is_the_pairs_of_the_masks_slices(name):
    """The closed forms (per document, a window's `kept_pairs`) equal the pairs of the
    mask's slices, and those of every block once THD pads the documents for P ranks."""
    w = _workloads()[name]
    pairs = w.mask.sequence_slices(w.seq_length).pairs
    assert w.pairs() == pairs
    assert w.forward_flops() == 4.0 * pairs * w.batch * w.num_heads * w.head_dim
    padded = w.mask_on(4)
    assert sum(block_pair_counts(padded, padded.documents.total if padded.documents
                                 else w.seq_length, 2, 2).values()) == pairs


def test_the_dense_mask_keeps_the_kernels_flop_count():
    w = Workload(**SHAPE)
    assert w.pairs() is None and w.forward_flops() == 4.0 * 512 * 512 * 4 * 16 / 2


def test_a_window_inside_documents_is_priced_from_its_slices():
    """Each mesh shape and grid is `mask_estimate` of the padded THD mask; the rings do not
    take the window; it costs less compute than the documents or the window alone."""
    kw = dict(SHAPE, gpus_per_node=4, doc_lengths=DOCS)
    both = plan(4, **kw, window=(24, 0))
    assert both.workload.doc_lengths == DOCS and both.workload.window == window_of((24, 0), True)
    assert both.ring is None and {u.method for u in both.unavailable} >= {"ring", "a2a+p2p"}
    mask = both.workload.mask_on(4)
    assert mask.documents.padded_lengths == (40, 200, 16, 264)
    for e in both.meshes + both.grids:
        r, c = e.mesh_shape
        assert e == mask_estimate(both.workload, both.cluster, mask, r, c, e.heads), e.label
    docs, win = plan(4, **kw), plan(4, **dict(SHAPE, gpus_per_node=4), window=(24, 0))
    gather = both.method("all_gather").compute_s["forward"]
    assert gather < docs.method("all_gather").compute_s["forward"]
    assert gather < win.method("all_gather").compute_s["forward"]


def test_a_mask_of_slices_is_priced_by_every_method_that_takes_it():
    slices = mm.prefix_lm_mask(512, 40)
    p = plan(4, **SHAPE, gpus_per_node=4, mask=slices)
    assert p.workload.slices == slices and not p.workload.causal
    assert p.ring is None and "slices" in {u.method: u.reason for u in p.unavailable}["ring"]
    w = p.workload
    assert p.method("all_gather").compute_s["forward"] == pytest.approx(
        p.cluster.attention_seconds("forward", w.forward_flops() / 4))
    for e in p.meshes:
        assert e == mask_estimate(w, p.cluster, w.mask, *e.mesh_shape), e.label


def test_from_shape_reads_one_mask():
    """`Workload.from_shape`: the documents, window and slices of one `Mask`; the same
    workload as the fields given one by one; a bad mask or dtype is named."""
    shape = AttentionShape(512, 1, 4, 2, 16, 2)
    cu = [0, *(sum(DOCS[:i + 1]) for i in range(len(DOCS)))]
    mask = mm.documents_mask(cu) & mm.sliding_window_mask(24)
    w = Workload.from_shape(shape, mask)
    assert w == Workload(**SHAPE, doc_lengths=DOCS, window=window_of((24, 0), True))
    assert Workload.from_shape(shape) == Workload(**SHAPE)
    assert Workload.from_shape(shape, doc_lengths=DOCS) == Workload(**SHAPE, doc_lengths=DOCS)
    with pytest.raises(ValueError, match="'fp8' is not one of"):
        Workload.from_shape(shape, dtype="fp8")
    with pytest.raises(ValueError, match=r"'fp32' has 4 bytes a value, the shape's "
                       r"dtype_bytes 2: name one of \['bf16', 'fp16'\]"):
        Workload.from_shape(shape, dtype="fp32")
    placement = mm.place_documents(cu, 4)
    with pytest.raises(ValueError, match="prices a placement of its own"):
        Workload.from_shape(shape, mm.documents_mask(placement))
    with pytest.raises(ValueError, match="cover 256 positions, but seq_length is 512"):
        Workload(**SHAPE, slices=mm.prefix_lm_mask(256, 4))
    odd = Workload(**SHAPE, doc_lengths=DOCS, slices=mm.prefix_lm_mask(512, 4))
    with pytest.raises(ValueError, match=r"lengths \[37, 259\] are not multiples of 2P = 8"):
        odd.mask_on(4)


def test_cli_plans_a_window_over_documents_with_the_flags_it_assumes(capsys):
    """--window-size with --doc-length: the THD layout and the placement priced, and the
    printed flags name the documents, their placement and the window, as the driver's
    parser reads them."""
    from megatron_mesh.training.config.arguments import build_parser

    assert main(["plan", "--gpus", "8", "--seq-length", "16384", "--num-heads", "8",
                 "--head-dim", "64", "--doc-length", "2048", "--window-size", "256"]) == 0
    out = capsys.readouterr().out
    assert "sliding window (256, 0): 23.52% of the causal in-document pairs" in out
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("driver flags"))
    flags = shlex.split(lines[at + 1])
    args = build_parser().parse_args(flags)
    assert args.reset_attention_mask and args.mesh_document_placement == "balanced", flags
    assert args.window_size == [256, 0], flags


def test_a_cluster_prices_the_same_from_plan_and_search():
    """`plan` is `search` of the workload `from_shape` builds."""
    from megatron_mesh.planner.search import search

    kw = dict(SHAPE, doc_lengths=DOCS, window=(24, 0))
    p = plan(4, **kw, gpus_per_node=4)
    assert search(p.workload, Cluster(4, 4)) == p


def test_one_tensor_parallel_ranks_shape_builds_the_clis_workload():
    """The CLI's workload is `from_shape` of one TP rank's heads over the whole sequence."""
    from megatron_mesh.planner.reports.flags import TensorParallel

    tp = TensorParallel(2, 8, 8, 8, 4)
    assert tp.attention_shape(1024, 3, 64, "fp32") == AttentionShape(1024, 3, 4, 2, 64, 4)


def test_a_window_inside_placed_documents_is_priced_from_its_slices():
    """The placement under a window: every grid is `mask_estimate` of the placed mask, the
    floor the busiest rank's pairs from its slices (`rank_pairs`), which equal the closed
    form `works` for causal documents alone."""
    from megatron_mesh.planner.pricing.placed_documents import placed_mask, price_placement, rank_pairs

    kw = dict(SHAPE, gpus_per_node=4, doc_lengths=DOCS)
    windowed = plan(4, **kw, window=(24, 0))
    placed = price_placement(windowed)
    mask = placed_mask(windowed.workload, placed.placement)
    assert mask.window == windowed.workload.window and mask.placement == placed.placement
    for e in placed.estimates:
        assert e == mask_estimate(windowed.workload, windowed.cluster, mask, *e.mesh_shape,
                                  e.heads), e.label
    pairs = rank_pairs(mask)
    assert sum(pairs) == windowed.workload.pairs()
    flops = max(pairs) * 4.0 * windowed.workload.num_heads * windowed.workload.head_dim
    assert placed.floor_s["forward"] == windowed.cluster.attention_seconds("forward", flops)
    plain = plan(4, **kw)
    assert list(placed.placement.works()) == rank_pairs(placed_mask(plain.workload,
                                                                    placed.placement))
    assert price_placement(plain).floor_s["forward"] > placed.floor_s["forward"]


def test_mesh_transfers_of_any_mask_are_those_of_its_slices():
    """`mesh_transfers` of a window inside documents or of slices: the sparse exchange of
    the mask's rows, as `mask_estimate` prices them."""
    from megatron_mesh.planner.methods import mesh_transfers

    for name in ("THD documents & window", "prefix-LM"):
        w = _workloads()[name]
        cluster = Cluster(4, 4)
        want = mask_estimate(w, cluster, w.mask_on(4), 2, 2).transfers
        assert tuple(mesh_transfers(w, cluster, 2, 2)) == want, name
