"""The GPU profile: stored data that loads, a fit that reproduces it from the stored rows
and stays within its stated error of every measured row, and the planner and the emulated
cluster pricing kernel calls with it (`planner.gpu_profile`, `planner.profile_fit`)."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_mesh.calls.layout import AttentionMask
from megatron_mesh.cli import main
from megatron_mesh.cost_models.tile_calls import backward_calls, forward_calls
from megatron_mesh.emulation import EmulatedKernel, Emulation
from megatron_mesh.emulation.compute import tile_flops
from megatron_mesh.masks.window import window_of
from megatron_mesh.planner import Cluster, plan
from megatron_mesh.planner.gpu_profile import (
    GPU_PROFILES,
    PASSES,
    PROFILE_DIR,
    PassFit,
    call_flops,
    load_profile,
)
from megatron_mesh.planner.hardware import TFLOP
from megatron_mesh.planner.pricing.placed_documents import price_placement
from megatron_mesh.planner.pricing.tiles import TileCalls, window_blocks
from megatron_mesh.planner.profile_fit import bench_calls, fit_rows, residuals

from reference import block_pairs

ROOT = Path(__file__).resolve().parents[2]
ROWS = PROFILE_DIR / "h200-tiles.jsonl"
K = 1024
GQA = dict(seq_length=128 * K, num_heads=32, num_kv_heads=8, head_dim=128)


def rows() -> list[dict]:
    return [json.loads(line) for line in ROWS.read_text().splitlines() if line.strip()]


def test_profiles_load_with_where_their_numbers_come_from():
    h200, h100 = load_profile("h200"), load_profile("h100")
    assert GPU_PROFILES == ("h100", "h200")
    assert h200.measured and h200.machine == "NVIDIA H200" and h200.date == "2026-11-27"
    assert dict(h200.versions) == {"torch": "2.11.0+cu130", "cudnn": "9.19", "triton": "3.6"}
    assert h200.backend == "cudnn" and set(h200.backends) == {"torch", "cudnn"}
    assert "h200-tiles.jsonl" in h200.source
    # H100: the H200's fits at its data-sheet rate ratio, saying it is not measured
    assert not h100.measured and "SCALED, not measured" in h100.describe()
    for phase in PASSES:
        assert h100.fit(phase).tflops == pytest.approx(h200.fit(phase).tflops * 1.0)
        assert h100.fit(phase).host_s == h200.fit(phase).host_s
    with pytest.raises(ValueError, match="'h300' is not one of h100, h200"):
        load_profile("h300")
    with pytest.raises(ValueError, match="no backend 'te'; it has torch, cudnn"):
        h200.fit("forward", "te")


def test_the_fit_reproduces_the_stored_parameters_from_the_stored_rows():
    stored = {(b, p): f for b, p, f in load_profile("h200").fits}
    fitted = {(b, p): f for b, p, f in fit_rows(rows())}
    assert fitted.keys() == stored.keys()
    for key, fit in fitted.items():
        for name, value in vars(fit).items():
            assert value == pytest.approx(getattr(stored[key], name), rel=1e-9, abs=1e-12), \
                (key, name)


def test_fitted_times_are_within_the_stated_error_of_every_measured_row():
    profile = load_profile("h200")
    assert profile.max_rel_error <= 0.5  # the bound the docs state
    res = residuals(profile.fits, rows())
    assert len(res) == len(rows()) == 60
    worst = max(res, key=lambda r: r.worst)
    assert worst.worst <= profile.max_rel_error, worst
    rms = (sum(r.single ** 2 + r.tile ** 2 for r in res) / (2 * len(res))) ** 0.5
    assert rms < 0.15
    # the single calls, which the rate is fitted to, within 25% everywhere
    assert max(abs(r.single) for r in res) < 0.25


def test_bench_tile_is_the_blocks_of_one_call_of_the_same_flops():
    row = rows()[0]  # chunk 2048, P = 8, causal: 1 diagonal, 4 below, 3 above
    single, tile = bench_calls(row, "forward")
    assert len(single) == 1 and len(tile) == row["cp_size"]
    assert sum(f for f, _ in tile) == pytest.approx(single[0][0])
    assert sorted({u for _, u in tile}) == [16 * 1024, 16 * 2048]


def test_grouped_rows_are_fitted_by_the_calls_they_ran():
    """A grouped row (bench_tiles.py's default) ran the calls its `pass_calls` count, not
    one per block: rows made from a known fit with 3 calls a tile give that fit back (read
    as 8 calls a tile they would give another host and merge); a grouped row without the
    count, or a row of packed documents, is refused."""
    truth = PassFit(45e-6, 600.0, 9000.0, 120e-6, 40e-6)
    made = []
    for chunk in (1024, 2048, 4096, 8192):
        row = dict(rows()[0], chunk=chunk, grouped=True,
                   pass_calls={"forward": 3, "backward": 3}, single_ms=0.0, tile_ms=0.0)
        for phase in ("forward", "backward"):
            one, calls = bench_calls(dict(row, **{"pass": phase}), phase)
            assert len(calls) == 3
            assert sum(f for f, _ in calls) == pytest.approx(one[0][0])
            made.append(dict(row, **{"pass": phase, "single_ms": 1e3 * truth.calls_seconds(one),
                                     "tile_ms": 1e3 * truth.calls_seconds(calls)}))
    fitted = dict(((b, p), f) for b, p, f in fit_rows(made))[(row["backend"], "forward")]
    assert fitted.host_s == pytest.approx(truth.host_s, abs=1.5e-6)
    assert fitted.merge_s == pytest.approx(truth.merge_s, abs=1.5e-6)
    as_blocks = [dict(r, grouped=False, pass_calls={"forward": 8, "backward": 8}) for r in made]
    wrong = dict(((b, p), f) for b, p, f in fit_rows(as_blocks))[(row["backend"], "forward")]
    assert abs(wrong.host_s - truth.host_s) > 20e-6
    with pytest.raises(ValueError, match="grouped row .* without 'pass_calls'"):
        bench_calls(dict(rows()[0], grouped=True), "forward")
    with pytest.raises(ValueError, match="row 1 times 16 packed documents"):
        fit_rows([dict(r, documents=16) for r in made])
    with pytest.raises(ValueError, match=r"rows of several merges \(torch, triton\)"):
        fit_rows([dict(r, merge="torch" if i == 0 else "triton") for i, r in enumerate(made)])


def test_at_2k_token_chunks_a_tile_of_more_calls_costs_more_than_the_flat_rate():
    """The mechanism that changes the planner's choice: at 128K tokens over 64 GPUs a rank
    holds 2K tokens; its tile's FLOPs in 64 calls (ring, every 2D mesh today) cost more on
    the profile than at the flat 400 TFLOP/s, and more than in 8 calls of 8 x the rows
    (a heads x rows x cols grid with A = 8); at 16K-token calls the profile is the rate."""
    profile = load_profile("h200")
    flops = call_flops("forward", 128 * K, 128 * K, 32, 128, True) / 64
    flat = flops / (400 * TFLOP)
    many = profile.tile_seconds("forward", flops, 64, 2 * K, 32)
    few = profile.tile_seconds("forward", flops, 8, 16 * K, 4)
    assert many > 1.3 * flat and many > 1.5 * few
    fit = profile.fit("forward")
    assert many == pytest.approx(fit.latency_s + 64 * fit.host_s)  # the host sets the pace
    big = call_flops("forward", 16 * K, 64 * K, 32, 128, False)
    assert profile.tile_seconds("forward", big, 1, 16 * K, 32) == pytest.approx(
        big / (fit.tflops * TFLOP), rel=0.01)


def test_planner_prices_each_method_by_its_calls_and_the_mesh_by_tile_calls():
    flat = plan(64, **GQA)
    priced = plan(64, gpu="h200", **GQA)
    profile = priced.cluster.gpu
    flops = {"forward": flat.workload.forward_flops() / 64,
             "backward": flat.workload.backward_flops() / 64}
    assert priced.ring.calls == TileCalls(64, 64, 2 * K, 32)
    for phase in PASSES:
        # flat: every method the same compute; the profile: the ring's 64 calls cost more
        assert flat.ring.compute_s[phase] == pytest.approx(flops[phase] / (400 * TFLOP))
        assert priced.ring.compute_s[phase] > 1.3 * flat.ring.compute_s[phase]
    for e in priced.meshes + priced.grids:
        r, c = e.mesh_shape
        schedule = priced.workload.mesh_plan(r, c, e.heads).schedule
        # cuDNN takes no bottom-right causal call: as tile_calls counts for it, each call
        # at most the cap's keys of the mesh's chunks
        chunk = priced.workload.seq_length * e.heads // 64
        assert e.calls.forward == forward_calls(r, c, True, schedule, bottom_right=False,
                                                chunk_tokens=chunk)
        assert e.calls.backward == backward_calls(r, c, True, schedule, bottom_right=False,
                                                  chunk_tokens=chunk)
        assert e.calls.heads == 32 // e.heads
        for phase in PASSES:
            assert e.compute_s[phase] == pytest.approx(profile.tile_seconds(
                phase, flops[phase], e.calls.count(phase), e.calls.rows, e.calls.heads))
    # the flat rate still prices every method alike: the default is unchanged
    assert {round(e.compute_s["forward"], 12) for e in flat.estimates} == {
        round(flops["forward"] / (400 * TFLOP), 12)}


def test_emulated_kernel_sleeps_the_profile_price_of_each_call():
    profile = load_profile("h200")
    emulation = Emulation(Cluster(gpus=4, gpu=profile), slowdown=10.0)
    played = emulation.cluster.gpu
    assert played.tile_seconds("forward", 1e12, 8, 2048, 16) == pytest.approx(
        10 * profile.tile_seconds("forward", 1e12, 8, 2048, 16))
    kernel = emulation.kernel()
    assert isinstance(kernel, EmulatedKernel) and kernel.profile == played
    q = torch.zeros(64, 1, 4, 8, dtype=torch.bfloat16)
    k = v = torch.zeros(32, 1, 4, 8, dtype=torch.bfloat16)
    kernel.forward(q, k, v, False, 1.0)
    want = played.share_seconds("forward", tile_flops(q, k, False), 64, 4, 1, "bf16")
    assert kernel.seconds == pytest.approx(want) and want >= 10 * profile.fit("forward").host_s
    assert "attention by kernel calls" in emulation.describe()


def test_cli_gpu_selects_the_profile_and_says_when_it_is_scaled(capsys):
    model = ["plan", "--gpus", "64", "--seq-length", str(128 * K), "--hidden-size", "4096",
             "--num-heads", "32", "--num-kv-heads", "8"]
    assert main([*model, "--gpu", "h200"]) == 0
    out = capsys.readouterr().out
    assert "GPU profile h200 (measured)" in out and "64 x 2048r x 32h  ring (p2p)" in out
    assert main([*model, "--gpu", "h100", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["cluster"]["gpu"]["name"] == "h100" and not data["cluster"]["gpu"]["measured"]
    assert data["estimates"][0]["calls"]["forward"] == 64
    assert main(model) == 0
    assert "attention 400 TFLOP/s per GPU" in capsys.readouterr().out  # flat by default


@pytest.mark.parametrize("extra, message", [
    (["--gpu", "h300"], "argument --gpu: invalid choice: 'h300' (choose from 'h100', 'h200')"),
    (["--gpu", "h200", "--attention-tflops", "300"], "--gpu h200 prices attention by its "
     "profile of kernel calls; --attention-tflops 300 is a flat rate: give one"),
    (["--mesh-kernel", "flex"], "--mesh-kernel flex names the kernel whose calls a GPU "
     "profile prices: give --gpu (h100 or h200) with it"),
])
def test_cli_bad_gpu_exits_2_naming_the_valid_ones(capsys, extra, message):
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--gpus", "8", "--seq-length", "8192", "--head-dim", "128",
              "--num-heads", "8", *extra])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_fit_script_refits_and_writes_the_profile(tmp_path):
    """The stored rows, given as two files (torch's, cuDNN's: as a GPU check writes flex's
    beside the others), give the stored profile back."""
    out = tmp_path / "h200.json"
    parts = []
    for backend in ("torch", "cudnn"):
        parts.append(tmp_path / f"h200-tiles-2026-11-27-{backend}.jsonl")
        parts[-1].write_text("".join(json.dumps(r) + "\n" for r in rows()
                                     if r["backend"] == backend))
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "fit_gpu_profile.py"),
                           *map(str, parts), "--out", str(out), "--versions",
                           "torch=2.11.0+cu130,cudnn=9.19,triton=3.6"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "worst 45.5%: stored bound 50%" in proc.stdout
    assert proc.stdout.count("%") >= 2 * 60  # a residual per row, single and tile
    written = json.loads(out.read_text())
    stored = json.loads((PROFILE_DIR / "h200.json").read_text())
    for backend, passes in stored["fits"].items():
        for phase, fit in passes.items():
            assert written["fits"][backend][phase] == pytest.approx(fit, rel=1e-9, abs=1e-12)
    assert written["versions"] == stored["versions"] and written["date"] == stored["date"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"backend": "torch"}\n')
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "fit_gpu_profile.py"), str(bad)],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "row 1 lacks chunk" in proc.stderr and len(proc.stderr.splitlines()) == 1


@pytest.mark.parametrize("seq, rows, cols, window, causal", [
    (256, 4, 2, (20, 0), True), (256, 2, 4, (40, 0), True), (192, 3, 2, (10, 7), False),
    (256, 8, 1, (-1, 5), False), (128, 1, 4, (3, 0), True),
])
def test_window_blocks_counts_the_blocks_holding_a_pair(seq, rows, cols, window, causal):
    """Against the blocks' masks built from the definition (`layout.block_pairs`)."""
    m = rows * cols
    w = window_of(window, causal)
    mask = AttentionMask(causal, ranks=m, window=w)
    held = [[bool(block_pairs(mask, x, y, seq // m).any()) for y in range(m)] for x in range(m)]
    want = max(sum(held[i * cols + c][r * cols + j] for c in range(cols) for r in range(rows))
               for i in range(rows) for j in range(cols))
    assert window_blocks(seq, rows, cols, w, causal) == want


def test_placed_and_windowed_meshes_price_only_blocks_that_hold_pairs():
    """32 documents of 4K over 64 ranks: each rank's documents reach one neighbour, so the
    placed 64 x 1 mesh makes a few calls, not the dense tile's 64; under a 4K window a rank's
    two 1K sub-chunks reach four below each: 9 blocks."""
    p = plan(64, gpu="h200", doc_lengths=(4 * K,) * 32, **GQA)
    placed = {e.grid_shape: e for e in price_placement(p).estimates}
    assert placed[(1, 64, 1)].calls.forward <= 3
    windowed = plan(64, gpu="h200", window=(4 * K, 0), **GQA)
    assert windowed.mesh(64, 1).calls.forward == window_blocks(128 * K, 64, 1,
                                                             windowed.workload.window, True) == 9


@pytest.mark.parametrize("kv_heads", [8, 32])
def test_published_case_the_profile_moves_the_choice_to_fewer_larger_calls(kv_heads):
    """64 GPUs, 128K (docs/planner.md): at 2K tokens per rank the profile prices the 2D
    meshes' 64 calls at the host's pace and picks a grid of more heads and fewer calls."""
    flat = plan(64, **{**GQA, "num_kv_heads": kv_heads})
    priced = plan(64, gpu="h200", **{**GQA, "num_kv_heads": kv_heads})
    assert priced.best_grid.grid_shape != flat.best_grid.grid_shape
    assert priced.best_grid.heads > flat.best_grid.heads
    chosen_flat = next(e for e in priced.estimates if e.label == flat.best_grid.label)
    assert priced.best_grid.calls.forward < chosen_flat.calls.forward
    assert priced.best_mesh.total_s > flat.best_mesh.total_s  # 2D meshes pay for their calls


def test_a_profile_prices_the_named_kernel_by_its_fit_or_its_calls_saying_so(capsys):
    """--mesh-kernel: a kernel the profile fits is priced by that fit; one it does not fit
    (flex, te) by its own calls at the profile's kernel time a call, said to be a MODEL; the
    calls counted follow the kernel (flex: a gathered tile in 1 call forward, 2 backward)."""
    h200 = load_profile("h200")
    assert h200.for_kernel("auto") is h200 and h200.calls_backend == "cudnn"
    torch_fit = h200.for_kernel("torch")
    assert (torch_fit.backend, torch_fit.calls_backend) == ("torch", "torch")
    assert torch_fit.fit("forward") == h200.fit("forward", "torch")
    flex = h200.for_kernel("flex")
    assert (flex.backend, flex.calls_backend) == ("cudnn", "flex")
    assert "flex calls at cudnn's fitted time a call (no flex fit: MODEL)" in flex.describe()
    assert load_profile("h100").for_kernel("flex").calls_backend == "flex"
    with pytest.raises(ValueError, match="tile kernel 'cuda' is not one of auto, torch, cudnn"):
        h200.for_kernel("cuda")
    model = ["plan", "--gpus", "8", "--seq-length", str(16 * K), "--head-dim", "128",
             "--num-heads", "16", "--mesh-schedule", "gathered", "--gpu", "h200", "--json"]
    calls = {}
    for kernel in ("auto", "flex"):
        assert main([*model, "--mesh-kernel", kernel]) == 0
        data = json.loads(capsys.readouterr().out)
        calls[kernel] = {e["label"]: e["calls"] for e in data["estimates"]}
        assert data["cluster"]["gpu"]["kernel"] == ("cudnn" if kernel == "auto" else kernel)
    assert calls["flex"]["mesh 2x4"]["forward"] == 1 and calls["flex"]["mesh 2x4"]["backward"] == 2
    assert calls["auto"]["mesh 2x4"]["forward"] > 1


def test_tile_model_prices_the_named_kernel_and_says_it_is_a_model(capsys) -> None:
    """scripts/bench_tile_model.py --backend flex: flex's calls (gathered: 1 forward, 2
    backward) at the profile's time a call, every line marked MODEL; an unknown kernel exits
    2 naming the valid ones."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "bench_tile_model.py"
    spec = importlib.util.spec_from_file_location("bench_tile_model", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    run = ["--cp-sizes", "8", "--chunks", "2048", "--heads", "16/16", "--schedule", "gathered"]
    assert bench.main([*run, "--backend", "flex"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("MODEL, not measured: GPU profile h200 (measured): flex calls at "
                          "cudnn's fitted time a call (no flex fit: MODEL)")
    rows = [line.split() for line in out.splitlines() if line.startswith(" 16/16")]
    assert len(rows) == 10 and all(r[5] == "1/2" for r in rows if r[3].count("x") == 1)
    assert bench.main([*run, "--backend", "cuda"]) == 2
    assert "tile kernel 'cuda' is not one of auto" in capsys.readouterr().err
