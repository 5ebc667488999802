"""Test tiers and the `gpu` marker.

Tiers, one marker each (``pytest -m unit``, ``-m distributed``, ``-m system``):
  unit         fast, in this process: models, checks, flags, kernels on small tensors;
  distributed  forks gloo ranks or driver jobs on this machine (tests/preloaded.py);
  system       needs outside parts: a Slurm cluster, Megatron-LM checkouts.
A test file's tier is set below (a test may name another tier itself). `gpu` tests need a
CUDA device and are skipped, saying so, without one.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

TIERS = ("unit", "distributed", "system")
SYSTEM_FILES = {"test_slurm.py", "test_megatron_lm.py"}
DISTRIBUTED_FILES = {
    "test_benchmarks.py", "test_checkpoint_interchange.py", "test_cluster_emulation.py", "test_heads.py",
    "test_host_staging.py", "test_megatron_parity.py", "test_memory.py",
    "test_mesh_attention.py", "test_planner.py", "test_training_driver.py",
    "test_validation.py", "test_packed_documents.py", "test_document_masking.py",
    "test_training_eval.py", "test_window.py", "test_mla.py", "test_megatron_mla.py",
    "test_kernels_meta.py", "test_megatron_window.py", "test_training_window.py",
}
# spawned one-offs in otherwise fast files
DISTRIBUTED_TESTS = {"test_bad_flags_fail_fast_on_every_rank"}


def tier_of(item: pytest.Item) -> str:
    """The item's own tier marker, else its file's tier."""
    for tier in TIERS:
        if item.get_closest_marker(tier) is not None:
            return tier
    name = Path(str(item.fspath)).name
    if name in SYSTEM_FILES:
        return "system"
    if name in DISTRIBUTED_FILES or item.originalname in DISTRIBUTED_TESTS:
        return "distributed"
    return "unit"


# Start order for several workers (scripts/test.sh shares files out, in this order, two files
# queued per worker): the two longest files first, one per worker, each followed by quick
# unit files, so that the other worker takes the rest meanwhile; then the next longest.
LONGEST_FIRST = ("test_slurm.py", "test_benchmarks.py")
LONG_NEXT = ("test_training_driver.py", "test_training_eval.py", "test_reliability.py",
             "test_megatron_parity.py", "test_window.py", "test_document_masking.py",
             "test_cluster_emulation.py", "test_heads.py", "test_mesh_attention.py",
             "test_packed_documents.py", "test_mla.py")


def _start_rank(item: pytest.Item) -> int:
    name = Path(str(item.fspath)).name
    if name in LONGEST_FIRST:
        return LONGEST_FIRST.index(name)
    if name in LONG_NEXT:
        return 3 + LONG_NEXT.index(name)
    return 2 if name not in DISTRIBUTED_FILES | SYSTEM_FILES else 3 + len(LONG_NEXT)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=_start_rank)  # stable: a file's tests keep their order
    for item in items:
        item.add_marker(getattr(pytest.mark, tier_of(item)))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu test: no CUDA device (run scripts/gpu_check.sh on one)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
