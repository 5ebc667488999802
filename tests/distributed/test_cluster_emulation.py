"""The emulated cluster: shaped links hold a transfer for at least bytes / rate of the link
it crosses (NIC across nodes, NVLink inside one), the emulated kernel sleeps for the
planner's compute time, and the cluster bench produces its rows on P = 4 as two nodes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_mesh.cost_models.sparse import window_traffic
from megatron_mesh.emulation import EmulatedKernel, Emulation, ShapedLinks
from megatron_mesh.masks.window import window_of
from megatron_mesh.planner import Cluster, Workload, search
from megatron_mesh.runtime import comm

from dist_utils import run_distributed

ROOT = Path(__file__).resolve().parents[2]
MODELLED = Cluster(gpus=4, gpus_per_node=2, intra_node_bw=360.0, inter_node_bw=45.0)
SLOWDOWN = 1500.0  # intra-node 240 MB/s, inter-node 30 MB/s
MB = 3_000_000  # bytes per transfer: 0.1 s through an emulated NIC, 12.5 ms over NVLink


def transfer_worker(rank: int, world: int) -> dict:
    emulation = Emulation(MODELLED, SLOWDOWN)
    t = torch.ones(MB // 4)
    times = {}
    # ranks 0, 1 on node 0 and 2, 3 on node 1: the ring 0 -> 1 -> 2 -> 3 -> 0 has two
    # inter-node hops (1 -> 2, 3 -> 0) and two inside nodes
    recv = torch.empty_like(t)
    dist.barrier()
    start = time.monotonic()
    with ShapedLinks(emulation, rank):
        comm.ring_exchange(t, recv, (rank + 1) % world, (rank - 1) % world, None, "forward",
                           "row").wait()
    times["ring"] = time.monotonic() - start
    assert torch.equal(recv, t)  # the real bytes moved
    gather_start = time.monotonic()
    with ShapedLinks(emulation, rank):
        comm.all_gather(torch.ones(MB // 4 // 3), None, "forward", "row")
    times["all_gather"] = time.monotonic() - gather_start
    return times


def test_shaped_links_hold_each_transfer_for_bytes_over_rate() -> None:
    emulation = Emulation(MODELLED, SLOWDOWN)
    per_rank = run_distributed(transfer_worker, 4)
    for rank, times in enumerate(per_rank):
        crosses = rank in (1, 3)  # sends to the other node
        rate = emulation.inter_node_rate if crosses else emulation.intra_node_rate
        assert times["ring"] >= MB / rate, (rank, times)
        if crosses:  # the NIC is 8x slower than NVLink, and far slower than loopback
            assert times["ring"] > 2 * MB / emulation.intra_node_rate, (rank, times)
        # an all-gather over both nodes runs as a ring at the NIC's rate: 3 pieces of MB / 3
        assert times["all_gather"] >= MB / emulation.inter_node_rate, (rank, times)


def test_emulated_kernel_sleeps_the_planner_compute_time() -> None:
    kernel = EmulatedKernel(flops_rate=4e11)  # a 400 TFLOP/s GPU played 1000x slower
    q, k = torch.zeros(512, 1, 32, 8), torch.zeros(512, 1, 8, 8)
    start = time.monotonic()
    out, lse = kernel.forward(q, k, k, True, 1.0)
    elapsed = time.monotonic() - start
    expected = 4 * 512 * 512 * 32 * 8 / 2 / 4e11  # causal: half the 4 sq sk hq d FLOPs
    assert elapsed >= expected and kernel.seconds == pytest.approx(expected)
    assert out.shape == q.shape and lse.shape == (1, 32, 512) and lse.dtype == torch.float32
    dq, dk, dv = kernel.backward(out, q, k, k, out, lse, True, 1.0)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, k.shape)
    assert kernel.seconds == pytest.approx(3.5 * expected)  # backward: 2.5x forward
    with pytest.raises(ValueError, match="flops_rate must be a positive number, got 0"):
        EmulatedKernel(0)


def _bench_cluster(folder: Path, kv_heads: int, *flags: str, timeout: int = 300
                   ) -> tuple[subprocess.CompletedProcess, dict]:
    """scripts/bench_cluster.py at P = 4, 1024 tokens, 8 heads (`kv_heads` K/V heads) of 4,
    one repeat, no warm-up, links slowed 2000x, with `flags`: the finished process (exit 0)
    and the JSON it wrote in `folder`."""
    out_json = folder / "rows.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1",  # this checkout's package, not an installed one
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_cluster.py"), "--cp-sizes", "4",
         "--seq-lengths", "1024", "--heads", "8", "--kv-heads", str(kv_heads), "--head-dim",
         "4", "--repeats", "1", "--warmup", "0", "--slowdown", "2000", *flags,
         "--json", str(out_json)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc, json.loads(out_json.read_text())


def test_bench_cluster_produces_its_rows(tmp_path: Path) -> None:
    proc, data = _bench_cluster(tmp_path, 2, "--floor")
    rows = data["rows"]
    methods = [r["method"] for r in rows]
    assert methods[:2] == ["ring", "all_gather"] and any(m.startswith("mesh 2x2") for m in methods)
    assert "a2a+p2p 2x2" in methods  # heads x rows x cols corners run too (a2a: 2 K/V heads < 4)
    assert {tuple(r["shape"]) for r in rows if r["method"] == "a2a+p2p 2x2"} == {(2, 2, 1)}
    for r in rows:
        # the emulated compute and links are part of the measured time
        assert r["median_s"] >= r["compute_s"] > 0, r
        assert r["median_s"] >= max(r["link_s"].values()) > 0, r
        assert r["predicted_s"] > 0 and r["memory"] > 0 and r["model_memory"] > 0, r
        assert r["floor_s"] > 0, r  # this machine alone: links unshaped, compute off
        # the rank holding most, measured, against the memory model of that rank
        assert 0.9 * r["model_memory"] <= r["memory"] <= 1.1 * r["model_memory"], r
    assert "EMULATED" in proc.stdout and "fastest measured" in proc.stdout
    assert "floor = median time with links unshaped and compute off" in proc.stdout


def test_bench_cluster_windowed_mode_runs_all_gather_a2a_and_the_mesh(tmp_path: Path) -> None:
    """--window-size: all_gather (whole chunks), a2a and every mesh shape (sparse exchange)
    on P = 4 as two nodes, each beside the planner's prediction; ring and a2a+p2p, which
    Transformer Engine refuses under a window, are not run. The bytes each method sent
    (rank 0, counted at the shaped links) are the planner's / the window formula's."""
    proc, data = _bench_cluster(tmp_path, 4, "--window-size", "64", timeout=600)
    rows = {r["method"]: r for r in data["rows"]}
    assert list(rows)[:2] == ["all_gather", "a2a"]
    assert {"mesh 4x1 sparse", "mesh 2x2 sparse", "mesh 1x4 sparse"} <= rows.keys()
    assert not any(m.startswith(("ring", "a2a+p2p")) for m in rows)
    workload = Workload(seq_length=1024, num_heads=8, num_kv_heads=4, head_dim=4,
                        window=window_of((64, 0), True))
    cluster = Emulation(MODELLED, 2000.0).cluster
    planned = search(workload, cluster)
    shape = workload.attention_shape()
    kv_chunk = 2 * (1024 // 4) * 4 * 4 * 2  # K and V of one rank: 256 tokens, 4 heads x 4, bf16
    expected = {"all_gather": 3 * 3 * kv_chunk,  # TE's: gather K,V twice, reduce dK,dV
                "a2a": planned.method("a2a").total_bytes,
                "mesh 4x1 sparse": window_traffic(shape, 1, 4, 1, (64, 0), True, 0, 4, 2).total,
                "mesh 2x2 sparse": window_traffic(shape, 1, 2, 2, (64, 0), True, 0, 4, 2).total}
    for method, nbytes in expected.items():
        assert sum(rows[method]["link_bytes"].values()) == nbytes, method
    assert rows["all_gather"]["predicted_s"] == pytest.approx(planned.method("all_gather").total_s)
    for r in rows.values():
        assert r["median_s"] >= r["compute_s"] > 0 and r["predicted_s"] > 0, r
        assert r["memory"] > 0 and r["model_memory"] > 0, r
    for text in ("EMULATED ms", "MODEL ms", "sliding window (64, 0): ring (p2p) and a2a+p2p "
                 "not run", "fastest measured (EMULATED)"):
        assert text in proc.stdout, text


def test_bench_cluster_rejects_bad_sizes(capsys: pytest.CaptureFixture) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import bench_cluster
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    with pytest.raises(SystemExit) as exc:
        bench_cluster.parse_args(["--cp-sizes", "6", "--nodes", "4"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--cp-sizes entry 6 must be at least 2 and divisible by --nodes 4" in err


def test_emulated_kernel_prices_varlen_tiles_by_in_document_pairs() -> None:
    """A call over packed documents (`TileSlices` of form documents) costs its in-document
    pairs only, not sq x sk."""
    from megatron_mesh.calls.tile_slices import TileSlices
    rate = 1e15  # fast: the price is read from kernel.seconds
    q = torch.zeros(100, 1, 4, 8)
    segs = TileSlices.documents((0, 30, 100), (0, 30, 100), True, torch.device("cpu"))
    kernel = EmulatedKernel(rate)
    kernel.forward(q, q, q, True, 1.0, slices=segs)
    causal_pairs = 30 * 31 // 2 + 70 * 71 // 2
    assert kernel.seconds == pytest.approx(4 * causal_pairs * 4 * 8 / rate)
    full = TileSlices.documents((0, 30, 100), (0, 50, 60), False, torch.device("cpu"))  # 30 x 50, 70 x 10
    kernel = EmulatedKernel(rate)
    kernel.backward(q, q, q[:60], q[:60], q, None, False, 1.0, slices=full)
    assert kernel.seconds == pytest.approx(2.5 * 4 * (30 * 50 + 70 * 10) * 4 * 8 / rate)


def test_bench_cluster_documents_mode_thd_and_placement(tmp_path: Path) -> None:
    """--doc-length-dist: THD and the placement on their planner grids, P = 4 as two nodes;
    the bytes the busiest rank sent are mesh_traffic's (THD) and placement_traffic's."""
    proc, data = _bench_cluster(tmp_path, 2, "--doc-length-dist", "lognormal:64:256:1:8")
    thd, placed = data["rows"]
    assert (thd["layout"], placed["layout"]) == ("THD", "placed")
    assert sum(data["lengths"]["4"]) == 1024 and all(n % 8 == 0 for n in data["lengths"]["4"])
    for r in (thd, placed):
        assert r["bytes"] == r["model_bytes"] > 0, r
        assert r["median_s"] >= r["compute_s"] > 0 and r["model_s"] > 0, r
    assert placed["bytes"] < thd["bytes"] and placed["floor_s"] > 0
    for text in ("EMULATED ms", "MODEL ms", "compute floor", "placement of"):
        assert text in proc.stdout, text
