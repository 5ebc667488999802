"""The driver's sliding-window flags end to end on CPU: --window-size 6 0 with
--window-attn-skip-freq 2 (layer 1 windowed, layer 2 global) on a 4-rank 2x2 mesh gives the
losses of the same flags at CP = 1, and they differ from a run without a window."""
from __future__ import annotations

from pathlib import Path

import pytest
from preloaded import TINY, build_indexed_dataset, launch

ITERS = 4
WINDOW = ["--window-size", "6", "0", "--window-attn-skip-freq", "2"]
MESH = ["--context-parallel-size", "4", "--context-parallel-algo", "mesh", "--mesh-shape", "2x2"]


def test_windowed_mesh_matches_cp1(tmp_path: Path) -> None:
    prefix = str(tmp_path / "arith")
    build_indexed_dataset(prefix)
    common = ["--config", TINY, "--train-iters", str(ITERS), "--data-path", prefix,
              "--data-cache-path", str(tmp_path / "index-cache")]
    ref = launch(1, [*common, *WINDOW])
    mesh = launch(4, [*common, *WINDOW, *MESH])
    plain = launch(1, common)
    for run in (ref, mesh, plain):
        assert run.returncode == 0, run.output[-3000:]
    ref_l, mesh_l, plain_l = ref.losses(), mesh.losses(), plain.losses()
    assert sorted(ref_l) == sorted(mesh_l) == list(range(1, ITERS + 1))
    for it in ref_l:
        assert mesh_l[it] == pytest.approx(ref_l[it], rel=2e-5), (it, ref_l, mesh_l)
    assert any(abs(plain_l[it] - ref_l[it]) > 1e-4 for it in range(2, ITERS + 1)), (
        plain_l, ref_l)  # the window changes the model
