"""The planner under sliding windows: compute counts the pairs a window keeps, the mesh's
bytes are those of the sparse exchange (closed form equal to `cost_models.sparse.window_traffic`),
Transformer Engine's rings are not available, a model of mixed layers is the weighted sum
of its layer kinds, and bad window flags exit 2 naming the value."""
from __future__ import annotations

import json

import pytest
import torch

from megatron_mesh.calls.layout import AttentionMask
from megatron_mesh.calls.needed_rows import needed_rows
from megatron_mesh.cli import main
from megatron_mesh.cost_models.plan import resolve_plan
from megatron_mesh.cost_models.sparse import window_traffic
from megatron_mesh.layer_plan import AttentionShape, grid_shapes, heads_shape
from megatron_mesh.masks.window import Window, window_of
from megatron_mesh.planner import Cluster, Workload, plan, search
from megatron_mesh.planner.pricing.layers import LayerMix, model_plan
from megatron_mesh.planner.pricing.windows import kept_pairs, sparse_traffic
from megatron_mesh.planner.reports.model_report import format_model, verdict_line

MODEL = dict(seq_length=65536, num_heads=32, num_kv_heads=8, head_dim=128)
CLI = ["plan", "--gpus", "16", "--seq-length", "65536", "--num-heads", "32",
       "--num-kv-heads", "8", "--head-dim", "128"]


def brute_pairs(s: int, left: int, right: int, causal: bool) -> int:
    i = torch.arange(s)
    delta = i[None, :] - i[:, None]  # key - query
    seen = torch.ones(s, s, dtype=torch.bool)
    if left >= 0:
        seen &= delta >= -left
    right = 0 if causal else right
    if right >= 0:
        seen &= delta <= right
    return int(seen.sum())


@pytest.mark.parametrize("s", [1, 7, 64])
@pytest.mark.parametrize("window, causal", [
    ((0, 0), True), ((1, 0), True), ((5, -1), True), ((63, 0), True), ((500, 0), True),
    ((3, 2), False), ((-1, 4), False), ((6, -1), False), ((0, 100), False),
])
def test_kept_pairs_count_what_the_window_keeps(s, window, causal) -> None:
    assert kept_pairs(s, window_of(window, causal), causal) == brute_pairs(s, *window, causal)


def test_window_flops_are_the_kept_pairs() -> None:
    s, left = MODEL["seq_length"], 4096
    p = plan(16, **MODEL, window=(left, 0))
    pairs = s + left * (left + 1) // 2 + (s - 1 - left) * left  # sum_i (min(i, L) + 1)
    flops = 4 * pairs * MODEL["num_heads"] * MODEL["head_dim"]
    for e in p.estimates:
        assert e.compute_s["forward"] == pytest.approx(flops / 16 / 400e12)
        assert e.compute_s["backward"] == pytest.approx(2.5 * flops / 16 / 400e12)
    assert p.workload.forward_flops() == pytest.approx(flops)


def small_cases() -> list[tuple]:
    out = []
    for p in (2, 4, 8):
        seq = 2 * p * 6  # sub-chunks of 6 tokens
        for causal, windows in ((True, [(1, 0), (3, 0), (6, 0), (7, 0), (20, 0), (seq + 2, 0)]),
                                (False, [(0, 2), (3, 3), (8, -1), (-1, 5), (13, 1)])):
            out += [(p, seq, w, causal) for w in windows]
    return out


@pytest.mark.parametrize("p, seq, window, causal", small_cases())
def test_closed_form_bytes_equal_window_traffic(p, seq, window, causal) -> None:
    for hkv, e, dq, dkv in ((4, 2, 4, 2), (2, 4, 4, 4), (1, 2, 2, 2)):
        shape = AttentionShape(seq, 2, 4, hkv, 8, e)
        for a, r, c in grid_shapes(p):
            if a > 4:
                continue
            ref = window_traffic(shape, a, r, c, window, causal, None, dq, dkv)
            got = sparse_traffic(shape, a, r, c, window_of(window, causal), causal, dq, dkv)
            fields = ("forward_row", "forward_col", "backward_row", "backward_col",
                      "forward_heads", "backward_heads")
            assert [getattr(got, f) for f in fields] == [getattr(ref, f) for f in fields], (
                (a, r, c), hkv, ref, got)


def exchange_maxima(shape: AttentionShape, heads: int, rows: int, cols: int, window, dq: int,
                    dkv: int) -> list[int]:
    """Per exchange of `windows.PARTS`, the most bytes any mesh rank sends in it, counted
    with the algorithm's own `calls.needed_rows` (the terms of `window_traffic`)."""
    inner = heads_shape(shape, heads) if heads > 1 else shape
    mesh = rows * cols
    local = inner.seq_len // mesh
    mask = AttentionMask(True, None, mesh, window_of(window, True))
    n = lambda a, o, side: len(needed_rows(mask, rows, cols, local, a, o, side))  # noqa: E731
    e, b, hq = inner.dtype_bytes, inner.batch, inner.q_heads
    q, o, lse = b * hq * inner.head_dim, b * hq * inner.dv, b * hq * 4
    kv = b * inner.kv_heads * (inner.head_dim + inner.dv)
    out = [0] * 7
    for m in range(mesh):
        i, j = divmod(m, cols)
        row = [i * cols + c for c in range(cols) if i * cols + c != m]
        col = [r * cols + j for r in range(rows) if r * cols + j != m]
        parts = [sum(n(x, m, "q") for x in row) * q * e,
                 sum(n(m, x, "q") for x in row) * (o * e + lse),
                 sum(n(y, m, "kv") for y in col) * kv * e,
                 sum(n(x, m, "q") for x in row) * ((q + o) * e + 2 * lse),
                 sum(n(m, x, "q") for x in row) * q * dq,
                 sum(n(y, m, "kv") for y in col) * kv * e,
                 sum(n(m, y, "kv") for y in col) * kv * dkv]
        out = [max(a, b) for a, b in zip(out, parts)]
    return out


@pytest.mark.parametrize("p", [4, 8])
def test_planned_mesh_bytes_are_each_exchanges_busiest_sender(p) -> None:
    """On one node (every byte at the same rate) each exchange is priced at the rank that
    sends most in it; the a2a of a heads grid is `window_traffic`'s."""
    seq, window = 2 * p * 64, (40, 0)
    kw = dict(seq_length=seq, num_heads=8, num_kv_heads=2, head_dim=16)
    planned = plan(p, **kw, gpus_per_node=p, window=window)
    shape = AttentionShape(seq, 1, 8, 2, 16, 2)
    for est in (*planned.meshes, *planned.grids):
        a, r, c = est.grid_shape
        mp = resolve_plan(shape, r, c, "streamed", heads=a)
        got = [t.nbytes for t in est.transfers if t.group != "a2a"]
        assert got == exchange_maxima(shape, a, r, c, window, mp.dq_bytes(2),
                                      mp.dkv_bytes(2)), est.label
        ref = window_traffic(shape, a, r, c, window, True, None, mp.dq_bytes(2), mp.dkv_bytes(2))
        assert est.bytes("forward", "a2a") == ref.forward_heads, est.label
        assert not any(t.hidden for t in est.transfers)  # the sparse exchange hides nothing


def test_te_methods_under_a_window() -> None:
    dense, windowed = plan(16, **MODEL), plan(16, **MODEL, window=(2048, 0))
    assert windowed.ring is None and windowed.method("a2a+p2p") is None
    reasons = {u.method: u.reason for u in windowed.unavailable}
    for name in ("ring", "a2a+p2p"):
        assert "refuses sliding windows" in reasons[name] and "all_gather or a2a" in reasons[name]
    assert windowed.reference is windowed.method("all_gather")
    ag = windowed.method("all_gather")
    assert ag.total_bytes == dense.method("all_gather").total_bytes  # TE gathers every chunk
    assert windowed.speedup(ag) == 1.0
    heads = dict(MODEL, num_kv_heads=16)  # a2a over 16 GPUs
    a2a_dense = plan(16, **heads).method("a2a")
    a2a_window = plan(16, **heads, window=(2048, 0)).method("a2a")
    assert a2a_window.total_bytes == a2a_dense.total_bytes
    assert a2a_window.compute_s["forward"] < a2a_dense.compute_s["forward"]


def test_sparse_bytes_split_by_node() -> None:
    """P x 1 over two nodes of 4: a rank at the node boundary sends one neighbour's rows
    over the NIC and the other's over NVLink at the same time."""
    p = plan(8, seq_length=8 * 2 * 1024, num_heads=8, num_kv_heads=8, head_dim=64,
             gpus_per_node=4, window=(256, 0)).mesh(8, 1)
    kv = [t for t in p.transfers if t.phase == "forward" and t.group == "column"][0]
    kv_row = 8 * 2 * 64 * 2  # K and V rows of 8 heads in bf16
    assert kv.nbytes == 2 * 256 * kv_row  # 256 rows to each zigzag neighbour
    assert kv.off_node_share == 0.5 and p.inter_node_bytes > 0
    cluster = Cluster(gpus=8, gpus_per_node=4)
    assert kv.seconds(cluster) == pytest.approx(kv.nbytes / 2 / (45 * 1e9))


def test_layer_mix_follows_megatron_core() -> None:
    mix = LayerMix(10, 4)
    assert (mix.windowed, mix.full) == (8, 2)
    assert [n for n in range(1, 11) if not mix.is_windowed(n)] == [4, 8]
    assert LayerMix(6).full == 0 and LayerMix(6).windowed == 6
    utils = pytest.importorskip("megatron.core.transformer.utils")
    for n in range(1, 11):
        assert mix.is_windowed(n) == utils.is_layer_window_attention((128, 0), 4, n)


def test_model_is_the_weighted_sum_of_its_layer_kinds() -> None:
    windowed, full = plan(16, **MODEL, window=(4096, 0)), plan(16, **MODEL)
    mp = model_plan(windowed, full, LayerMix(12, 3))  # 8 windowed, 4 global
    ag = 8 * windowed.method("all_gather").total_s + 4 * full.method("all_gather").total_s
    assert mp.method_s("all_gather") == pytest.approx(ag)
    assert mp.method_s("ring") is None and mp.method_s("a2a+p2p") is None
    te = (8 * windowed.method("all_gather").total_s
          + 4 * min(e.total_s for e in (full.ring, *full.baselines)))
    assert mp.te_best_s() == pytest.approx(te)
    grids = [e.grid_shape for e in (*windowed.meshes, *windowed.grids)]
    for g in grids:
        w = next(e for e in (*windowed.meshes, *windowed.grids) if e.grid_shape == g)
        f = next(e for e in (*full.meshes, *full.grids) if e.grid_shape == g)
        assert mp.grid_s(g) == pytest.approx(8 * w.total_s + 4 * f.total_s)
    assert mp.grid_s(mp.best_grid) == min(mp.grid_s(g) for g in grids)
    kinds = [(v.kind, v.layers, v.best.label) for v in mp.verdicts()]
    assert kinds == [("windowed", 8, windowed.best.label), ("global", 4, full.best.label)]
    line = verdict_line(mp)
    assert line.startswith("verdict (MODEL): windowed layers: fastest ")
    assert "global layers: fastest " in line and "whole model: " in line
    assert "whole model (MODEL): 12 layers = 8 windowed" in format_model(mp)


def test_a_window_is_checked_once_in_the_workload() -> None:
    with pytest.raises(ValueError, match="right must be 0 or -1"):
        Workload(**MODEL, window=window_of((4, 2), False), causal=True)
    with pytest.raises(ValueError, match="not a checked window"):
        Workload(**MODEL, window=Window(-1, 0), causal=True)  # limits nothing
    w = Workload(**MODEL, window=window_of((4, -1), True))
    assert (w.window.left, w.window.right) == (4, 0)
    assert search(w, Cluster(gpus=4)).ring is None


def test_cli_prints_both_layer_kinds_and_the_model(capsys) -> None:
    assert main([*CLI, "--window-size", "4096", "--window-attn-skip-freq", "4",
                 "--num-layers", "8"]) == 0
    out = capsys.readouterr().out
    for text in ("windowed layers (6 of 8):", "global layers (2 of 8): full attention",
                 "sliding window (4096, 0)", "vs all_gather", "ring: not applicable: "
                 "Transformer Engine's p2p ring refuses sliding windows", "verdict (MODEL): ",
                 "whole model (MODEL): 8 layers = 6 windowed, window (4096, 0) + 2 global"):
        assert text in out, text
    assert main([*CLI, "--window-size", "4096", "--window-attn-skip-freq", "4",
                 "--num-layers", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["layers"] == {"num_layers": 8, "window_attn_skip_freq": 4, "windowed": 6,
                              "global": 2}
    assert data["windowed"]["workload"]["window"] == [4096, 0]
    assert data["windowed"]["reference"] == "all_gather" and data["global"]["reference"] == "ring"
    row = next(r for r in data["model"] if r["method"] == "all_gather")
    per = row["seconds_per_layer"]
    assert row["model_s"] == pytest.approx(6 * per["windowed"] + 2 * per["global"])


@pytest.mark.parametrize("flags, words", [
    (["--window-size", "-2"], ["--window-size -2", ">= -1"]),
    (["--window-size", "1024,5"], ["--window-size 1024,5", "right must be 0 or -1"]),
    (["--window-size", "1.5"], ["'1.5'", "give L or L,R"]),
    (["--window-size", "a,b"], ["'a,b'", "integers >= -1"]),
    (["--window-size", "1,0,2"], ["'1,0,2'", "give L or L,R"]),
    (["--window-size", "-1"], ["--window-size -1 limits nothing"]),
    (["--no-causal", "--window-size=-1,-1"], ["limits nothing"]),
    (["--window-size", "64", "--window-attn-skip-freq", "0"], ["'0' is not a positive integer"]),
    (["--window-attn-skip-freq", "4"], ["--window-attn-skip-freq needs --window-size"]),
    (["--num-layers", "4"], ["--num-layers needs --window-size"]),
])
def test_bad_window_flags_exit_2_naming_them(flags, words, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([*CLI, *flags])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and all(w in err for w in words), err
