"""The benchmark scripts run end to end on a CPU and report what they claim: bytes equal to
the formula for every shape and schedule, the ring 'streamed' picks, tile efficiencies.
(Their timings are printed, never checked.)"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import megatron_mesh as mm
from megatron_mesh.cost_models.memory import streamed_schedule

ROOT = Path(__file__).resolve().parents[2]


def run_script(name: str, *args: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / name), *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def test_bench_attention_rows_match_the_formula_and_the_streamed_choice() -> None:
    out = run_script("bench_attention.py", "--cp-size", "4", "--seq-length", "256", "--heads", "4",
                     "--kv-heads", "2", "--head-dim", "16", "--iters", "1",
                     "--schedules", "streamed,streamed_kv,streamed_q,gathered")
    rows = [line.split() for line in out.splitlines() if re.match(r"\s*\d+x\d+\s", line)]
    shape = mm.AttentionShape(256, 1, 4, 2, 16, 4)
    expected = []
    for r, c in mm.mesh_shapes(4):
        expected += [(f"{r}x{c}", f"{streamed_schedule(shape, r, c)}*"), (f"{r}x{c}", "streamed_kv"),
                     (f"{r}x{c}", "streamed_q"), (f"{r}x{c}", "gathered")]
    assert [(row[0], row[1]) for row in rows] == expected, out
    for row in rows:  # MiB sent per rank (counted) == the formula's
        assert row[5] == row[6], out
    assert "ring (p2p" in out and "* = the ring schedule 'streamed' runs" in out


def test_memory_check_prints_every_method_against_the_model() -> None:
    out = run_script("memory_check.py", "--cp-size", "4", "--seq-length", "256", "--heads", "4",
                     "--kv-heads", "2", "--head-dim", "8", "--only", "ring", "2x2", "a2a")
    labels = [line.split()[0] for line in out.splitlines() if line[:1].isalnum()]
    assert {"ring", "2x2", "2x2x1", "a2a"} <= set(labels), out
    worst = re.search(r"worst \|measured / model - 1\| = ([\d.]+)%", out)
    assert worst and float(worst[1]) < 10, out


def test_bench_attention_rejects_an_unknown_schedule() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_attention.py"),
                           "--schedules", "streamed,ring"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert "--schedules entry 'ring' is not one of streamed, streamed_kv, streamed_q, gathered" \
        in proc.stderr


def test_bench_tiles_reports_every_pass_and_why_cudnn_and_te_are_skipped(tmp_path) -> None:
    report = tmp_path / "tiles.json"
    out = run_script("bench_tiles.py", "--device", "cpu", "--chunk", "128,64", "--cp-size", "4",
                     "--heads", "4", "--head-dim", "32", "--iters", "1", "--json", str(report))
    assert "CPU (not a GPU measurement)" in out, out
    lines = {tuple(line.split()[:3]): line.split() for line in out.splitlines() if line.strip()}
    for chunk in ("128", "64"):
        for phase in ("forward", "backward", "fwd+bwd"):
            fields = lines[("torch", chunk, phase)]
            assert fields[-3].endswith("%") and float(fields[-3][:-1]) > 0, out
    assert "te    128 skipped:" in out and "Transformer Engine" in out, out
    assert "cudnn    128 skipped:" in out and "needs CUDA" in out, out
    rows = [json.loads(line) for line in report.read_text().splitlines()]
    assert [(r["chunk"], r["pass"]) for r in rows] == [
        (c, p) for c in (128, 64) for p in ("forward", "backward", "fwd+bwd")]
    assert all(r["backend"] == "torch" and r["device"] == "cpu" for r in rows)
    # a causal 4 x 1 tile in few calls: Q against the lower halves, its own chunk (causal: on
    # the CPU a call of its own, not folded into a bottom-right one), and Q's second half
    # against the later chunks
    assert [(r["calls"], r["grouped"], r["folded"]) for r in rows[:3]] == [
        (3, True, False), (3, True, False), (6, True, False)]
    # each row counts both passes' calls: what the profile fit reads (`profile_fit.bench_calls`)
    assert all(r["pass_calls"] == {"forward": 3, "backward": 3} for r in rows)


def test_bench_tiles_of_packed_documents_joins_their_calls(tmp_path) -> None:
    """--documents 4 --calls grouped,blocks: the tile over packed documents in the dense
    tile's calls (joined by document) and in one call per block, each against one varlen
    call of the same FLOPs; a count of documents that does not split the sequence into
    multiples of 2P tokens exits 2."""
    report = tmp_path / "docs.json"
    out = run_script("bench_tiles.py", "--device", "cpu", "--chunk", "64", "--cp-size", "4",
                     "--heads", "4", "--head-dim", "32", "--iters", "1", "--backends", "torch",
                     "--documents", "4", "--calls", "grouped,blocks", "--json", str(report))
    assert "4 packed documents" in out and "(one call a block)" in out, out
    rows = [json.loads(line) for line in report.read_text().splitlines()]
    calls = {(r["grouped"], r["pass"]): r["calls"] for r in rows}
    assert all(r["documents"] == 4 and r["efficiency"] > 0 for r in rows), rows
    assert calls == {(True, "forward"): 3, (True, "backward"): 3, (True, "fwd+bwd"): 6,
                     (False, "forward"): 4, (False, "backward"): 4, (False, "fwd+bwd"): 8}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_tiles.py"), "--device",
                           "cpu", "--chunk", "60", "--cp-size", "4", "--documents", "4"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "multiple of 2P = 8 tokens" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_gpu_check_without_a_gpu_says_so_and_exits_0(tmp_path) -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path / "out")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no CUDA GPU on this machine" in proc.stdout
    assert not (tmp_path / "out").exists()


def test_driver_vs_hugging_face_gpt2_on_cpu(tmp_path) -> None:
    """transformers is in the dev extra (setup.py): a missing one fails here, never skips."""
    report = tmp_path / "hf.json"
    out = run_script("compare_hf_gpt2.py", "--layers", "2", "--hidden", "64", "--heads", "4",
                     "--seq", "64", "--batch", "2", "--vocab", "256", "--iters", "3",
                     "--warmup", "1", "--json", str(report))
    assert "CPU run" in out, out
    rows = json.loads(report.read_text())["results"]
    assert len(rows) == 2 and rows["megatron-mesh driver"]["attention"] == "mesh tile kernel"
    assert all(r["tokens_per_s"] > 0 and r["peak_memory_mib"] > 0 for r in rows.values())
