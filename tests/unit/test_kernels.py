"""Tile kernels against torch SDPA, one tile at a time.

CPU: the torch kernel on strided inputs (head-dim stride 2 or s, broadcast batches, expanded
gradients) equals the same kernel on dense copies, bit for bit; the CUDA calls of the torch
and cuDNN kernels are checked for arguments and shapes on 'meta' tensors; `get_kernel`'s
choices and errors. GPU (`gpu` marker): every kernel x dtype x MHA / GQA / MQA x causal x
input layout against SDPA in fp64, to the error SDPA itself makes in that dtype.
"""
from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

from megatron_mesh.kernels import CudnnKernel, TorchFlashKernel, get_kernel
from megatron_mesh.kernels import cudnn as cudnn_kernel
from megatron_mesh.kernels.choice import DeviceFacts, cudnn_unsupported

from reference import LAYOUTS, as_layout

GPU = torch.device("cuda")
HEADS = {"MHA": (4, 4), "GQA": (4, 2), "MQA": (4, 1)}


def tile_inputs(sq: int, sk: int, b: int, hq: int, hkv: int, d: int, seed: int = 0,
                equal_batches: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    nb = 1 if equal_batches else b
    x = {"q": torch.randn(sq, nb, hq, d, generator=g), "k": torch.randn(sk, nb, hkv, d, generator=g),
         "v": torch.randn(sk, nb, hkv, d, generator=g), "dout": torch.randn(sq, nb, hq, d, generator=g)}
    return {n: t.expand(t.shape[0], b, *t.shape[2:]).contiguous() for n, t in x.items()}


def run_tile(kernel, x: dict[str, torch.Tensor], causal: bool, scale: float) -> dict[str, torch.Tensor]:
    out, lse = kernel.forward(x["q"], x["k"], x["v"], causal, scale)
    dq, dk, dv = kernel.backward(x["dout"], x["q"], x["k"], x["v"], out, lse, causal, scale)
    return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


@pytest.mark.parametrize("layout", [lay for lay in LAYOUTS if lay != "dense"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_torch_kernel_strided_equals_dense(layout: str, dtype: torch.dtype) -> None:
    x = {n: t.to(dtype) for n, t in tile_inputs(8, 12, 2, 4, 2, 16, seed=1,
                                                 equal_batches=True).items()}
    for causal in (False, True):
        xs = {n: t[:8] for n, t in x.items()} if causal else x  # causal tiles are square
        dense = run_tile(TorchFlashKernel(), xs, causal, 0.25)
        strided = run_tile(TorchFlashKernel(), {n: as_layout(t, layout) for n, t in xs.items()},
                           causal, 0.25)
        for n in dense:
            assert torch.equal(dense[n], strided[n]), f"{layout} {dtype} causal={causal} {n}"


def test_cpu_expanded_gradient_is_read_as_its_values() -> None:
    """dout of out.sum() arrives as a stride-0 expansion of a scalar."""
    x = tile_inputs(8, 8, 1, 2, 2, 16, seed=2)
    kernel = TorchFlashKernel()
    out, lse = kernel.forward(x["q"], x["k"], x["v"], True, 0.25)
    ones = torch.ones(()).expand_as(out)
    got = kernel.backward(ones, x["q"], x["k"], x["v"], out, lse, True, 0.25)
    want = kernel.backward(ones.contiguous(), x["q"], x["k"], x["v"], out, lse, True, 0.25)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kernel", [TorchFlashKernel(), CudnnKernel()], ids=["torch", "cudnn"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_calls_on_meta_tensors(kernel, dtype: torch.dtype) -> None:
    """The CUDA ops' arguments (schemas) and the shapes / dtypes the kernels return."""
    if kernel.name == "cudnn" and dtype == torch.float32:  # refused before any call, saying why
        assert cudnn_kernel.unsupported(torch.device("meta"), dtype, 64) == (
            "dtype torch.float32 is not one of float16, bfloat16")
        return
    sq, sk, b, hq, hkv, d = 16, 24, 2, 4, 2, 64
    meta = lambda *s, dt=dtype: torch.empty(*s, device="meta", dtype=dt)  # noqa: E731
    q, k, v = meta(sq, b, hq, d), meta(sk, b, hkv, d), meta(sk, b, hkv, d)
    for causal in (False, True):
        kk, vv = (k[:sq], v[:sq]) if causal else (k, v)
        out, lse = kernel.forward(q, kk, vv, causal, 0.1)
        assert (out.shape, out.dtype) == ((sq, b, hq, d), dtype)
        assert (lse.shape, lse.dtype) == ((b, hq, sq), torch.float32)
        dq, dk, dv = kernel.backward(out, q, kk, vv, out, lse, causal, 0.1)
        assert dq.shape == q.shape and dk.shape == dv.shape == kk.shape


def test_get_kernel_choices_and_errors() -> None:
    cpu = torch.device("cpu")
    assert get_kernel("auto", cpu, torch.bfloat16, 128).name == "torch"
    assert get_kernel("torch", cpu).name == "torch"
    with pytest.raises(ValueError, match="backend='cudnn' cannot run here: tensors are on cpu"):
        get_kernel("cudnn", cpu, torch.bfloat16, 128)
    with pytest.raises(ValueError, match="backend='te' cannot run here"):
        get_kernel("te", cpu, torch.bfloat16, 128)
    with pytest.raises(ValueError, match="'flash' is not one of auto, torch, cudnn, te"):
        get_kernel("flash", cpu)
    meta = torch.device("meta")
    assert cudnn_kernel.unsupported(meta, torch.bfloat16, 128) is None
    assert "float32" in cudnn_kernel.unsupported(meta, torch.float32, 128)
    assert "head dim 100" in cudnn_kernel.unsupported(meta, torch.bfloat16, 100)


# ------------------------------------------------------------------------------- GPU

# The refusals the GPU cases expect, (backend, dtype, head dim, V head dim) -> the reason
# get_kernel's ValueError gives; each is asserted. Any other refusal fails the case.
EXPECTED_REFUSALS = {
    ("cudnn", torch.float32, 64, 64): "dtype torch.float32 is not one of float16, bfloat16",
    ("te", torch.float32, 64, 64): "dtype torch.float32: TE's fused attention takes float16 / bfloat16",
    **{("cudnn", dt, 192, 128): "head dim 192 is not a multiple of 8 up to 128"
       for dt in (torch.bfloat16, torch.float16)},
}


def kernel_or_refusal(backend: str, dtype: torch.dtype, d: int, dv: int | None = None):
    """get_kernel's kernel for the case, or None where EXPECTED_REFUSALS names its refusal
    (asserted). Skips, saying why, only where this GPU cannot run the backend at all (no
    Transformer Engine; cuDNN's GPU generation or version)."""
    facts = DeviceFacts.of(GPU, want_te=backend == "te")
    cannot = {"te": facts.te, "cudnn": cudnn_unsupported(facts, torch.bfloat16, 64)}.get(backend)
    if cannot is not None:
        pytest.skip(f"backend={backend!r} cannot run on this GPU: {cannot}")
    expected = EXPECTED_REFUSALS.get((backend, dtype, d, d if dv is None else dv))
    if expected is None:
        return get_kernel(backend, GPU, dtype, d, v_head_dim=dv)  # a refusal here fails
    with pytest.raises(ValueError, match=re.escape(expected)):
        get_kernel(backend, GPU, dtype, d, v_head_dim=dv)
    return None


def sdpa(x: dict[str, torch.Tensor], causal: bool, scale: float, dtype: torch.dtype,
         input_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """SDPA of x (rounded to input_dtype) computed in `dtype`: out, dq, dk, dv as fp64."""
    q, k, v = (x[n].to(input_dtype).to(dtype).permute(1, 2, 0, 3).requires_grad_()
               for n in ("q", "k", "v"))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
    out.backward(x["dout"].to(input_dtype).to(dtype).permute(1, 2, 0, 3))
    sbhd = lambda t: t.detach().permute(2, 0, 1, 3).double()  # noqa: E731
    return {"out": sbhd(out), "dq": sbhd(q.grad), "dk": sbhd(k.grad), "dv": sbhd(v.grad)}


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", ["torch", "cudnn", "te"])
def test_gpu_kernel_matches_sdpa_fp64(backend: str, dtype: torch.dtype, heads: str, causal: bool,
                                      layout: str) -> None:
    device = GPU
    hq, hkv = HEADS[heads]
    sq, sk, b, d = 256, 256 if causal else 384, 2, 64
    kernel = kernel_or_refusal(backend, dtype, d)
    if kernel is None:
        return  # refused as expected, saying why
    x = tile_inputs(sq, sk, b, hq, hkv, d, seed=3, equal_batches=layout == "broadcast_batch")
    scale = 1 / math.sqrt(d)
    on_gpu = {n: as_layout(t.to(dtype).to(device), layout) for n, t in x.items()}
    got = run_tile(kernel, on_gpu, causal, scale)
    cuda_x = {n: t.to(device) for n, t in x.items()}
    ref = sdpa(cuda_x, causal, scale, torch.float64, dtype)
    same = sdpa(cuda_x, causal, scale, dtype, dtype)
    q64, k64 = (cuda_x[n].to(dtype).double() for n in ("q", "k"))
    scores = torch.einsum("sbhd,tbhd->bhst", q64, k64.repeat_interleave(hq // hkv, 2)) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(sq, sk, dtype=torch.bool, device=device).triu(1),
                                    float("-inf"))
    lse_ref = torch.logsumexp(scores, -1)
    assert got["out"].dtype == dtype and got["lse"].dtype == torch.float32
    assert (got["lse"].double() - lse_ref).abs().max().item() < 1e-3
    ulp = torch.finfo(dtype).eps
    for n, want in ref.items():
        err = (got[n].double() - want).abs().max().item()
        base = (same[n] - want).abs().max().item()
        tol = 1e-5 * max(1.0, want.abs().max().item()) if dtype == torch.float32 else (
            2 * base + 2 * ulp * want.abs().max().item())
        assert err <= tol, f"{backend} {dtype} {heads} causal={causal} {layout} {n}: {err:.3g} > {tol:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("d,dv", [(128, 64), (64, 128), (192, 128)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", ["auto", "cudnn", "te"])
def test_gpu_kernel_v_head_dim_matches_sdpa_fp64(backend: str, dtype: torch.dtype,
                                                 causal: bool, d: int, dv: int) -> None:
    """Multi-latent attention (V of its own head dim dv != d) on the kernel each backend
    gives for (d, dv) (its refusal asserted where EXPECTED_REFUSALS names one): out, dq, dk,
    dv against fp64 SDPA, within 2x SDPA's own error in the same dtype."""
    kernel = kernel_or_refusal(backend, dtype, d, dv)
    if kernel is None:
        return  # refused as expected, saying why
    hq, hkv, sq, sk, b = 4, 2, 256, 256 if causal else 384, 2
    g = torch.Generator().manual_seed(7)
    x = {n: torch.randn(s, b, h, e, generator=g, dtype=torch.float64).to(GPU)
         for n, (s, h, e) in {"q": (sq, hq, d), "k": (sk, hkv, d), "v": (sk, hkv, dv),
                               "dout": (sq, hq, dv)}.items()}
    scale = 1 / math.sqrt(d)
    got = run_tile(kernel, {n: t.to(dtype) for n, t in x.items()}, causal, scale)
    ref = sdpa(x, causal, scale, torch.float64, dtype)
    same = sdpa(x, causal, scale, dtype, dtype)
    assert got["out"].shape == (sq, b, hq, dv) and got["dv"].shape == (sk, b, hkv, dv)
    ulp = torch.finfo(dtype).eps
    for n, want in ref.items():
        err = (got[n].double() - want).abs().max().item()
        tol = 2 * (same[n] - want).abs().max().item() + 2 * ulp * want.abs().max().item()
        assert err <= tol, f"{kernel.name} {dtype} causal={causal} d={d} dv={dv} {n}: {err:.3g} > {tol:.3g}"
