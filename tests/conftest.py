"""Test tiers and the `gpu` marker.

Tiers, one marker each (``pytest -m unit``, ``-m distributed``, ``-m system``), one folder
each; a test file's tier is the folder it lies in:
  tests/unit         fast, in this process: models, checks, flags, kernels on small tensors;
  tests/distributed  forks gloo ranks or driver jobs on this machine (tests/preloaded.py);
  tests/system       needs outside parts: a Slurm cluster, Megatron-LM checkouts.
A test may name another tier itself (``@pytest.mark.distributed``). A test file outside the
three folders is a collection error, not silently a unit test. Shared helpers (preloaded.py,
dist_utils.py, reference.py, ...) stay in tests/, on the path (pyproject.toml). `gpu` tests
need a CUDA device and are skipped, saying so, without one.

MESH_ALLOWED_SKIPS (scripts/test.sh sets it): phrases separated by ';'. Where it is set, a
test that skips with a reason containing none of them fails the run, listed at the end: in
CI a test may skip only because it "needs a GPU" (Transformer Engine's tests too: TE needs
CUDA, and their reasons say so).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

TIERS = ("unit", "distributed", "system")
TESTS = Path(__file__).resolve().parent


def folder_tier(path: Path) -> str:
    """The tier of the test file at `path`: the tier folder it lies in; UsageError elsewhere."""
    parts = Path(path).resolve().relative_to(TESTS).parts
    if len(parts) < 2 or parts[0] not in TIERS:
        raise pytest.UsageError(
            f"{path}: a test file belongs in tests/unit, tests/distributed or tests/system "
            "(its folder sets its tier)")
    return parts[0]


def tier_of(item: pytest.Item) -> str:
    """The item's own tier marker, else its folder's tier."""
    for tier in TIERS:
        if item.get_closest_marker(tier) is not None:
            return tier
    return folder_tier(item.path)


# Start order for several workers (scripts/test.sh shares files out, in this order, two files
# queued per worker): the two longest files first, one per worker, each followed by quick
# unit files, so that the other worker takes the rest meanwhile; then the next longest.
LONGEST_FIRST = ("test_slurm.py", "test_benchmarks.py")
LONG_NEXT = ("test_training_driver.py", "test_reliability.py", "test_megatron_parity.py",
             "test_cluster_emulation.py", "test_heads.py", "test_mesh_attention.py",
             "test_megatron_lm.py")


def _start_rank(item: pytest.Item) -> int:
    name = item.path.name
    if name in LONGEST_FIRST:
        return LONGEST_FIRST.index(name)
    if name in LONG_NEXT:
        return 3 + LONG_NEXT.index(name)
    return 2 if folder_tier(item.path) == "unit" else 3 + len(LONG_NEXT)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=_start_rank)  # stable: a file's tests keep their order
    for item in items:
        item.add_marker(getattr(pytest.mark, tier_of(item)))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu test: needs a GPU, no CUDA device here "
                            "(scripts/gpu_check.sh runs them on one)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def _allowed_skips() -> list[str]:
    return [p.strip() for p in os.environ.get("MESH_ALLOWED_SKIPS", "").split(";") if p.strip()]


_UNALLOWED_SKIPS: list[str] = []  # "nodeid: reason" of each skip MESH_ALLOWED_SKIPS does not allow


def _check_skip(report: pytest.CollectReport | pytest.TestReport) -> None:
    if not report.skipped or hasattr(report, "wasxfail") or "MESH_ALLOWED_SKIPS" not in os.environ:
        return
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, (tuple, list)) else str(longrepr)
    reason = reason.removeprefix("Skipped: ")
    if not any(phrase in reason for phrase in _allowed_skips()):
        _UNALLOWED_SKIPS.append(f"{report.nodeid}: {reason}")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _check_skip(report)  # with xdist: on each worker and on the controller; the latter decides


def pytest_collectreport(report: pytest.CollectReport) -> None:
    _check_skip(report)  # a whole module skipped at import


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _UNALLOWED_SKIPS and not hasattr(session.config, "workerinput") and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if not _UNALLOWED_SKIPS or hasattr(config, "workerinput"):
        return
    terminalreporter.section("skips not allowed here", red=True)
    terminalreporter.line(f"MESH_ALLOWED_SKIPS={os.environ['MESH_ALLOWED_SKIPS']!r} allows skips "
                          "whose reason contains one of its phrases; these fail the run:")
    for line in _UNALLOWED_SKIPS:
        terminalreporter.line(f"  {line}")


@pytest.fixture(scope="module")
def work(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder for one test module's driver jobs: data, checkpoints, logs."""
    return tmp_path_factory.mktemp(request.module.__name__.rpartition(".")[2]
                                   .removeprefix("test_"))
