"""What tile kernels take, declared (`KernelCaps`): each kernel's caps, kernels refusing
inputs they do not declare, `get_kernel`'s decision from needs, the window check, and a
transparent wrapper that declares its kernel's caps running windows and packed documents
exactly through the mesh (one process, a 1 x 1 grid)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import megatron_mesh as mm
from megatron_mesh.attention import window_backend
from megatron_mesh.calls.tile_slices import TileSlices
from megatron_mesh.emulation import EmulatedKernel
from megatron_mesh.kernels import (
    WINDOWS,
    CudnnKernel,
    KernelCaps,
    TEFusedKernel,
    TorchFlashKernel,
    backend_for,
    get_kernel,
)
from megatron_mesh.kernels.base import folds_diagonal
from megatron_mesh.kernels.caps import NAMES, WHAT

CPU, META = torch.device("cpu"), torch.device("meta")

TABLE = {  # docs/kernels.md's caps table
    "torch": (TorchFlashKernel(), ("documents", "tile_mask", "window", "v_head_dim",
                                   "bottom_right")),
    "cudnn": (CudnnKernel(), ("documents", "tile_mask", "window", "v_head_dim")),
    "te": (TEFusedKernel(), ("documents", "tile_mask", "window", "v_head_dim",
                             "bottom_right")),
    "emulated": (EmulatedKernel(1e12), ("documents", "tile_mask", "window", "v_head_dim")),
}


class Wrapper:
    """A transparent wrapper: its kernel's name and calls, and (when `declare`) its caps;
    records which inputs its calls carried."""

    def __init__(self, inner, declare: bool = True) -> None:
        self.inner, self.name, self.seen = inner, "wrapped", set()
        if declare:
            self.caps = inner.caps

    def forward(self, q, k, v, causal, softmax_scale, *, slices=None):
        if slices is not None:
            self.seen.add(slices.form)
        return self.inner.forward(q, k, v, causal, softmax_scale, slices=slices)

    def backward(self, dout, q, k, v, out, lse, causal, softmax_scale, *, slices=None):
        return self.inner.backward(dout, q, k, v, out, lse, causal, softmax_scale,
                                   slices=slices)


@pytest.mark.parametrize("name", sorted(TABLE))
def test_each_kernel_declares_its_caps(name: str) -> None:
    kernel, names = TABLE[name]
    assert isinstance(kernel.caps, KernelCaps) and kernel.caps.names == names
    assert type(kernel).caps == kernel.caps  # the class says it too (named backends)


def test_caps_values() -> None:
    assert set(WHAT) == set(NAMES), "every capability needs its words"
    caps = KernelCaps.of({"documents", "v_head_dim"})
    assert caps == KernelCaps(documents=True, v_head_dim=True) == KernelCaps.of(caps)
    assert KernelCaps.of("window") == KernelCaps(window=True) and KernelCaps.of(None).names == ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        caps.documents = False
    with pytest.raises(ValueError, match="unknown kernel capabilities \\['sink'\\]"):
        KernelCaps.of({"sink"})
    assert KernelCaps(tile_mask=True).covers(KernelCaps(window=True))  # a band is a mask
    assert not KernelCaps(window=True).covers(WINDOWS)
    assert KernelCaps(v_head_dim=True).missing(KernelCaps(documents=True, v_head_dim=True)) \
        == ("documents",)


def _tile(device: torch.device, dtype: torch.dtype = torch.bfloat16, dv: int = 16):
    make = lambda *s: torch.randn(*s, dtype=dtype) if device == CPU else torch.empty(  # noqa: E731
        *s, dtype=dtype, device=device)
    return make(8, 1, 4, 16), make(8, 1, 2, 16), make(8, 1, 2, dv)


@pytest.mark.parametrize("name", sorted(TABLE))
def test_kernels_refuse_inputs_they_do_not_declare(name: str) -> None:
    """A call carrying documents, a band, an explicit mask or dv != d that the kernel's
    caps do not declare: ValueError naming the kernel and the capability (TE's on CPU
    tensors would otherwise run it on its torch fallback)."""
    kernel, names = TABLE[name]
    device = META if name == "cudnn" else CPU
    q, k, v = _tile(device)
    inputs = {
        "documents": dict(slices=TileSlices.documents((0, 3, 8), (0, 3, 8), False, device)),
        "window": dict(slices=TileSlices.band(8, 8, 2, 0)),
        "tile_mask": dict(slices=TileSlices.of([(0, 4, 0, 8, None, 0), (4, 8, 2, 8, None, None)],
                                               (8, 8), device)),
    }
    for cap, kw in inputs.items():
        if cap in names:
            out, lse = kernel.forward(q, k, v, False, 0.25, **kw)
            kernel.backward(out, q, k, v, out, lse, False, 0.25, **kw)
            continue
        words = "packed documents" if cap == "documents" else "sliding"
        with pytest.raises(ValueError, match=f"tile kernel '{name}' does not take {words}"):
            kernel.forward(q, k, v, False, 0.25, **kw)
        with pytest.raises(ValueError, match=f"tile kernel '{name}' does not take {words}"):
            kernel.backward(q, q, k, v, q, torch.zeros(1, 4, 8), False, 0.25, **kw)
    q, k, v = _tile(device, dv=8)
    out, lse = kernel.forward(q, k, v, True, 0.25)  # every kernel here takes dv != d
    assert out.shape == (8, 1, 4, 8)


def test_te_caps_follow_its_fallbacks() -> None:
    plain = Wrapper(TorchFlashKernel(), declare=False)  # declares nothing: plain tiles
    assert TEFusedKernel(fallback=CudnnKernel()).caps == TEFusedKernel.caps
    te = TEFusedKernel(fallback=plain)  # documents go to torch's ops, dv != d to `plain`
    assert te.caps == KernelCaps(documents=True)
    te = TEFusedKernel(fallback=CudnnKernel(), documents_fallback=plain)
    # bottom-right causal: TE's own, or the fallback's band (cuDNN's causal is top-left)
    assert te.caps == KernelCaps(tile_mask=True, window=True, v_head_dim=False,
                                 bottom_right=True)
    q, k, v = _tile(CPU)
    with pytest.raises(ValueError, match="tile kernel 'te' does not take packed documents"):
        te.forward(q, k, v, True, 0.25,
                   slices=TileSlices.documents((0, 3, 8), (0, 3, 8), True, CPU))


def test_get_kernel_decides_from_needs() -> None:
    both = {"documents", "tile_mask"}
    assert isinstance(get_kernel("auto", CPU, torch.float32, 16, needs=both), TorchFlashKernel)
    assert get_kernel("auto", META, torch.bfloat16, 64, needs=WINDOWS).name == "torch"
    assert get_kernel("cudnn", META, torch.bfloat16, 64, needs={"v_head_dim"}).name == "cudnn"
    # cuDNN's and TE's kernels take windows, masks and documents (as runs, `run_calls`)
    assert get_kernel("cudnn", META, torch.bfloat16, 64, needs=both).name == "cudnn"
    plain = Wrapper(TorchFlashKernel(), declare=False)
    assert get_kernel(plain, CPU, torch.float32, 16) is plain
    for needs, words in (({"documents"}, "packed documents"), (WINDOWS, "sliding windows")):
        with pytest.raises(ValueError, match=f"the tile kernel 'wrapped' does not take {words}"):
            get_kernel(plain, CPU, torch.float32, 16, needs=needs)
    with pytest.raises(ValueError, match="'wrapped' does not take a V head dim of its own"):
        get_kernel(plain, CPU, torch.float32, 16, v_head_dim=8)
    declared = Wrapper(TorchFlashKernel())
    assert get_kernel(declared, CPU, torch.float32, 16, needs=both, v_head_dim=8) is declared


def test_window_backend_is_a_caps_check() -> None:
    """Every kernel 'auto' may build takes windows and masks: 'auto' stays 'auto' (masked
    tiles go to the op the device's choice puts first, not to torch's); a kernel that does
    not declare them is refused."""
    assert window_backend("auto") == "auto" and window_backend("torch") == "torch"
    assert backend_for("auto", {"v_head_dim"}) == "auto"  # every kernel takes it
    for backend in ("cudnn", "te"):
        assert window_backend(backend) == backend
    with pytest.raises(ValueError, match="'wrapped' does not take sliding windows"):
        window_backend(Wrapper(TorchFlashKernel(), declare=False))
    wrapped = Wrapper(TorchFlashKernel())
    assert window_backend(wrapped) is wrapped
    emulated = EmulatedKernel(1e12)
    assert window_backend(emulated) is emulated


def _reference(q, k, v, dout, cu: list[int], window: int):
    """fp64 SDPA over [t, 1, h, d] with each document's causal window of `window` keys
    back; GQA by repeating K/V. Returns out, dq, dk, dv."""
    x = [t.detach().double().requires_grad_() for t in (q, k, v)]
    doc = torch.repeat_interleave(torch.tensor(cu).diff())
    pos = torch.arange(cu[-1]) - torch.tensor(cu)[doc]
    seen = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None]) & (
        pos[:, None] - pos[None, :] <= window)
    groups = q.shape[2] // k.shape[2]
    qb, kb, vb = (t.permute(1, 2, 0, 3) for t in x)
    kb, vb = (t.repeat_interleave(groups, 1) for t in (kb, vb))
    out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=seen).permute(2, 0, 1, 3)
    out.backward(dout.double())
    return [out.detach()] + [t.grad for t in x]


@pytest.fixture
def one_rank():
    """A gloo group of this process alone (the dense schedules gather over it)."""
    if dist.is_initialized():
        pytest.skip("a process group is already set up in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("window,packed", [(3, False), (3, True), (None, True)])
def test_wrapper_declaring_caps_runs_windows_and_documents_exactly(window, packed,
                                                                   one_rank) -> None:
    """mesh_attention on a 1 x 1 grid under a window and / or packed documents: the wrapper
    gets its calls' slices (documents, a band, or windows in documents), gives what
    torch's kernel gives bit for bit, and both equal fp64 SDPA with the mask; a wrapper
    declaring nothing is refused."""
    grid = mm.MeshGrid(rows=1, cols=1, cp_rank=0, cp_ranks=(0,), row_group=None,
                       col_group=None)
    cu = [0, 6, 20, 24] if packed else [0, 24]
    g = torch.Generator().manual_seed(7)
    q, k, v, dout = (torch.randn(24, 1, h, 16, generator=g) for h in (4, 2, 2, 4))
    kw = {} if window is None else dict(window_size=(window, 0))
    if packed:
        kw["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32)
    squeeze = (lambda t: t[:, 0]) if packed else (lambda t: t)  # noqa: E731

    def run(backend):
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        out = mm.mesh_attention(*(squeeze(t) for t in x), grid, backend=backend, **kw)
        out.backward(squeeze(dout))
        return [out.detach().reshape(q.shape)] + [t.grad for t in x]

    wrapped = Wrapper(TorchFlashKernel())
    got, want = run(wrapped), run("torch")
    # documents as a variable-length call, a window as a band, windows in documents as slices
    assert wrapped.seen == {"documents" if window is None else "slices" if packed else "band"}
    ref = _reference(q, k, v, dout, cu, 24 if window is None else window)
    for name, a, b, r in zip(("out", "dq", "dk", "dv"), got, want, ref):
        assert torch.equal(a, b), name
        torch.testing.assert_close(a.double(), r, rtol=1e-4, atol=1e-5, msg=name)
    words = "packed documents" if window is None else "sliding windows"
    with pytest.raises(ValueError, match=f"'wrapped' does not take {words}"):
        run(Wrapper(TorchFlashKernel(), declare=False))


@pytest.mark.parametrize("device,dtype,flash,band,folds", [
    (META, torch.bfloat16, True, False, True),  # CUDA's flash op: its own bottom-right causal
    (META, torch.float16, True, False, True),
    (META, torch.float32, True, False, False),  # the memory-efficient op: would need a mask
    (META, torch.bfloat16, False, False, False),  # flash not chosen: memory-efficient
    (CPU, torch.bfloat16, True, False, False),  # the CPU op's causal is top-left
    (CPU, torch.float32, True, True, True),  # asked for: the band's mask
])
def test_torch_folds_the_diagonal_only_where_no_mask_is_made(device, dtype, flash, band,
                                                             folds) -> None:
    """A grouped tile folds the causal diagonal into a bottom-right call where the kernel
    takes it without a mask of sq x sk (`folds_diagonal`); cuDNN's causal is top-left (no
    `bottom_right`): never; TE's on its own tensors (CUDA fp16 / bf16: "causal_bottom_right"),
    elsewhere as its fallback; a kernel declaring `bottom_right` without saying more takes it
    as declared."""
    q = torch.empty(64, 1, 4, 16, dtype=dtype, device=device)
    kernel = TorchFlashKernel(flash=flash, band_bottom_right=band)
    assert folds_diagonal(kernel, q) is folds
    assert not folds_diagonal(CudnnKernel(), q)
    assert folds_diagonal(TEFusedKernel(fallback=kernel), q) is folds  # not TE's tensors
    declared = Wrapper(CudnnKernel())
    declared.caps = KernelCaps(bottom_right=True)
    assert folds_diagonal(declared, q)
