"""scripts/demo.sh installs only what is missing: on a set-up machine it starts training
without pip; where the checkout is not the installed megatron_mesh it runs the setup."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _demo(tmp_path: Path, pythonpath: str | None = None) -> list[str]:
    """Run demo.sh with PYTHON set to a python that records each command line: pip and
    torchrun record only (nothing installed, nothing trained), anything else runs. The
    recorded command lines."""
    log = tmp_path / "calls.txt"
    python = tmp_path / "python"
    python.write_text(
        "#!/usr/bin/env bash\n"
        f'echo "$*" >> "{log}"\n'
        'case "$*" in *"-m pip "*|*"-m torch.distributed.run "*) exit 0;; esac\n'
        f'exec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHON"] = str(python)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    done = subprocess.run(["bash", str(ROOT / "scripts" / "demo.sh"), "--train-iters", "1"],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return log.read_text().splitlines()


def test_demo_skips_the_setup_when_installed(tmp_path: Path) -> None:
    calls = _demo(tmp_path)
    assert not [c for c in calls if "-m pip" in c], calls
    assert calls[-1].startswith("-m torch.distributed.run --standalone --nproc-per-node 4 -m "
                                "megatron_mesh.pretrain_gpt"), calls
    assert calls[-1].endswith("--train-iters 1"), calls


def test_demo_sets_up_a_machine_without_this_checkout_installed(tmp_path: Path) -> None:
    """Another megatron_mesh first on the path (as on a machine where this checkout is not
    installed): the setup installs the checkout with the demo's extras, then trains."""
    other = tmp_path / "other"
    (other / "megatron_mesh").mkdir(parents=True)
    (other / "megatron_mesh" / "__init__.py").write_text("")
    calls = _demo(tmp_path, str(other))
    assert '-m pip install -e .[megatron,wandb,tensorboard]' in calls, calls
    assert calls[-1].startswith("-m torch.distributed.run"), calls


def demo_extras() -> set[str]:
    """The extras scripts/demo.sh checks for and installs."""
    text = (ROOT / "scripts" / "demo.sh").read_text()
    (extras,) = re.findall(r"^EXTRAS=([a-z0-9_,-]+)$", text, re.MULTILINE)
    assert 'env_ready.py "$EXTRAS"' in text and 'setup.sh "$EXTRAS"' in text
    return set(extras.split(","))


def test_demo_installs_what_the_walk_through_uses() -> None:
    """The logger flags of docs/training.md's real-data walk-through (the README points a
    new user there after the demo) need extras the demo's set-up installs, and the
    walk-through says so."""
    from megatron_mesh.training.config.arguments import LOGGER_PACKAGES

    text = (ROOT / "docs" / "training.md").read_text()
    walk = text.split("## Real data, step by step", 1)[1].split("\n## ", 1)[0]
    used = {extra for dest, (_, extra) in LOGGER_PACKAGES.items()
            if "--" + dest.replace("_", "-") in walk}
    if "tensorboard --logdir" in walk:
        used.add("tensorboard")
    assert "tensorboard" in used, walk[:300]
    assert used <= demo_extras(), (used, demo_extras())
    assert "scripts/demo.sh" in walk and "[megatron,wandb,tensorboard]" in walk
