"""scripts/te_device.sh's carrying of a wheel in parts, checked on this machine: the wheel
cut into parts with their sums, the parts received one call at a time into a stage (each
call says what is still missing), joined and checked against the wheel's sum; a damaged
or missing part stops the join, naming it."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VERSION = "0.0.1"
WHEEL = f"transformer_engine_cu13-{VERSION}-py3-none-manylinux_2_28_x86_64.whl"


def _run(tmp: Path, *args: str, te_dir: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, TE_VERSION=VERSION, TE_DIR=str(te_dir), TE_STAGE=str(tmp / "stage"),
               TE_PART_MIB="1", OUT=str(tmp / "out"))
    return subprocess.run(["bash", str(ROOT / "scripts" / "te_device.sh"), *args], env=env,
                          capture_output=True, text=True, timeout=60)


def test_a_wheel_travels_in_parts_and_is_joined_whole(tmp_path):
    here = tmp_path / "here"
    here.mkdir()
    wheel = here / WHEEL
    wheel.write_bytes(os.urandom(5 * 2**19 + 123))  # 2.5 MiB and a bit: three parts
    assert _run(tmp_path, "split", str(wheel), te_dir=here).returncode == 0
    parts = sorted(p.name for p in (here / "parts").iterdir())
    assert parts == ["part-00", "part-01", "part-02"]

    there = tmp_path / "there"  # what one call carries: the sums and one part
    for i, part in enumerate(parts):
        shutil.rmtree(there, ignore_errors=True)
        (there / "parts").mkdir(parents=True)
        if i == 0:
            shutil.copy(here / "SHA256SUMS", there / "SHA256SUMS")
        shutil.copy(here / "parts" / part, there / "parts" / part)
        proc = _run(tmp_path, "receive", te_dir=there)
        assert proc.returncode == 0, proc.stderr
        note = json.loads(proc.stdout.splitlines()[-1])["note"]
        assert note == (f"received {part}; missing " + (" ".join(parts[i + 1:]) or "none"))
        if i == 0:
            failed = _run(tmp_path, "join", te_dir=there)
            assert failed.returncode != 0 and "part-01 is missing or damaged" in failed.stderr

    proc = _run(tmp_path, "join", te_dir=there)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "stage" / WHEEL).read_bytes() == wheel.read_bytes()

    damaged = tmp_path / "stage" / "part-01"
    damaged.write_bytes(b"x" + damaged.read_bytes()[1:])
    proc = _run(tmp_path, "join", te_dir=there)
    assert proc.returncode != 0 and "part-01 is missing or damaged" in proc.stderr


def test_receive_without_the_sums_says_what_to_carry(tmp_path):
    (tmp_path / "there" / "parts").mkdir(parents=True)
    proc = _run(tmp_path, "receive", te_dir=tmp_path / "there")
    assert proc.returncode == 2 and "carry" in proc.stderr and "SHA256SUMS" in proc.stderr


def test_an_unknown_step_exits_2_with_the_usage(tmp_path):
    proc = _run(tmp_path, "fly", te_dir=tmp_path)
    assert proc.returncode == 2 and "usage: scripts/te_device.sh prepare" in proc.stderr
