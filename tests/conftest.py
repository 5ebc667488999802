"""Markers: `gpu` tests need a CUDA device and are skipped, saying so, without one."""
from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu test: no CUDA device (run scripts/gpu_check.sh on one)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
