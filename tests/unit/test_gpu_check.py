"""What scripts/gpu_check.sh runs, checked on a CPU.

Its control flow in its dry-run mode: it installs the wheels carried beside the checkout (a
bad one keeps no other out), reports each missing piece (here pytest and transformers made
unimportable), goes through every step, each under its own time limit, and writes the
summary and gpu_check.json. And what the `gpu` tests pass that a CPU run cannot reach: how
their ranks start and which tile backend they name.
"""
from __future__ import annotations

import ast
import base64
import hashlib
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"


def _is_gpu_marked(fn: ast.FunctionDef) -> bool:
    return any(isinstance(d, ast.Attribute) and d.attr == "gpu" for d in fn.decorator_list)


def _calls(node: ast.AST, name: str) -> list[ast.Call]:
    return [c for c in ast.walk(node) if isinstance(c, ast.Call)
            and getattr(c.func, "id", getattr(c.func, "attr", None)) == name]


def test_gpu_tests_spawn_their_ranks() -> None:
    """Every `gpu` test that starts ranks starts them with cuda=True (spawned, fresh
    interpreters): forked from the preloaded server they cannot initialize CUDA."""
    launches, forked = 0, []
    for path in sorted((TESTS / "distributed").glob("test_*.py")):
        for fn in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(fn, ast.FunctionDef) and _is_gpu_marked(fn)):
                continue
            for call in _calls(fn, "run_distributed"):
                launches += 1
                cuda = {k.arg: k.value for k in call.keywords}.get("cuda")
                if not (isinstance(cuda, ast.Constant) and cuda.value is True):
                    forked.append(f"{path.name}:{call.lineno} {fn.name}")
    assert launches >= 5, launches  # the GPU tests of host staging, placement, sinks, decode
    assert not forked, f"gpu tests whose ranks are forked, not spawned: {forked}"


def test_every_backend_the_tests_name_is_one_mesh_attention_takes() -> None:
    """A `backend=` a test writes into a mesh_attention call, as a literal or either branch
    of a conditional, is one of kernels.BACKENDS: the GPU branch of a test cannot pass what
    the CPU run never does (e.g. None, which mesh_attention refuses)."""
    from megatron_mesh.kernels import BACKENDS

    bad = []
    for path in sorted(TESTS.rglob("*.py")):
        for call in _calls(ast.parse(path.read_text()), "mesh_attention"):
            for kw in call.keywords:
                if kw.arg != "backend":
                    continue
                values = [kw.value.body, kw.value.orelse] if isinstance(kw.value, ast.IfExp) \
                    else [kw.value]
                bad += [f"{path.relative_to(ROOT)}:{kw.lineno} backend={v.value!r}"
                        for v in values if isinstance(v, ast.Constant) and v.value not in BACKENDS]
    assert not bad, bad


def make_wheel(folder: Path, name: str, version: str) -> Path:
    """A minimal pure-Python wheel with one module `name` (value VERSION = version)."""
    files = {f"{name}.py": f"VERSION = {version!r}\n",
             f"{name}-{version}.dist-info/METADATA":
                 f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{name}-{version}.dist-info/WHEEL":
                 "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    def digest(text: str) -> str:
        return base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()

    record = [f"{path},sha256={digest(text)},{len(text)}" for path, text in files.items()]
    files[f"{name}-{version}.dist-info/RECORD"] = "\n".join(
        record + [f"{name}-{version}.dist-info/RECORD,,"]) + "\n"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for member, text in files.items():
            z.writestr(member, text)
    return path


@pytest.mark.distributed  # a subprocess of 15 s or so, not a fast unit test
def test_dry_run_goes_through_every_step(tmp_path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    make_wheel(wheels, "mm_probe", "1.2.3")
    (wheels / "broken-0.1-py3-none-any.whl").write_bytes(b"not a zip")
    shadow = tmp_path / "shadow"  # makes `import pytest` / `import transformers` fail there
    shadow.mkdir()
    for mod in ("pytest", "transformers"):
        (shadow / f"{mod}.py").write_text("raise ImportError('hidden for this test')\n")
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_WHEELS": str(wheels),
           "PYTHONPATH": str(shadow)}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    steps = {s["step"]: s for s in
             (json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines())}
    assert list(steps) == ["wheels", "gpu_tests", "tiles_mha", "tiles_torch_merge", "tiles_gqa",
                           "tiles_documents", "tiles_flex", "driver_vs_hf_4k",
                           "driver_vs_hf_16k", "cp_on_one_gpu", "profile_fit"], log
    assert steps["wheels"]["rc"] == 1 and "1 of 2 wheels" in steps["wheels"]["note"], log
    assert "failed: broken-0.1-py3-none-any.whl" in steps["wheels"]["note"]
    assert (out / ".site" / "mm_probe.py").exists()
    assert steps["gpu_tests"]["note"].startswith("skipped: pytest does not import"), log
    for name in ("tiles_mha", "tiles_gqa"):
        note = steps[name]["note"]
        assert note.startswith("dry run: ") and "bench_tiles.py --chunk 2048,4096,8192" in note
    assert "--kv-heads 8" in steps["tiles_gqa"]["note"]
    assert "--documents 16 --calls grouped,blocks" in steps["tiles_documents"]["note"], log
    assert "test_kernels_flex.py" in steps["tiles_flex"]["note"], log
    assert "--chunk 2048,4096,8192" in steps["tiles_flex"]["note"], log  # a flex fit's rows
    assert "--backends flex" in steps["tiles_flex"]["note"], log
    # the torch merge's A/B rows apart from the rows the profile is fitted to
    assert "tiles_torch_merge.jsonl" in steps["tiles_torch_merge"]["note"], log
    for name in ("driver_vs_hf_4k", "driver_vs_hf_16k"):
        assert steps[name]["note"] == "skipped: transformers does not import", log
    assert "cp_on_one_gpu.py" in steps["cp_on_one_gpu"]["note"], log
    fit = (ROOT / "scripts" / "fit_gpu_profile.py").exists()
    assert steps["profile_fit"]["note"].startswith("dry run: " if fit else "skipped: "), log
    # each step that runs has its own limit; with the reserve they fit the 6-minute budget
    limits = {name: s["limit_s"] for name, s in steps.items() if s["note"].startswith("dry run")}
    assert limits and all(isinstance(t, int) and t > 0 for t in limits.values()), limits
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    every = {k: int(v) for k, v in re.findall(r"\[(\w+)\]=(\d+)", script)}
    reserve = int(re.search(r"^RESERVE_S=(\d+)", script, re.M)[1])
    assert set(every) == set(steps) - {"wheels"} and limits.items() <= every.items(), every
    assert sum(every.values()) + reserve <= 360, every
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["machine"]["torch"] == __import__("torch").__version__
    assert report["machine"]["pytest"] is None and report["machine"]["transformers"] is None
    summary = (out / "summary.txt").read_text()
    assert "failed steps: wheels" in summary and "driver_vs_hf_16k" in summary
    assert "CP = 4 on one GPU: not run" in summary, summary


def test_step_limits_over_the_budget_are_refused(tmp_path) -> None:
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_BUDGET_S": "100",
           "GPU_CHECK_WHEELS": str(tmp_path / "none")}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run",
                           str(tmp_path / "out")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "over the budget 100 s" in proc.stderr, proc.stderr


def _cp_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("cp_on_one_gpu",
                                                  ROOT / "scripts" / "cp_on_one_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cp_on_one_gpu_holds_cp4_to_twice_the_drift_of_bf16_from_fp32() -> None:
    """scripts/cp_on_one_gpu.py's verdict (the GPU step): the driver's log lines parsed,
    each CP = 4 grid within 2 x the running max of |L_cp1 - L_cp1_fp32| + 2^-8 L_cp1 of
    CP = 1 at every iteration; beyond it, or an iteration missing, fails."""
    cp = _cp_script()
    line = ("[2026-11-27 10:25:00] iteration        2/       3 | consumed samples:            4 "
            "| tokens/s: 7153.3 | lm loss: 5.983616E+00 | grad norm: 1.534 |")
    assert cp.losses(line) == {2: 5.983616}
    ref = {1: 4.0, 2: 3.0, 3: 2.5}
    fp32 = {1: 4.0, 2: 3.004, 3: 2.5}  # bf16 moved the loss by 0.004 at iteration 2
    bound = [2 * 0.0 + 4.0 / 256, 2 * 0.004 + 3.0 / 256, 2 * 0.004 + 2.5 / 256]
    close = {1: 4.01, 2: 3.0 - 0.019, 3: 2.5 + 0.017}
    runs = {"cp1": ref, "cp1 fp32": fp32, "cp4 2x2": close, "cp4 2x1x2": dict(ref)}
    verdict = cp.compare(runs, 3)
    assert verdict["pass"] and verdict["bound"] == pytest.approx(bound), verdict
    assert verdict["grids"]["cp4 2x2"]["max_diff"] == pytest.approx(0.019)
    far = {**close, 3: 2.5 + 0.019}  # 0.019 > 0.008 + 2.5 / 256 = 0.01777
    verdict = cp.compare({**runs, "cp4 2x2": far}, 3)
    assert not verdict["pass"] and verdict["grids"]["cp4 2x2"]["beyond"] == [3], verdict
    verdict = cp.compare({**runs, "cp4 2x1x2": {1: 4.0, 2: 3.0}}, 3)
    assert not verdict["pass"] and verdict["missing"] == {"cp4 2x1x2": [3]}


def test_cp_on_one_gpu_runs_every_grid_with_host_staged_collectives() -> None:
    cp = _cp_script()
    jobs = cp.job_commands(cp.parse_args([]), "DATA", "CACHE")
    assert list(jobs) == ["cp1", "cp1 fp32", "cp4 2x2", "cp4 2x1x2"]
    for name, cmd in jobs.items():
        assert ("--bf16" in cmd) == (name != "cp1 fp32")
        four = name.startswith("cp4")
        assert cmd[cmd.index("--nproc-per-node") + 1] == ("4" if four else "1")
        assert ("--mesh-host-staged-collectives" in cmd) == four
    assert jobs["cp4 2x1x2"][jobs["cp4 2x1x2"].index("--mesh-shape") + 1] == "2x1x2"
    with pytest.raises(SystemExit):
        cp.parse_args(["--heads", "3", "--hidden", "96"])
