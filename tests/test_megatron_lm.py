"""Megatron-LM integration: the patch and the no-patch example against a real checkout.

Set MEGATRON_LM_DIR to a Megatron-LM checkout (tag core_v0.16.1) whose Python environment
can import megatron.training (it needs triton, among others); skipped otherwise. The
checkout itself is never modified: the patch is applied to an overlay of it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
APPLY = REPO / "scripts" / "apply_megatron_patch.sh"
EXAMPLE = REPO / "examples" / "megatron_lm_pretrain_mesh.py"
PATCHED = ("gpt_builders.py", "megatron/training/arguments.py", "megatron/training/initialize.py")

MEGATRON_LM_DIR = os.environ.get("MEGATRON_LM_DIR")
pytestmark = pytest.mark.skipif(
    not MEGATRON_LM_DIR,
    reason="MEGATRON_LM_DIR is not set (point it at a Megatron-LM checkout of core_v0.16.1)",
)


def _checkout() -> Path:
    path = Path(MEGATRON_LM_DIR).resolve()
    assert (path / "pretrain_gpt.py").is_file(), f"{path} is not a Megatron-LM checkout"
    return path


def _overlay(src: Path, dst: Path) -> Path:
    """dst mirrors src through symlinks, except real copies of the files the patch edits."""
    copies = {Path(p) for p in PATCHED}
    parents = {parent for p in copies for parent in p.parents if str(parent) != "."}

    def mirror(rel: Path) -> None:
        (dst / rel).mkdir(parents=True, exist_ok=True)
        for entry in (src / rel).iterdir():
            child = rel / entry.name
            if child in copies:
                shutil.copy2(entry, dst / child)
            elif child in parents:
                mirror(child)
            else:
                (dst / child).symlink_to(entry)

    mirror(Path())
    return dst


def _python(code: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, MEGATRON_LM_DIR=str(cwd), CUDA_DEVICE_MAX_CONNECTIONS="1")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(cwd), str(REPO), env.get("PYTHONPATH", "")) if p
    )
    return subprocess.run([sys.executable, "-W", "ignore", "-c", textwrap.dedent(code)],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_patch_applies_to_the_checkout():
    proc = subprocess.run(["bash", str(APPLY), "--check", str(_checkout())],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "applies cleanly" in proc.stdout or "already applied" in proc.stdout


def test_apply_script_rejects_a_directory_that_is_not_megatron_lm(tmp_path):
    proc = subprocess.run(["bash", str(APPLY), "--check", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "not a Megatron-LM checkout" in proc.stderr


def test_patched_megatron_lm_parses_and_checks_the_mesh_flags(tmp_path):
    overlay = _overlay(_checkout(), tmp_path / "Megatron-LM")
    proc = subprocess.run(["bash", str(APPLY), str(overlay)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = subprocess.run(["bash", str(APPLY), "--check", str(overlay)], capture_output=True,
                          text=True, timeout=60)
    assert "already applied" in proc.stdout, proc.stdout + proc.stderr

    proc = _python(
        """
        import os, sys
        import torch
        import megatron.training.arguments as arguments
        if not torch.cuda.is_available():
            # validate_args asks the GPU generation when CP > 1; answer for CPU-only hosts.
            arguments.get_device_arch_version = lambda: 9
        os.environ["WORLD_SIZE"] = "8"
        base = ["pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "64",
                "--num-attention-heads", "4", "--seq-length", "256",
                "--max-position-embeddings", "256", "--micro-batch-size", "1",
                "--global-batch-size", "2", "--context-parallel-size", "4", "--mock-data",
                "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
                "--attention-dropout", "0"]

        def parse(*extra):
            sys.argv = base + list(extra)
            args = arguments.parse_args()
            arguments.validate_args(args)
            return args

        args = parse("--context-parallel-algo", "mesh", "--mesh-shape", "2x2")
        print("MESH", args.context_parallel_algo, args.mesh_shape)
        print("AUTO", parse("--context-parallel-algo", "mesh").mesh_shape)
        print("A2A", parse("--context-parallel-algo", "a2a").cp_comm_type)
        print("KEEP", parse("--cp-comm-type", "all_gather").cp_comm_type)
        try:
            parse("--context-parallel-algo", "mesh", "--mesh-shape", "3x2")
        except ValueError as error:
            print("BAD", error)
        """,
        overlay,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-4000:]
    assert "MESH mesh (2, 2)" in out
    assert "AUTO (" in out
    assert "A2A ['a2a']" in out
    assert "KEEP ['all_gather']" in out
    assert "BAD" in out and "3x2" in out


def test_no_patch_example_imports_and_adds_the_flags():
    checkout = _checkout()
    proc = _python(
        f"""
        import argparse, importlib.util
        spec = importlib.util.spec_from_file_location("example", {str(EXAMPLE)!r})
        example = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(example)
        for name in ("extra_args_provider", "mesh_model_provider", "mesh_gpt_builder", "main"):
            assert callable(getattr(example, name)), name
        parser = example.extra_args_provider(argparse.ArgumentParser())
        args = parser.parse_args(["--context-parallel-algo", "mesh", "--mesh-shape", "2x4"])
        print("ARGS", args.context_parallel_algo, args.mesh_shape)
        """,
        checkout,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert "ARGS mesh (2, 4)" in proc.stdout
