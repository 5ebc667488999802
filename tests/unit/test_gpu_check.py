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
                           "driver_vs_hf"], log
    assert steps["wheels"]["rc"] == 1 and "1 of 2 wheels" in steps["wheels"]["note"], log
    assert "failed: broken-0.1-py3-none-any.whl" in steps["wheels"]["note"]
    assert (out / ".site" / "mm_probe.py").exists()
    assert steps["gpu_tests"]["note"].startswith("skipped: pytest does not import"), log
    assert steps["tiles_mha"]["note"].startswith("dry run: ") and "bench_tiles.py" in log
    assert steps["driver_vs_hf"]["note"] == "skipped: transformers does not import", log
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["machine"]["torch"] == __import__("torch").__version__
    assert report["machine"]["pytest"] is None and report["machine"]["transformers"] is None
    summary = (out / "summary.txt").read_text()
    assert "failed steps: wheels" in summary and "driver_vs_hf" in summary
