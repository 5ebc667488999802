"""The registry of third-party patches (megatron_mesh/megatron/patches.py): every patched
name exists in the installed torch / megatron-core, each patch is undone on exit (also
when the block raises), and a patch whose name is gone fails loudly."""
from __future__ import annotations

import importlib
from dataclasses import replace

import pytest
import torch

from megatron_mesh.megatron import patches
from megatron_mesh.megatron.cpu import CPU_PATCHES, megatron_on_cpu


@pytest.mark.parametrize("name", sorted(patches.PATCHES))
def test_every_patched_name_exists_in_the_installed_packages(name):
    patch = patches.PATCHES[name]
    module = importlib.import_module(patch.module)
    assert hasattr(module, patch.attribute), (
        f"{name} is gone from {patch.package} {patch.version()}: revisit the patch ({patch.why})")
    assert patch.in_checked_range(), (
        f"{patch.package} {patch.version()} is outside {patch.checked} for {name}")


def _current(names):
    return {n: getattr(importlib.import_module(patches.PATCHES[n].module),
                       patches.PATCHES[n].attribute) for n in names}


@pytest.mark.parametrize("raises", [False, True])
def test_patches_are_restored_on_exit(raises):
    names = sorted(patches.PATCHES)
    before = _current(names)
    queue = object()
    queue_name = "megatron.core.dist_checkpointing.strategies.filesystem_async._results_queue"
    with pytest.raises(RuntimeError, match="boom") if raises else _nothing():
        with patches.patched(*names, values={queue_name: queue}):
            during = _current(names)
            assert all(during[n] is not before[n] for n in names if n != queue_name)
            assert during[queue_name] is queue
            assert torch.cuda.current_device() == "cpu"
            torch.cuda.synchronize()  # a no-op, also without CUDA
            if raises:
                raise RuntimeError("boom")
    after = _current(names)
    assert all(after[n] is before[n] for n in names)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_a_patch_whose_name_is_gone_fails_naming_it(monkeypatch):
    gone = replace(patches.PATCHES["torch.cuda.synchronize"], attribute="no_such_function")
    monkeypatch.setitem(patches.PATCHES, "torch.cuda.no_such_function", gone)
    real = torch.cuda.synchronize
    with pytest.raises(RuntimeError, match="patch torch.cuda.no_such_function: torch .* has no "
                                           "no_such_function in torch.cuda"):
        with patches.patched("torch.cuda.synchronize", "torch.cuda.no_such_function"):
            pass
    assert torch.cuda.synchronize is real  # the patches applied before it were undone


def test_a_version_outside_the_checked_range_warns_once(monkeypatch):
    old = replace(patches.PATCHES["torch.cuda.current_stream"], checked=("0.1", "0.2"))
    monkeypatch.setitem(patches.PATCHES, "torch.cuda.current_stream", old)
    monkeypatch.setattr(patches, "_warned", set())
    with pytest.warns(UserWarning, match="outside the versions it was checked against"):
        with patches.patched("torch.cuda.current_stream"):
            pass


@pytest.mark.skipif(torch.cuda.is_available(), reason="megatron_on_cpu is a no-op with CUDA")
def test_megatron_on_cpu_leaves_nothing_patched():
    before = _current(CPU_PATCHES)
    with megatron_on_cpu():
        assert torch.empty(2, device=torch.cuda.current_device()).device.type == "cpu"
        assert torch.empty(2, device="cuda").device.type == "cpu"
        assert torch.empty(2, device=0).device.type == "cpu"
    assert _current(CPU_PATCHES) == before
    with pytest.raises((RuntimeError, AssertionError)):
        torch.cuda.current_device()  # torch's own again: no CUDA here
