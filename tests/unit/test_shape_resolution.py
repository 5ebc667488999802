"""The mesh shape is decided once: the shape the flag check logs is the shape the groups are
built with, on the driver's and on Megatron-LM's path, chosen by the planner or given.

The group builder (`initialize_mesh_grids`) and the flag check (`validate_mesh_args`) both
resolve through `shape.resolve_mesh_shape` with the launcher's ranks per node; the real
builds are checked in test_megatron_parity.py (Megatron path) and test_training_driver.py
(driver, two nodes of two ranks)."""
from __future__ import annotations

import argparse
import logging

import pytest

from megatron_mesh.megatron import validate_mesh_args
from megatron_mesh.megatron.shape import cp_ranks_per_node, resolve_mesh_shape
from megatron_mesh.training.config.arguments import parse_args

# CP 16, 32 query / 8 KV heads, 1024 tokens per rank, TP 2 inside nodes of 8 GPUs. For the 2D
# mesh (--mesh-heads 1) with the planner's default 8 CP ranks per node the choice is 2x8, but a
# node holds 8 / 2 = 4 CP ranks and for those the planner picks 4x4 (once the log said one and
# the job built the other). With the heads dimension open it picks 4x4x1 (A = 4 divides the
# 16 query heads of a TP rank).
CASE = dict(tp=2, cp=16, heads=32, groups=8, head_dim=128, seq=1024 * 16)


def _megatron_args(**over) -> argparse.Namespace:
    args = dict(context_parallel_algo="mesh", cp_comm_type=None, mesh_shape=None, mesh_heads=1,
                context_parallel_size=CASE["cp"], tensor_model_parallel_size=CASE["tp"],
                num_attention_heads=CASE["heads"], num_query_groups=CASE["groups"],
                group_query_attention=True, kv_channels=CASE["head_dim"],
                seq_length=CASE["seq"], attention_dropout=0.0)
    args.update(over)
    return argparse.Namespace(**args)


def _built(mesh_shape=None, per_node: int | None = None,
           mesh_heads: int | None = 1, dtype: str = "bf16") -> tuple[int, int, int]:
    """What initialize_mesh_grids builds for CASE in `dtype`: its own resolution."""
    return resolve_mesh_shape(
        CASE["cp"], mesh_shape, mesh_heads=mesh_heads, num_attention_heads=CASE["heads"],
        num_query_groups=CASE["groups"], head_dim=CASE["head_dim"], seq_length=CASE["seq"],
        tensor_parallel_size=CASE["tp"], cp_ranks_per_node=per_node, dtype=dtype)[0]


def test_ranks_per_node_come_from_the_launcher() -> None:
    assert cp_ranks_per_node(2, {"LOCAL_WORLD_SIZE": "8"}) == 4
    assert cp_ranks_per_node(1, {"SLURM_NTASKS_PER_NODE": "4"}) == 4
    assert cp_ranks_per_node(8, {"LOCAL_WORLD_SIZE": "4"}) == 1
    assert cp_ranks_per_node(1, {}) is None


def test_megatron_path_logs_the_shape_it_builds(monkeypatch, caplog) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    per_node = cp_ranks_per_node(CASE["tp"])
    assert per_node == 4 and _built(per_node=None) == (1, 2, 8)  # the two used to disagree
    with caplog.at_level(logging.INFO, logger="megatron_mesh"):
        shape = validate_mesh_args(_megatron_args())
    assert shape == _built(per_node=per_node) == (1, 4, 4)
    assert "4x4 grid of 16 CP ranks (chosen by the planner for 4 CP ranks per node)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="megatron_mesh"):
        assert validate_mesh_args(_megatron_args(mesh_shape="2x8")) == _built("2x8") == (1, 2, 8)
    assert "2x8 grid of 16 CP ranks (as given)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="megatron_mesh"):
        shape = validate_mesh_args(_megatron_args(mesh_heads=None))
    assert shape == _built(per_node=per_node, mesh_heads=None) == (4, 4, 1)
    assert ("4x4x1 grid (heads x rows x cols) of 16 CP ranks (chosen by the planner for 4 CP "
            "ranks per node)") in caplog.text


@pytest.mark.parametrize("local, expected, heads_open", [("8", (1, 4, 4), (4, 4, 1)),
                                                        ("16", (1, 2, 8), (2, 2, 4))])
def test_driver_path_stores_the_shape_it_builds(monkeypatch, local, expected, heads_open) -> None:
    """The driver trains in fp32 on a CPU (--bf16 needs CUDA): the planner sizes fp32."""
    monkeypatch.setenv("WORLD_SIZE", "32")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    flags = ["--num-layers", "2", "--hidden-size", "4096", "--num-attention-heads", "32",
             "--group-query-attention", "--num-query-groups", "8", "--seq-length",
             str(CASE["seq"]), "--vocab-size", "255", "--tensor-model-parallel-size", "2",
             "--context-parallel-size", "16", "--context-parallel-algo", "mesh",
             "--mesh-heads", "1"]
    args = parse_args(flags)
    # the groups are built from args.mesh_shape: a given shape, never chosen again
    assert args.mesh_shape == expected
    built = _built(per_node=cp_ranks_per_node(2), dtype="fp32")
    assert _built(args.mesh_shape) == built == expected
    assert parse_args(flags + ["--mesh-shape", "8x2"]).mesh_shape == (1, 8, 2)
    auto = parse_args(flags[:-2])  # heads open: the planner's 3D choice, stored as built
    assert auto.mesh_shape == _built(per_node=cp_ranks_per_node(2), mesh_heads=None,
                                     dtype="fp32") == heads_open
    assert auto.mesh_heads == heads_open[0]
