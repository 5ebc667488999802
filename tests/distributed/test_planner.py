"""The planner: mesh bytes against the formulas and against bytes measured on real gloo
collectives, the baselines' traffic, the time model, placement, shape choice, and the CLI."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import megatron_mesh as mm
from megatron_mesh.cost_models.traffic import mesh_traffic
from megatron_mesh.layer_plan import DEFAULT_GRAD_DTYPE, GradDtype, Schedule
from megatron_mesh.planner import (
    Cluster,
    NotApplicable,
    Workload,
    mesh_placement,
    plan,
)
from megatron_mesh.planner.methods import (
    a2a_p2p_transfers,
    a2a_sizes,
    a2a_transfers,
    all_gather_transfers,
    mesh_transfers,
    ring_transfers,
)
from megatron_mesh.planner.search import mesh_key

from dist_utils import run_distributed
from reference import count_sent_bytes

ROOT = Path(__file__).resolve().parents[2]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

SCHEDULES = tuple(str(s) for s in Schedule)  # all must move exactly the planned bytes


def total(transfers, phase=None) -> int:
    return sum(t.nbytes for t in transfers if phase in (None, t.phase))


# ---------------------------------------------------------------- mesh bytes: the contract


@pytest.mark.parametrize("gpus", [4, 6, 16, 64])
@pytest.mark.parametrize("heads,kv_heads,dtype", [(8, 8, "bf16"), (32, 8, "fp32"), (6, 1, "fp16")])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_mesh_bytes_are_traffic_mesh_traffic(gpus: int, heads: int, kv_heads: int, dtype: str,
                                             schedule: str):
    result = plan(gpus, seq_length=2 * gpus * 24, num_heads=heads, num_kv_heads=kv_heads,
                  head_dim=16, batch=3, dtype=dtype, gpus_per_node=4, mesh_schedule=schedule)
    assert [e.mesh_shape for e in result.meshes] == mm.mesh_shapes(gpus)
    shape = result.workload.attention_shape()
    for e in result.meshes:
        grads, eb = GradDtype(DEFAULT_GRAD_DTYPE), shape.dtype_bytes
        want = mesh_traffic(shape, *e.mesh_shape, grads.dq_bytes(eb),
                            Schedule(schedule).partial_out_bytes(eb), grads.dkv_bytes(eb))
        assert e.bytes("forward", "row") == want.forward_row
        assert e.bytes("forward", "column") == want.forward_col
        assert e.bytes("backward", "row") == want.backward_row
        assert e.bytes("backward", "column") == want.backward_col
        assert e.total_bytes == want.total


# Shapes and cases measured on real collectives; S = 4P keeps two rows per zigzag chunk.
MEASURED_SHAPES = {4: [(4, 1), (2, 2), (1, 4)], 6: [(6, 1), (3, 2), (2, 3)]}
MEASURED_CASES = [  # (batch, q heads, kv heads, head dim, dtype, causal, gradient exchange)
    (2, 4, 2, 16, "bf16", True, "fp32"),  # GQA
    (1, 4, 4, 8, "fp32", False, "fp32"),  # MHA
    (1, 6, 2, 8, "fp32", True, "fp32"),  # GQA, heads not a power of two
    (1, 4, 1, 8, "fp16", True, "mixed"),  # MQA, dK, dV in fp16, dQ in fp32
    (1, 4, 2, 8, "bf16", True, "input"),  # gradients in bf16: half the gradient bytes
]


def measure_worker(rank: int, world: int) -> list[dict]:
    """Forward + backward of mesh_attention for every shape and case; bytes this rank sent."""
    seq = 4 * world
    results = []
    for rows, cols in MEASURED_SHAPES[world]:
        grid = mm.MeshGrid.build(rows=rows, cols=cols)
        for idx, (b, hq, hkv, d, dtype, causal, grads) in enumerate(MEASURED_CASES):
            g = torch.Generator().manual_seed(100 * idx + rank)
            s = seq // world
            q, k, v = (torch.randn(s, b, h, d, generator=g).to(DTYPES[dtype]).requires_grad_()
                       for h in (hq, hkv, hkv))
            dout = torch.randn(s, b, hq, d, generator=g).to(DTYPES[dtype])
            for schedule in SCHEDULES:
                for t in (q, k, v):
                    t.grad = None
                with count_sent_bytes() as sent, mm.TrafficCounter() as counter:
                    mm.mesh_attention(q, k, v, grid, causal=causal, schedule=schedule,
                                      grad_reduce_dtype=grads).backward(dout)
                results.append({
                    "shape": (rows, cols),
                    "case": idx,
                    "schedule": schedule,
                    "sent": sent[0],
                    "counted": {(p, dr): counter.bytes(phase=p, direction=dr)
                                for p in ("forward", "backward") for dr in ("row", "column")},
                })
    return results


@pytest.mark.parametrize("world", sorted(MEASURED_SHAPES))
def test_planner_bytes_equal_bytes_measured_on_gloo(world: int):
    per_rank = run_distributed(measure_worker, world)
    checked = 0
    for rank, results in enumerate(per_rank):
        assert len(results) == len(MEASURED_SHAPES[world]) * len(MEASURED_CASES) * len(SCHEDULES)
        for r in results:
            b, hq, hkv, d, dtype, causal, grads = MEASURED_CASES[r["case"]]
            predicted = plan(world, seq_length=4 * world, num_heads=hq, num_kv_heads=hkv,
                             head_dim=d, batch=b, dtype=dtype, causal=causal,
                             gpus_per_node=2, mesh_grad_reduce_dtype=grads,
                             mesh_schedule=r["schedule"]).mesh(*r["shape"])
            where = f"rank {rank}, {r['shape']} {r['schedule']}, {MEASURED_CASES[r['case']]}"
            for (phase, direction), measured in r["counted"].items():
                group = "row" if direction == "row" else "column"
                assert measured == predicted.bytes(phase, group), (where, phase, direction)
            assert r["sent"] == predicted.total_bytes, where
            checked += 1
    assert checked == world * len(MEASURED_SHAPES[world]) * len(MEASURED_CASES) * len(SCHEDULES)


# ---------------------------------------------------------------- baselines


def gqa(seq: int = 4096, heads: int = 32, kv_heads: int = 8, dtype: str = "bf16") -> Workload:
    return Workload(seq_length=seq, num_heads=heads, num_kv_heads=kv_heads, head_dim=128,
                    batch=2, dtype=dtype)


def elements(workload: Workload, p: int) -> tuple[int, int]:
    s = workload.seq_length // p
    q = s * workload.batch * workload.num_heads * workload.head_dim
    kv = 2 * s * workload.batch * workload.num_kv_heads * workload.head_dim
    return q, kv


@pytest.mark.parametrize("p", [2, 8, 16, 64])
def test_ring_sends_three_times_p_minus_one_kv(p: int):
    w = gqa()
    _, kv = elements(w, p)
    t = ring_transfers(w, Cluster(gpus=p))
    assert total(t, "forward") == (p - 1) * kv * 2
    assert total(t, "backward") == 2 * (p - 1) * kv * 2
    assert total(t) == 3 * (p - 1) * kv * 2
    assert all(x.hidden for x in t)
    assert all(x.crosses_nodes == (p > 8) for x in t)


def test_all_gather_is_the_p_by_1_mesh_up_to_the_gradient_dtype():
    p = 16
    cluster = Cluster(gpus=p)
    w32 = gqa(dtype="fp32")
    mesh32 = mesh_transfers(w32, cluster, p, 1)
    ag32 = all_gather_transfers(w32, cluster)
    for phase in ("forward", "backward"):
        assert total(ag32, phase) == total(mesh32, phase)
    w16 = gqa(dtype="bf16")  # default exchange: dK, dV in bf16 as all_gather's, no dQ on P x 1
    assert total(mesh_transfers(w16, cluster, p, 1)) == total(all_gather_transfers(w16, cluster))
    w16_fp32 = replace(w16, mesh_grad_reduce_dtype="fp32")
    _, kv = elements(w16, p)
    gap = (total(mesh_transfers(w16_fp32, cluster, p, 1))
           - total(all_gather_transfers(w16_fp32, cluster)))
    assert gap == (p - 1) * kv * (4 - 2)  # dK,dV reduce-scattered in fp32 vs bf16
    assert not any(x.hidden for x in ag32)


def test_a2a_bytes_and_rejection_when_heads_do_not_divide():
    w = gqa(heads=32, kv_heads=8)
    q, kv = elements(w, 8)
    t = a2a_transfers(w, Cluster(gpus=8))
    assert total(t, "forward") == total(t, "backward") == (2 * q + kv) * 2 * 7 // 8
    with pytest.raises(NotApplicable, match=r"num_kv_heads \(8\).*16"):
        a2a_transfers(w, Cluster(gpus=16))
    with pytest.raises(NotApplicable, match=r"num_heads \(12\)"):
        a2a_transfers(Workload(seq_length=64, num_heads=12, num_kv_heads=12, head_dim=8),
                      Cluster(gpus=8))
    result = plan(16, seq_length=4096, num_heads=32, num_kv_heads=8, head_dim=128)
    assert result.method("a2a") is None
    assert [u.method for u in result.unavailable] == ["a2a"]
    assert "num_kv_heads (8)" in result.unavailable[0].reason


def test_a2a_p2p_is_a2a_inside_node_and_ring_across():
    p, node = 64, 8
    w = gqa(seq=8192, heads=32, kv_heads=8)
    q, kv = elements(w, p)
    assert a2a_sizes(w, p) == [2, 4, 8]
    t = a2a_p2p_transfers(w, Cluster(gpus=p, gpus_per_node=node), 8)
    a2a = [x for x in t if x.group == "a2a"]
    ring = [x for x in t if x.group == "ring"]
    assert total(a2a) == 2 * (2 * q + kv) * 2 * 7 // 8
    assert total(ring) == 3 * (p // 8 - 1) * kv * 2
    assert not any(x.crosses_nodes or x.hidden for x in a2a)
    assert all(x.crosses_nodes and x.hidden for x in ring)
    with pytest.raises(NotApplicable, match="1 < A < 64"):
        a2a_p2p_transfers(w, Cluster(gpus=p), 64)
    with pytest.raises(NotApplicable, match=r"num_kv_heads \(8\)"):
        a2a_p2p_transfers(w, Cluster(gpus=p), 16)


def test_an_all_to_all_across_nodes_sends_its_node_parts_over_nvlink_meanwhile():
    """Ulysses over 8 ranks on two nodes of 4: each rank sends 4 of its 7 parts off the
    node through its NIC while the other 3 cross NVLink; the pass takes the slower of the
    two, and only the 4/7 count as inter-node bytes."""
    w = gqa(seq=8192, heads=32, kv_heads=8)
    cluster = Cluster(gpus=8, gpus_per_node=4, intra_node_bw=360, inter_node_bw=45)
    fwd, bwd = a2a_transfers(w, cluster)
    assert fwd.crosses_nodes and fwd.off_node_share == pytest.approx(4 / 7)
    off, on = fwd.nbytes * 4 / 7, fwd.nbytes * 3 / 7
    nic, nvlink = cluster.bandwidth(True), cluster.bandwidth(False)
    assert fwd.seconds(cluster) == pytest.approx(max(off / nic, on / nvlink))
    assert fwd.seconds(cluster) < fwd.nbytes / nic
    result = plan(8, seq_length=w.seq_length, num_heads=w.num_heads,
                  num_kv_heads=w.num_kv_heads, head_dim=w.head_dim, batch=w.batch,
                  gpus_per_node=4)
    estimate = result.method("a2a")
    assert estimate.inter_node_bytes == round(fwd.nbytes * 4 / 7) + round(bwd.nbytes * 4 / 7)
    # the same all-to-all inside one node of 8: no NIC share, NVLink for all of it
    inside, _ = a2a_transfers(w, Cluster(gpus=8, gpus_per_node=8))
    assert not inside.crosses_nodes and inside.off_node_share == 0
    # and the heads corner of the grid search prices it the same way
    grid = next(e for e in result.grids if e.grid_shape == (8, 1, 1))
    assert grid.total_s == pytest.approx(estimate.total_s)


def test_mesh_cuts_traffic_like_the_design_formula():
    """MHA, P = 64, 8 x 8, all fp32: 5 (C-1) q + 3 (R-1) kv + lse terms vs 3 (P-1) kv."""
    w = Workload(seq_length=64 * 64, num_heads=16, num_kv_heads=16, head_dim=64, dtype="fp32")
    result = plan(64, seq_length=w.seq_length, num_heads=16, head_dim=64, dtype="fp32")
    q, kv = elements(w, 64)
    lse = (w.seq_length // 64) * w.num_heads
    assert result.mesh(8, 8).total_bytes == 4 * (5 * 7 * q + 3 * 7 * kv + 3 * 7 * lse)
    assert result.ring.total_bytes == 4 * 3 * 63 * kv
    assert 0.79 < 1 - result.mesh(8, 8).total_bytes / result.ring.total_bytes < 0.80


# ---------------------------------------------------------------- time model and placement


def test_flops_and_time_model_by_hand():
    w = Workload(seq_length=16384, num_heads=8, num_kv_heads=8, head_dim=128, causal=True)
    assert w.forward_flops() == 4 * 16384**2 * 8 * 128 / 2
    assert w.backward_flops() == 2.5 * w.forward_flops()
    assert Workload(seq_length=16384, num_heads=8, num_kv_heads=8, head_dim=128,
                    causal=False).forward_flops() == 2 * w.forward_flops()
    p, bw, tflops = 16, 10.0, 100.0
    kw = dict(seq_length=16384, num_heads=8, head_dim=128, gpus_per_node=8,
              inter_node_bw=bw, attention_tflops=tflops)
    over, serial = plan(p, **kw), plan(p, overlap=False, **kw)
    compute_f = w.forward_flops() / p / (tflops * 1e12)
    comm_f = over.ring.bytes("forward") / (bw * 1e9)  # 16 GPUs on 2 nodes: the ring crosses
    # a ring of 16: the first block's compute, then 15 steps of max(block, hop)
    assert over.ring.time_s["forward"] == pytest.approx(
        compute_f / p + (p - 1) * max(compute_f / p, comm_f / (p - 1)))
    comm_b = over.ring.bytes("backward") / (bw * 1e9)  # K,V and dK,dV; the last dK,dV hop after
    compute_b = 2.5 * compute_f
    assert over.ring.time_s["backward"] == pytest.approx(
        compute_b / p + (p - 1) * max(compute_b / p, comm_b / (p - 1)) + comm_b / 2 / (p - 1))
    assert serial.ring.time_s["forward"] == pytest.approx(compute_f + comm_f)
    ag = over.method("all_gather")  # exposed even with overlap
    assert ag.time_s["forward"] == pytest.approx(compute_f + ag.bytes("forward") / (bw * 1e9))
    m = over.mesh(4, 4)  # rows of 4 inside a node (exposed), columns across nodes (ring)
    row_s = m.bytes("forward", "row") / (over.cluster.intra_node_bw * 1e9)
    col_s = m.bytes("forward", "column") / (bw * 1e9)
    # a column ring of 4 (streamed_kv), K,V only in the forward: nothing trails
    assert m.time_s["forward"] == pytest.approx(
        row_s + compute_f / 4 + 3 * max(compute_f / 4, col_s / 3))
    assert [t.hidden for t in m.transfers if t.group == "row"] == [False] * 4
    assert [t.hidden for t in m.transfers if t.group == "column"] == [True] * 3
    assert [t.trailing for t in m.transfers if t.group == "column"] == [False, False, True]
    assert over.speedup(m) == pytest.approx(over.ring.total_s / m.total_s)


def test_one_node_is_all_intra_node():
    result = plan(8, seq_length=8192, num_heads=8, head_dim=64, gpus_per_node=8)
    assert all(not t.crosses_nodes for e in result.estimates for t in e.transfers)
    assert all(e.inter_node_bytes == 0 for e in result.estimates)


@pytest.mark.parametrize("rows,cols,row_nodes,col_nodes", [
    (8, 8, 1, 8), (16, 4, 1, 8), (4, 16, 2, 4), (64, 1, 1, 8), (1, 64, 8, 1),
])
def test_placement_of_rows_and_columns(rows: int, cols: int, row_nodes: int, col_nodes: int):
    pl = mesh_placement(rows, cols, Cluster(gpus=64, gpus_per_node=8))
    assert (pl.row_nodes, pl.col_nodes) == (row_nodes, col_nodes)
    assert pl.rows_inside_node == (row_nodes == 1)
    assert ("rows: " in pl.describe()) and (f"span {col_nodes} nodes" in pl.describe()
                                            or col_nodes == 1)


def test_partial_node_rows_count_as_crossing():
    """Rows of 3 on nodes of 4: some rows straddle two nodes, so rows run at inter-node speed."""
    pl = mesh_placement(4, 3, Cluster(gpus=12, gpus_per_node=4))
    assert pl.row_nodes == 2 and pl.col_nodes == 3


# ---------------------------------------------------------------- choosing the shape


def test_best_mesh_is_the_fastest_and_ties_go_to_less_communication():
    result = plan(64, seq_length=131072, num_heads=32, num_kv_heads=8, head_dim=128)
    assert result.best_mesh.total_s == min(e.total_s for e in result.meshes)
    assert result.best_mesh.mesh_shape == (32, 2)  # rows of 2 on NVLink, K/V ring hidden
    assert result.placement.rows_inside_node and not result.placement.cols_inside_node
    assert result.best.label == "a2a+p2p (4x16)"
    a, b = result.mesh(16, 4), result.mesh(8, 8)
    assert b.total_comm_s < a.total_comm_s
    tied = replace(a, time_s=dict(b.time_s))  # same time: less communication wins
    assert min([tied, b], key=mesh_key) is b
    taller = replace(b, mesh_shape=(16, 4))  # all else equal: more rows wins
    assert min([b, taller], key=mesh_key) is taller


def test_mesh_beats_ring_when_the_network_is_the_bottleneck():
    result = plan(64, seq_length=65536, num_heads=16, head_dim=128, inter_node_bw=12.5)
    assert result.speedup(result.best_mesh) > 2.0
    assert result.best is not result.ring


def test_gqa_prefers_taller_tiles():
    """Fast compute, one node: time is traffic / bandwidth, and GQA makes K/V cheap to move."""
    kw = dict(seq_length=65536, head_dim=128, gpus_per_node=16, attention_tflops=1e6)
    assert plan(16, num_heads=32, num_kv_heads=32, **kw).best_mesh.mesh_shape == (4, 4)
    # dK, dV in bf16 (the default exchange) and 4 K/V heads: the tallest grid, no dQ traffic
    assert plan(16, num_heads=32, num_kv_heads=4, **kw).best_mesh.mesh_shape == (16, 1)


def test_best_mesh_is_one_of_the_shapes_and_the_mesh_plans():
    kw = dict(num_heads=64, num_kv_heads=8, head_dim=128, seq_length=262144)
    for cp in (1, 2, 8, 32, 256):
        result = plan(cp, **kw)
        assert result.best_mesh.mesh_shape in mm.mesh_shapes(cp)
        assert result.best_mesh.mesh_shape == result.mesh_plan.shape
    assert plan(1, **kw).best_mesh.mesh_shape == (1, 1)


@pytest.mark.parametrize("kwargs,match", [
    (dict(seq_length=1000), r"seq_length 1000 .* 2 \* GPUs = 16"),
    (dict(num_kv_heads=5), "num_heads 8 must be a multiple of num_kv_heads 5"),
    (dict(dtype="fp8"), "dtype 'fp8' is not one of"),
    (dict(head_dim=None, hidden_size=100), "hidden_size 100 is not divisible by num_heads 8"),
    (dict(head_dim=None), "give head_dim, or hidden_size"),
    (dict(inter_node_bw=0), "inter_node_bw must be a positive number, got 0"),
    (dict(gpus_per_node=0), "gpus_per_node must be a positive integer, got 0"),
    (dict(batch=0), "batch must be a positive integer, got 0"),
    (dict(mesh_schedule="ring"), "mesh_schedule='ring' is not one of streamed, streamed_kv"),
])
def test_bad_input_names_the_value(kwargs: dict, match: str):
    args = dict(seq_length=1024, num_heads=8, head_dim=64) | kwargs
    with pytest.raises(ValueError, match=match):
        plan(8, **args)


@pytest.mark.parametrize("schedule,rows,cols,hidden", [
    ("streamed_kv", 4, 4, {"column"}),
    ("streamed_q", 4, 4, {"row"}),
    ("gathered", 4, 4, set()),
    ("streamed", 16, 1, {"column"}),  # one column: only the K/V ring exists
    ("streamed", 1, 16, {"row"}),
])
def test_the_schedules_ring_is_the_hidden_traffic(schedule: str, rows: int, cols: int,
                                                  hidden: set[str]):
    workload = Workload(65536, 32, 8, 128, mesh_schedule=schedule)
    cluster = Cluster(gpus=16, gpus_per_node=8)
    transfers = mesh_transfers(workload, cluster, rows, cols)
    assert {t.group for t in transfers if t.hidden and t.nbytes} == hidden


def test_unknown_mesh_shape_lists_the_valid_ones():
    with pytest.raises(ValueError, match="3x3 is not a grid of 8 GPUs; valid: 8x1, 4x2, 2x4, 1x8"):
        plan(8, seq_length=1024, num_heads=8, head_dim=64).mesh(3, 3)


# ---------------------------------------------------------------- command line

PLAN_ARGS = ["plan", "--gpus", "64", "--seq-length", "131072", "--hidden-size", "4096",
             "--num-heads", "32", "--num-kv-heads", "8"]


def run_cli(*args: str, code: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-c", code, *args] if code else [
        sys.executable, "-m", "megatron_mesh.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)


def test_cli_plan_table_end_to_end():
    done = run_cli(*PLAN_ARGS)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "best mesh: 32 x 2 (rows x cols)" in out
    assert "rows: 2 consecutive CP ranks" in out and "stay inside a node" in out
    assert "columns: 32 CP ranks 2 apart" in out and "span 8 nodes" in out
    assert "fastest overall: a2a+p2p (4x16)" in out
    for label in ["ring (p2p)", "all_gather", "a2a+p2p (4x16)", "mesh 64x1", "mesh 32x2 *",
                  "mesh 8x8", "mesh 1x64"]:
        assert f"\n{label} " in out, label
    assert "a2a: not applicable: a2a over 64 GPUs needs num_heads (32) and num_kv_heads (8)" in out
    ring_line = next(line for line in out.splitlines() if line.startswith("ring (p2p)"))
    assert ring_line.split()[2:5] == ["504.0", "1008.0", "1512.0"]  # MiB fwd, bwd, total
    assert ring_line.endswith("1.00x")


def test_cli_json_matches_the_python_api():
    done = run_cli(*PLAN_ARGS, "--json", "--dtype", "fp32", "--no-causal", "--batch", "2")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    api = plan(64, seq_length=131072, num_heads=32, num_kv_heads=8, head_dim=128,
               dtype="fp32", causal=False, batch=2)
    assert data["best_mesh"]["shape"] == list(api.best_mesh.mesh_shape)
    assert [e["label"] for e in data["estimates"]] == [e.label for e in api.estimates]
    for got, want in zip(data["estimates"], api.estimates):
        assert got["bytes"]["total"] == want.total_bytes
        assert got["time_s"]["total"] == pytest.approx(want.total_s)


def test_main_in_process_and_no_overlap(capsys):
    from megatron_mesh.cli import main

    assert main(PLAN_ARGS + ["--no-overlap"]) == 0
    assert "overlap off: compute + all transfers" in capsys.readouterr().out


@pytest.mark.parametrize("args,message", [
    (["--gpus", "0"], "argument --gpus: '0' is not an integer >= 2"),
    (["--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
    (["--seq-length", "1000"], "seq_length 1000 must be divisible by 2 * GPUs = 128"),
    (["--inter-node-bw", "-3"], "argument --inter-node-bw: '-3' is not a positive number"),
    (["--num-kv-heads", "5"], "num_heads 32 must be a multiple of num_kv_heads 5"),
    (["--gpus", "1"], "argument --gpus: '1' is not an integer >= 2"),
    (["--gpus-per-node", "3"], "--gpus-per-node 3 does not divide --gpus 64: give whole nodes "
                               "(e.g. --gpus 63 or 66)"),
    (["--seq-length", "1e400"], "argument --seq-length: '1e400' is not a positive integer"),
    (["--seq-length", "4294967296"], "'4294967296' is absurd: at most 2147483648"),
    (["--attention-tflops", "inf"], "argument --attention-tflops: 'inf' is not a positive"),
    (["--attention-tflops", "nan"], "argument --attention-tflops: 'nan' is not a positive"),
    (["--attention-tflops", "1e12"], "'1e12' is absurd: at most 100000"),
    (["--intra-node-bw", "inf"], "argument --intra-node-bw: 'inf' is not a positive number"),
    (["--plot", "no-such-folder/x.png"], "no-such-folder does not exist; create it"),
])
def test_cli_bad_values_are_named(args: list[str], message: str, capsys):
    from megatron_mesh.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(PLAN_ARGS + args)
    assert exit_.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""  # refused before any plan is printed
    assert message in err.splitlines()[-1] and "Traceback" not in err


def test_cli_bad_value_exits_2_from_the_shell():
    done = run_cli("plan", "--gpus", "8", "--seq-length", "1024", "--num-heads", "8")
    assert done.returncode == 2 and "give --head-dim or --hidden-size" in done.stderr


def test_cli_plot(tmp_path: Path):
    pytest.importorskip("matplotlib", reason="--plot needs the 'plot' extra (matplotlib)")
    png = tmp_path / "speedup.png"
    done = run_cli(*PLAN_ARGS, "--plot", str(png))
    assert done.returncode == 0, done.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_cli_plot_without_matplotlib_says_what_to_install(tmp_path: Path):
    code = ("import sys; sys.modules['matplotlib'] = None; "
            "from megatron_mesh.cli import main; sys.exit(main(sys.argv[1:]))")
    done = run_cli(*PLAN_ARGS, "--plot", str(tmp_path / "x.png"), code=code)
    assert done.returncode == 2
    assert "pip install 'megatron-mesh[plot]'" in done.stderr
    assert not (tmp_path / "x.png").exists()


def test_cli_plot_of_a_windowed_layer(tmp_path: Path):
    """--plot with --window-size draws the windowed layer against all_gather (ring refuses
    windows), with --window-attn-skip-freq beside the model's verdict."""
    pytest.importorskip("matplotlib", reason="--plot needs the 'plot' extra (matplotlib)")
    for extra in ([], ["--window-attn-skip-freq", "4", "--num-layers", "8"]):
        png = tmp_path / f"window{len(extra)}.png"
        done = run_cli(*PLAN_ARGS, "--window-size", "512", *extra, "--plot", str(png))
        assert done.returncode == 0, done.stderr
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
        assert "all_gather" in done.stdout


def test_plot_series_of_a_windowed_layer_are_over_all_gather():
    from megatron_mesh.planner.reports.plot import speedup_series

    plans = [plan(n, seq_length=131072, num_heads=32, num_kv_heads=8, head_dim=128,
                  window=(1024, 0)) for n in (8, 64)]
    series = speedup_series(plans)
    assert "all_gather" not in series  # the reference
    assert series["a2a+p2p"] == []  # refuses windows in Transformer Engine
    assert [n for n, _ in series["a2a"]] == [8]
    best = plans[1].method("all_gather").total_s / plans[1].best_mesh.total_s
    assert series["best 2D mesh"][1] == (64, pytest.approx(best))
    choice = plans[1].method("all_gather").total_s / plans[1].best_grid.total_s
    assert series["planner's choice"][1] == (64, pytest.approx(choice))


def test_plot_series_points():
    from megatron_mesh.planner.reports.plot import gpu_counts, speedup_series

    assert gpu_counts(64, 131072) == [2, 4, 8, 16, 32, 64]
    assert gpu_counts(24, 48) == [2, 4, 8, 24]
    assert gpu_counts(24, 40) == [2, 4]  # 40 is not divisible by 2 * 8 or 2 * 24
    plans = [plan(n, seq_length=131072, num_heads=32, num_kv_heads=8, head_dim=128)
             for n in (8, 64)]
    series = speedup_series(plans)
    assert [n for n, _ in series["a2a"]] == [8]  # 8 kv heads do not split over 64
    assert [n for n, _ in series["best 2D mesh"]] == [8, 64]
    assert series["best 2D mesh"][1][1] == pytest.approx(plans[1].speedup(plans[1].best_mesh))
    assert series["planner's choice"][1][1] == pytest.approx(plans[1].speedup(plans[1].best_grid))
