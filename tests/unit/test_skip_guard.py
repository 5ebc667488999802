"""MESH_ALLOWED_SKIPS (tests/conftest.py): where it is set, a skip whose reason contains none
of its phrases fails the run and is listed, under pytest-xdist too; unset, skips pass. Run on
a copy of conftest.py beside three throwaway tests."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
CASES = '''
import pytest

def test_runs():
    pass

@pytest.mark.gpu
def test_on_a_gpu():
    pass

def test_skips_for_a_file():
    pytest.skip("the input file is missing")
'''


def _pytest(root: Path, allowed: str | None, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MESH_ALLOWED_SKIPS"}
    if allowed is not None:
        env["MESH_ALLOWED_SKIPS"] = allowed
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-W", "ignore", "-rs", *args, "tests"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)


def test_a_skip_not_allowed_fails_the_run(tmp_path: Path) -> None:
    (tmp_path / "tests" / "unit").mkdir(parents=True)
    shutil.copy(TESTS / "conftest.py", tmp_path / "tests" / "conftest.py")
    (tmp_path / "tests" / "unit" / "test_cases.py").write_text(CASES)
    proc = _pytest(tmp_path, "needs a GPU; no such phrase", "-n", "1")  # a worker, as in CI
    assert proc.returncode == 1, proc.stdout + proc.stderr
    listed = proc.stdout.split("skips not allowed here")[1].split("short test summary")[0]
    assert "test_cases.py::test_skips_for_a_file: the input file is missing" in listed
    assert "test_on_a_gpu" not in listed  # skipped for a GPU (or run, on one)
    proc = _pytest(tmp_path, None, "-n", "0")
    assert proc.returncode == 0 and "skips not allowed" not in proc.stdout, proc.stdout
