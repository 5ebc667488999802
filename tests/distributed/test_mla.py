"""Multi-latent attention's head dims (V of its own head dim dv != d of Q and K) through the
mesh against whole-sequence SDPA in fp64, forward and backward, on gloo ranks: every 2D and
heads x mesh grid, every schedule, GQA, fp32 and bf16; the bytes sent equal the traffic
formula with V's own size. The CUDA calls with dv != d run on meta tensors."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import megatron_mesh as mm
from megatron_mesh.calls.layout import zigzag_split
from megatron_mesh.cost_models.plan import resolve_plan
from megatron_mesh.layer_plan import Schedule

from dist_utils import run_distributed

HQ, HKV, D, DV = 4, 2, 48, 32
SCHEDULES = tuple(str(s) for s in Schedule)


def inputs(seq: int, seed: int) -> dict[str, torch.Tensor]:
    """Whole q [S, 1, hq, d], k [S, 1, hkv, d], v [S, 1, hkv, dv], dout [S, 1, hq, dv], fp64."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"q": (HQ, D), "k": (HKV, D), "v": (HKV, DV), "dout": (HQ, DV)}
    return {n: torch.randn(seq, 1, h, d, generator=g, dtype=torch.float64)
            for n, (h, d) in shapes.items()}


def reference(x: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """out, dq, dk, dv of causal SDPA over the whole sequence in `dtype`, as fp64 [S, 1, h, .]."""
    q, k, v = (x[n].to(dtype).permute(1, 2, 0, 3).requires_grad_() for n in "qkv")
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out.backward(x["dout"].to(dtype).permute(1, 2, 0, 3))
    sbhd = lambda t: t.detach().permute(2, 0, 1, 3).double()  # noqa: E731
    return {"out": sbhd(out), "dq": sbhd(q.grad), "dk": sbhd(k.grad), "dv": sbhd(v.grad)}


def check(grid: mm.MeshGrid, schedule: str, dtype: torch.dtype, seed: int) -> list[str]:
    seq = 8 * grid.cp_size
    x = inputs(seq, seed)
    mine = lambda t: zigzag_split(t, grid.cp_size)[grid.cp_rank]  # noqa: E731
    share = {n: mine(t).to(dtype) for n, t in x.items()}
    q, k, v = (share[n].requires_grad_() for n in "qkv")
    with mm.TrafficCounter() as counter:
        out = mm.mesh_attention(q, k, v, grid, schedule=schedule, backend="torch")
        out.backward(share["dout"])
    got = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    where = f"{grid.shape_text} {schedule} {str(dtype)[6:]} rank {grid.cp_rank}"
    bad = []
    ref = {n: mine(t) for n, t in reference(x, torch.float64).items()}
    same = ({n: mine(t) for n, t in reference(x, dtype).items()}
            if dtype != torch.float32 else None)
    for n, t in ref.items():
        if got[n].shape != t.shape:
            bad.append(f"{where} {n}: shape {tuple(got[n].shape)} != {tuple(t.shape)}")
            continue
        err = (got[n].double() - t).abs().max().item()
        if same is None:
            limit = 1e-5 * max(1.0, t.abs().max().item())
        else:  # twice SDPA's own error in this dtype, plus a few ulps
            limit = (2 * (same[n] - t).abs().max().item()
                     + 2 * torch.finfo(dtype).eps * t.abs().max().item())
        if not err <= limit:
            bad.append(f"{where} {n}: max error {err:.3g} > {limit:.3g}")
    shape = mm.AttentionShape(seq, 1, HQ, HKV, D, dtype.itemsize, v_head_dim=DV)
    plan = resolve_plan(shape, grid.rows, grid.cols, schedule, heads=grid.heads)
    if counter.total_bytes != mm.mesh_traffic(shape, plan).total:
        bad.append(f"{where}: sent {counter.total_bytes} B, formula "
                   f"{mm.mesh_traffic(shape, plan).total} B")
    return bad


def _run(rank: int, world: int) -> list[str]:
    bad = []
    for a in (1, 2, 4):
        if world % a:
            continue
        for r in range(1, world // a + 1):
            if (world // a) % r:
                continue
            grid = mm.MeshGrid.build(rows=r, cols=world // (a * r), heads=a)
            for i, schedule in enumerate(SCHEDULES):
                try:
                    bad += check(grid, schedule, torch.float32, seed=i)
                    if i == r % 3:  # bf16 on one schedule per grid
                        bad += check(grid, schedule, torch.bfloat16, seed=10 + i)
                except Exception as e:  # noqa: BLE001 (reported with the case)
                    bad.append(f"{grid.shape_text} {schedule} rank {rank}: "
                               f"{type(e).__name__}: {e}")
    return bad


@pytest.mark.parametrize("cp_size", [2, 4, 8])
def test_mla_head_dims_exact_on_every_grid(cp_size: int) -> None:
    bad = [b for rank_bad in run_distributed(_run, cp_size) for b in rank_bad]
    assert not bad, "\n".join(bad[:20])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("packed", [False, True])
def test_cuda_calls_take_v_head_dim_on_meta(dtype: torch.dtype, packed: bool) -> None:
    """The CUDA calls (flash, dense or variable-length, with V padded; memory-efficient with
    V's own head dim) run on meta tensors and give out and dv of V's head dim."""
    from megatron_mesh.calls.tile_slices import TileSlices
    from megatron_mesh.kernels.torch_flash import TorchFlashKernel, padded_head_dim

    meta = torch.device("meta")
    documents = TileSlices.documents((0, 3, 8), (0, 3, 8), True, meta) if packed else None
    b = 1 if packed else 2
    q = torch.empty(8, b, 4, D, device=meta, dtype=dtype)
    k = torch.empty(8, b, 2, D, device=meta, dtype=dtype)
    v = torch.empty(8, b, 2, DV, device=meta, dtype=dtype)
    assert padded_head_dim(q, v) == (None if dtype == torch.float32 else D)
    kernels = [TorchFlashKernel()]
    if dtype != torch.float32 and not packed:  # torch's cuDNN op: fp16 / bf16, no documents
        from megatron_mesh.kernels.cudnn import CudnnKernel

        kernels.append(CudnnKernel())  # takes V's head dim as it is (no padding)
    for kernel in kernels:
        kw = {"slices": documents} if packed else {}
        out, lse = kernel.forward(q, k, v, True, 0.25, **kw)
        assert (out.shape, out.dtype, lse.shape) == ((8, b, 4, DV), dtype, (b, 4, 8))
        dq, dk, dv = kernel.backward(out, q, k, v, out, lse, True, 0.25, **kw)
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


def test_cpu_tile_pads_v_exactly() -> None:
    """One CPU tile with dv < d and dv > d against SDPA (fp64), forward and backward."""
    from megatron_mesh.kernels.torch_flash import TorchFlashKernel

    for d, dv in ((48, 32), (16, 24)):
        g = torch.Generator().manual_seed(d)
        q, k, v, dout = (torch.randn(6, 1, h, n, generator=g, dtype=torch.float64)
                         for h, n in ((4, d), (2, d), (2, dv), (4, dv)))
        out, lse = TorchFlashKernel().forward(q, k, v, True, d ** -0.5)
        dq, dk, dvv = TorchFlashKernel().backward(dout, q, k, v, out, lse, True, d ** -0.5)
        ref = reference({"q": q, "k": k, "v": v, "dout": dout}, torch.float64)
        for name, t in (("out", out), ("dq", dq), ("dk", dk), ("dv", dvv)):
            torch.testing.assert_close(t, ref[name], rtol=1e-10, atol=1e-10, msg=name)


def test_bad_v_shapes_are_named() -> None:
    grid = mm.MeshGrid(rows=1, cols=1, cp_rank=0, cp_ranks=(0,), row_group=None, col_group=None)
    q = torch.randn(4, 1, 4, 8)
    with pytest.raises(ValueError, match="must agree in s, b and heads"):
        mm.mesh_attention(q, q[:, :, :2], torch.randn(4, 1, 3, 6), grid)
    # named kernels take V's head dim where they can; where they cannot run, the reason
    with pytest.raises(ValueError, match="backend='cudnn' cannot run here: tensors are on cpu"):
        mm.mesh_attention(q, q, torch.randn(4, 1, 4, 6), grid, backend="cudnn")
    with pytest.raises(ValueError, match="backend='te' cannot run here"):
        mm.mesh_attention(q, q, torch.randn(4, 1, 4, 6), grid, backend="te")


def test_named_backends_take_v_head_dim() -> None:
    """backend='cudnn' gets a kernel for dv != d (multi-latent attention) where both head
    dims fit torch's cuDNN op, and names the head dim where one does not ('meta' stands in
    for a GPU: the choice needs no device)."""
    from megatron_mesh.kernels import get_kernel

    meta = torch.device("meta")
    with pytest.raises(ValueError, match="backend='cudnn' cannot run here: head dim 192"):
        get_kernel("cudnn", meta, torch.bfloat16, 192, v_head_dim=128)
    assert get_kernel("cudnn", meta, torch.bfloat16, 128, v_head_dim=64).name == "cudnn"
    assert get_kernel("auto", meta, torch.bfloat16, 192, v_head_dim=128).name == "torch"
