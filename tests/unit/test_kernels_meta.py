"""Every CUDA branch of every tile kernel, run on 'meta' tensors (no GPU): the aten ops'
schemas and meta kernels check the argument lists, and the tests check the shapes, dtypes
and strides of what goes in and comes out. Plus the backend choice (`kernels.choice`) for
the GPUs, cuDNN versions, dtypes and head dims that decide it, how many aten ops a tile's
forward (with its merge) and backward dispatch, and every schedule's forward and backward
with every CUDA branch on a one-rank grid.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_mesh.common.merge import empty_accumulators, merge_into
from megatron_mesh.kernels import CudnnKernel, TorchFlashKernel, build
from megatron_mesh.kernels.choice import Choice, DeviceFacts, backend_of, choose

HEADS = {"MHA": (8, 8), "GQA": (8, 2), "MQA": (8, 1)}
VIEWS = {"view", "permute", "unsqueeze", "reshape", "expand", "slice", "select", "as_strided",
         "_unsafe_view", "alias", "t", "transpose", "squeeze", "detach"}


class OpLog(TorchDispatchMode):
    """Records every aten op dispatched: (name, [(shape, stride, dtype) of tensor args])."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, list]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        def desc(a):
            return (tuple(a.shape), a.stride(), a.dtype) if isinstance(a, torch.Tensor) else None
        self.calls.append((func.overloadpacket.__name__, [desc(a) for a in args]))
        return func(*args, **(kwargs or {}))

    def named(self, name: str) -> list[list]:
        return [a for n, a in self.calls if n == name]

    def launches(self) -> list[str]:
        """Ops that are not views (on CUDA each is a kernel launch or an allocation)."""
        return [n for n, _ in self.calls if n not in VIEWS]


def meta(*shape, dtype):
    return torch.empty(*shape, device="meta", dtype=dtype)


def tile(dtype, hq, hkv, sq=128, sk=192, b=2, d=64):
    return (meta(sq, b, hq, d, dtype=dtype), meta(sk, b, hkv, d, dtype=dtype),
            meta(sk, b, hkv, d, dtype=dtype))


KERNELS = {
    "flash": lambda: TorchFlashKernel(flash=True),
    "efficient": lambda: TorchFlashKernel(flash=False),
    "cudnn": CudnnKernel,
}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("op", KERNELS)
def test_cuda_branch_on_meta(op: str, dtype: torch.dtype, heads: str, causal: bool) -> None:
    if op == "cudnn" and dtype == torch.float32:  # refused before any call, saying why
        facts = DeviceFacts.of(torch.device("meta"), want_te=False)
        with pytest.raises(ValueError, match="dtype torch.float32 is not one of float16, bfloat16"):
            choose("cudnn", facts, dtype, 64)
        return
    hq, hkv = HEADS[heads]
    q, k, v = tile(dtype, hq, hkv, sk=128 if causal else 192)
    kernel = KERNELS[op]()
    with OpLog() as fwd_log:
        out, lse = kernel.forward(q, k, v, causal, 0.125)
    assert (out.shape, out.dtype) == (q.shape, dtype)
    assert (lse.shape, lse.dtype) == ((2, hq, 128), torch.float32) and lse.is_contiguous()
    with OpLog() as bwd_log:
        dq, dk, dv = kernel.backward(out, q, k, v, out, lse, causal, 0.125)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert dq.dtype == dk.dtype == dv.dtype == dtype
    uses_flash = op == "flash" and dtype != torch.float32
    fwd_op = {"cudnn": "_scaled_dot_product_cudnn_attention"}.get(
        op, "_scaled_dot_product_flash_attention" if uses_flash
        else "_scaled_dot_product_efficient_attention")
    (fwd_args,) = fwd_log.named(fwd_op)
    (bwd_args,) = bwd_log.named(fwd_op + "_backward")
    # GQA: only the flash op takes the hkv heads as they are; the others get them repeated
    kv_heads = hkv if uses_flash else hq
    assert fwd_args[1][0] == (2, kv_heads, k.shape[0], 64)
    assert bwd_args[2][0] == (2, kv_heads, k.shape[0], 64)
    if uses_flash:  # no copies, no reductions: GQA / MQA inside the flash kernel
        assert fwd_log.launches() == [fwd_op] and bwd_log.launches() == [fwd_op + "_backward"]
    if op == "cudnn":  # one layout: q, k, v, out, dout all [b, h, s, d] views of sbhd-dense
        for t in (bwd_args[0], *bwd_args[1:5]):
            shape, stride, _ = t
            b, h, s, d = shape
            assert stride == (h * d, d, b * h * d, 1), (shape, stride)


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", ["flash", "efficient", "cudnn"])
def test_bottom_right_causal_on_meta(op: str, dtype: torch.dtype, heads: str) -> None:
    """A causal tile of 128 queries and 192 keys (a grouped call, aligned at the bottom
    right): the flash op takes it as its own causal (one op each way, is_causal set); the
    memory-efficient op, whose causal is top-left, takes it as two calls without a mask: the
    first 64 keys full, the last 128 a causal square (`kernels/run_calls.py`); cuDNN's
    causal is top-left, so its kernel refuses it, naming the capability."""
    hq, hkv = HEADS[heads]
    q, k, v = tile(dtype, hq, hkv, sq=128, sk=192)
    kernel = KERNELS[op]()
    if op == "cudnn":
        with pytest.raises(ValueError, match="more keys than queries"):
            kernel.forward(q, k, v, True, 0.125)
        return
    with OpLog() as fwd_log:
        out, lse = kernel.forward(q, k, v, True, 0.125)
    with OpLog() as bwd_log:
        dq, dk, dv = kernel.backward(out, q, k, v, out, lse, True, 0.125)
    assert (out.shape, lse.shape, dq.shape, dk.shape, dv.shape) == (
        q.shape, (2, hq, 128), q.shape, k.shape, v.shape)
    if op == "flash" and dtype != torch.float32:
        fwd_op = "_scaled_dot_product_flash_attention"
        assert fwd_log.launches() == [fwd_op] and bwd_log.launches() == [fwd_op + "_backward"]
        return
    full, square = fwd_log.named("_scaled_dot_product_efficient_attention")
    assert [a[1][0][2] for a in (full, square)] == [64, 128]  # the keys of each call
    assert full[3] is None and square[3] is None  # no mask
    grads = bwd_log.named("_scaled_dot_product_efficient_attention_backward")
    assert [a[2][0][2] for a in grads] == [64, 128] and all(a[4] is None for a in grads)


@pytest.mark.parametrize("d,dv", [(128, 64), (64, 128)])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cudnn_takes_v_head_dim_on_meta(dtype: torch.dtype, heads: str, d: int, dv: int) -> None:
    """Multi-latent attention on torch's cuDNN op: v [sk, b, hkv, dv] goes in as it is (no
    padding), out comes back [sq, b, hq, dv] and dV [sk, b, hkv, dv] (the op's meta function
    reads V's head dim, as its CUDA implementation does)."""
    hq, hkv = HEADS[heads]
    q, k, _ = tile(dtype, hq, hkv, sk=128, d=d)
    v = meta(128, 2, hkv, dv, dtype=dtype)
    kernel = CudnnKernel()
    with OpLog() as fwd_log:
        out, lse = kernel.forward(q, k, v, True, 0.125)
    assert (out.shape, out.dtype, lse.shape) == ((128, 2, hq, dv), dtype, (2, hq, 128))
    with OpLog() as bwd_log:
        dq, dk, dvv = kernel.backward(out, q, k, v, out, lse, True, 0.125)
    assert (dq.shape, dk.shape, dvv.shape) == (q.shape, k.shape, v.shape)
    (fwd_args,) = fwd_log.named("_scaled_dot_product_cudnn_attention")
    (bwd_args,) = bwd_log.named("_scaled_dot_product_cudnn_attention_backward")
    assert [a[0] for a in fwd_args[:3]] == [(2, hq, 128, d), (2, hq, 128, d), (2, hq, 128, dv)]
    # grad_out, q, k, v, out: dout / out / v of V's head dim, [b, h, s, .] views of sbhd
    assert [a[0][-1] for a in bwd_args[:5]] == [dv, d, d, dv, dv]
    for shape, stride, _ in bwd_args[:5]:
        b, h, _, n = shape
        assert stride == (h * n, n, b * h * n, 1), (shape, stride)


def test_cudnn_backward_forces_one_layout_for_out_and_dout() -> None:
    """out / dout given in another layout (bhsd-dense, a transposed view) reach the op laid
    out like q: the graph torch caches on q / k / v strides fits them."""
    q, k, v = tile(torch.bfloat16, 8, 8, sk=128)
    kernel = CudnnKernel()
    out, lse = kernel.forward(q, k, v, False, 0.125)
    odd = meta(2, 8, 128, 64, dtype=torch.bfloat16).permute(2, 0, 1, 3)  # bhsd-dense
    with OpLog() as log:
        kernel.backward(odd, q, k, v, odd, lse, False, 0.125)
    (args,) = log.named("_scaled_dot_product_cudnn_attention_backward")
    strides = {args[i][1] for i in range(5)}
    assert strides == {(8 * 64, 64, 2 * 8 * 64, 1)}, strides


def test_tile_dispatch_counts() -> None:
    """aten ops dispatched by one off-diagonal tile (flash branch, GQA, bf16): forward with
    its merge into the fp32 accumulators, and backward. Fails when a change adds ops."""
    q, k, v = tile(torch.bfloat16, 8, 2, sq=128, sk=128)
    kernel = TorchFlashKernel(flash=True)
    acc_o, acc_l = empty_accumulators(128, 2, 8, 64, torch.device("meta"))
    with OpLog() as fwd:
        out, lse = kernel.forward(q, k, v, False, 0.125)
        merge_into(acc_o, acc_l, out, lse)
    with OpLog() as bwd:
        kernel.backward(out, q, k, v, out, lse, False, 0.125)
    # forward: 1 attention op + the torch merge (logaddexp, 2 x (sub, exp_, nan_to_num_),
    # mul_, addcmul_, copy_; one fused Triton kernel on CUDA instead); backward: lse made
    # contiguous (a no-op) and 1 attention op.
    assert fwd.launches() == ["_scaled_dot_product_flash_attention", "logaddexp", "sub",
                              "exp_", "nan_to_num_", "mul_", "sub", "exp_", "nan_to_num_",
                              "addcmul_", "copy_"], fwd.launches()
    assert bwd.launches() == ["_scaled_dot_product_flash_attention_backward"], bwd.launches()


@pytest.mark.parametrize("op,heads,fwd,bwd", [
    ("cudnn", "MHA", [], []),
    ("cudnn", "GQA", ["clone", "clone"], ["clone", "clone", "sum", "sum"]),
    ("efficient", "MHA", [], ["constant_pad_nd"]),
    ("efficient", "GQA", ["clone", "clone"], ["clone", "clone", "constant_pad_nd", "sum", "sum"]),
])
def test_other_branches_dispatch_counts(op: str, heads: str, fwd: list, bwd: list) -> None:
    """The cuDNN and memory-efficient branches: the attention op plus, for GQA, the K/V
    repeats (2 copies forward, 2 copies + 2 reductions backward); no per-call allocations
    once the kernel has run (the philox placeholders are made once per device)."""
    dtype = torch.float32 if op == "efficient" else torch.bfloat16
    q, k, v = tile(dtype, *HEADS[heads], sq=128, sk=128)
    kernel = KERNELS[op]()
    out, lse = kernel.forward(q, k, v, False, 0.125)
    kernel.backward(out, q, k, v, out, lse, False, 0.125)  # warm: placeholders made once
    with OpLog() as f:
        out, lse = kernel.forward(q, k, v, False, 0.125)
    with OpLog() as b:
        kernel.backward(out, q, k, v, out, lse, False, 0.125)
    name = {"cudnn": "_scaled_dot_product_cudnn_attention"}.get(
        op, "_scaled_dot_product_efficient_attention")
    assert sorted(f.launches()) == sorted(fwd + [name]), f.launches()
    assert sorted(b.launches()) == sorted(bwd + [name + "_backward"]), b.launches()


def test_built_kernels_follow_the_choice() -> None:
    assert isinstance(build(Choice(("cudnn", "flash", "efficient"))), CudnnKernel)
    assert build(Choice(("flash", "efficient"))).flash is True
    assert build(Choice(("efficient",))).flash is False


# ------------------------------------------------------------------ the choice, from facts

A100 = DeviceFacts("cuda", (8, 0), 90100)
H100 = DeviceFacts("cuda", (9, 0), 90500)
V100 = DeviceFacts("cuda", (7, 0), 90100)
T4 = DeviceFacts("cuda", (7, 5), 90100)
OLD_CUDNN = DeviceFacts("cuda", (9, 0), 8907)
NO_TE = "Transformer Engine is not installed"


def _with_te(facts: DeviceFacts, te: str | None) -> DeviceFacts:
    return DeviceFacts(facts.type, facts.capability, facts.cudnn, facts.torch_has_cudnn_op, te)


@pytest.mark.parametrize("facts,dtype,d,ops", [
    (_with_te(H100, None), torch.bfloat16, 128, ("te", "cudnn", "flash", "efficient")),
    (_with_te(H100, NO_TE), torch.bfloat16, 128, ("cudnn", "flash", "efficient")),
    (_with_te(H100, NO_TE), torch.bfloat16, 256, ("flash", "efficient")),
    (_with_te(A100, NO_TE), torch.float16, 64, ("cudnn", "flash", "efficient")),
    (_with_te(A100, None), torch.float32, 64, ("efficient",)),
    (_with_te(V100, None), torch.float16, 64, ("te", "efficient")),  # TE asks per tile
    (_with_te(T4, NO_TE), torch.float16, 64, ("efficient",)),
    (_with_te(OLD_CUDNN, NO_TE), torch.bfloat16, 64, ("flash", "efficient")),
    (_with_te(A100, NO_TE), torch.bfloat16, 100, ("efficient",)),
])
def test_auto_choice(facts: DeviceFacts, dtype: torch.dtype, d: int, ops: tuple) -> None:
    chosen = choose("auto", facts, dtype, d)
    assert chosen.ops == ops
    # the kernel the planner prices for 'auto' on that GPU (--mesh-kernel's names)
    assert backend_of(chosen) == {"te": "te", "cudnn": "cudnn"}.get(ops[0], "torch")
    skipped = dict(chosen.skipped)
    assert set(skipped) | set(ops) >= {"cudnn", "flash", "efficient"}
    if facts.capability < (8, 0):
        assert "sm" in skipped["flash"] and "sm" in skipped["cudnn"]
    if facts.te is not None:
        assert skipped["te"] == NO_TE


def test_explicit_backends_raise_or_lead() -> None:
    assert choose("torch", _with_te(H100, None), torch.bfloat16, 128).ops == ("flash", "efficient")
    assert choose("torch", _with_te(V100, None), torch.float16, 64).ops == ("efficient",)
    assert choose("cudnn", H100, torch.bfloat16, 128).first == "cudnn"
    with pytest.raises(ValueError, match="backend='cudnn' cannot run here: GPU sm70"):
        choose("cudnn", V100, torch.float16, 64)
    with pytest.raises(ValueError, match=r"backend='cudnn' cannot run here: cuDNN 8907"):
        choose("cudnn", OLD_CUDNN, torch.float16, 64)
    with pytest.raises(ValueError, match="backend='te' cannot run here: " + NO_TE):
        choose("te", _with_te(H100, NO_TE), torch.bfloat16, 128)
    with pytest.raises(ValueError, match="backend='te' cannot run here: dtype torch.float32"):
        choose("te", _with_te(H100, None), torch.float32, 128)
    assert choose("auto", DeviceFacts("cpu"), torch.bfloat16, 128).ops == ("cpu",)
    assert choose("auto", DeviceFacts("meta"), torch.float32, 64).ops == ("efficient",)


@pytest.mark.parametrize("facts,d,dv,ops", [
    (_with_te(H100, None), 192, 128, ("te", "flash", "efficient")),  # TE asks per tile
    (_with_te(H100, NO_TE), 128, 64, ("cudnn", "flash", "efficient")),
    (_with_te(H100, NO_TE), 64, 128, ("cudnn", "flash", "efficient")),
    (_with_te(H100, NO_TE), 192, 128, ("flash", "efficient")),  # flash pads V to 192
    (_with_te(H100, NO_TE), 128, 192, ("flash", "efficient")),
    (_with_te(H100, NO_TE), 128, 100, ("flash", "efficient")),  # cuDNN: dv 100
    (_with_te(H100, NO_TE), 256, 320, ("efficient",)),  # flash would pad to 320 > 256
])
def test_auto_choice_with_v_head_dim(facts: DeviceFacts, d: int, dv: int, ops: tuple) -> None:
    """V of its own head dim (multi-latent attention): the cuDNN op checks Q/K's and V's
    head dims, the flash op the one both are padded to; TE's query is asked per tile."""
    chosen = choose("auto", facts, torch.bfloat16, d, dv)
    assert chosen.ops == ops
    skipped = dict(chosen.skipped)
    if "cudnn" in skipped:
        assert "head dim" in skipped["cudnn"]


def test_named_cudnn_with_v_head_dim() -> None:
    assert choose("cudnn", H100, torch.bfloat16, 128, 64).first == "cudnn"
    assert choose("cudnn", H100, torch.bfloat16, 64, 64).first == "cudnn"
    with pytest.raises(ValueError, match="backend='cudnn' cannot run here: V head dim 192"):
        choose("cudnn", H100, torch.bfloat16, 128, 192)
    with pytest.raises(ValueError, match="backend='cudnn' cannot run here: head dim 192"):
        choose("cudnn", H100, torch.bfloat16, 192, 128)
    with pytest.raises(ValueError, match="V head dim 100"):
        choose("cudnn", H100, torch.bfloat16, 64, 100)
    assert choose("te", _with_te(H100, None), torch.bfloat16, 192, 128).first == "te"
    assert cudnn_kernel_unsupported(128, 64) is None
    assert "V head dim 136" in cudnn_kernel_unsupported(128, 136)


def cudnn_kernel_unsupported(d: int, dv: int) -> str | None:
    from megatron_mesh.kernels.cudnn import unsupported

    return unsupported(torch.device("meta"), torch.bfloat16, d, dv)


def test_get_kernel_with_v_head_dim() -> None:
    from megatron_mesh.kernels import get_kernel

    meta_dev = torch.device("meta")
    assert get_kernel("cudnn", meta_dev, torch.bfloat16, 128, v_head_dim=64).name == "cudnn"
    assert get_kernel("auto", meta_dev, torch.bfloat16, 192, v_head_dim=128).name == "torch"
    with pytest.raises(ValueError, match="V head dim 192"):
        get_kernel("cudnn", meta_dev, torch.bfloat16, 64, v_head_dim=192)


def test_te_is_not_imported_unless_it_can_be_chosen() -> None:
    import sys

    from megatron_mesh.kernels import get_kernel

    get_kernel("cudnn", torch.device("meta"), torch.bfloat16, 64)
    get_kernel("torch", torch.device("cpu"), torch.bfloat16, 64)
    assert "transformer_engine" not in sys.modules


# ------------------------------------------------------------- every schedule, on meta

def _schedules_on_meta(rank: int, world: int) -> list[tuple]:
    """Each schedule's forward and backward, with every CUDA kernel branch, on meta tensors,
    on a 1 x 1 grid (one rank: no collective carries data, every tile call is made)."""
    import megatron_mesh as mm
    from megatron_mesh.attention import finish_rows, grad_dtypes
    from megatron_mesh.calls.layout import AttentionMask
    from megatron_mesh.cost_models.plan import GradDtype
    from megatron_mesh.schedules import gathered, streamed_kv, streamed_q
    from megatron_mesh.schedules.delta import attention_delta

    grid = mm.MeshGrid.build(rows=1, cols=1)
    causal = AttentionMask(True)  # one rank's dense causal sequence
    rows = []
    for sched in (gathered, streamed_kv, streamed_q):
        for op, make in KERNELS.items():
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                if op == "cudnn" and dtype == torch.float32:
                    continue
                for hq, hkv in HEADS.values():
                    q, k, v = tile(dtype, hq, hkv, sq=64, sk=64)
                    kernel = make()
                    with OpLog() as log:
                        out, lse = finish_rows(*sched.forward(q, k, v, grid, causal, 0.125,
                                                              kernel), dtype)
                        grads = sched.backward(out, q, k, v, out, lse,
                                               attention_delta(out, out), grid, causal, 0.125,
                                               kernel,
                                               grad_dtypes(GradDtype.MIXED, dtype))
                    calls = sorted({n for n, _ in log.calls if n.startswith("_scaled_dot")})
                    rows.append((sched.__name__.rsplit(".", 1)[1], op, str(dtype), hq, hkv,
                                 tuple(out.shape), str(out.dtype), tuple(lse.shape),
                                 str(lse.dtype), [(tuple(g.shape), str(g.dtype)) for g in grads],
                                 calls))
    return rows


@pytest.mark.distributed  # one gloo rank, forked
def test_every_schedule_with_every_cuda_branch_on_meta() -> None:
    from dist_utils import run_distributed

    (rows,) = run_distributed(_schedules_on_meta, 1)
    assert len(rows) == 3 * (3 + 3 + 2) * 3
    for sched, op, dtype, hq, hkv, out_shape, out_dtype, lse_shape, lse_dtype, grads, calls in rows:
        what = f"{sched} {op} {dtype} {hq}/{hkv}"
        assert out_shape == (64, 2, hq, 64) and out_dtype == dtype, what
        assert lse_shape == (2, hq, 64) and lse_dtype == "torch.float32", what
        assert grads == [((64, 2, hq, 64), dtype), ((64, 2, hkv, 64), dtype),
                         ((64, 2, hkv, 64), dtype)], what
        base = {"cudnn": "_scaled_dot_product_cudnn_attention"}.get(
            op, "_scaled_dot_product_flash_attention" if op == "flash" and dtype != "torch.float32"
            else "_scaled_dot_product_efficient_attention")
        assert calls == [base, base + "_backward"], what


# ------------------------------------------------------- the heads relayout, on meta

@pytest.mark.parametrize("layout", ["zigzag", "documents", "placed"])
def test_heads_relayout_on_meta_and_its_inverse_on_cpu(layout: str) -> None:
    """The one-message heads all-to-all's local layout steps (`heads._to_pieces` before the
    send, `heads._to_sequence` after the receive: zigzag, packed documents with their index
    on the tensors' device, placed rows) run on meta tensors as on a GPU (no host copy of a
    device index), and on the CPU `_to_sequence` undoes `_to_pieces` exactly."""
    from types import SimpleNamespace

    from megatron_mesh.masks.document_placer import place_documents
    from megatron_mesh.masks.documents import Documents
    from megatron_mesh.runtime import heads

    a, cp_size, s = 2, 4, 16  # A = 2 ranks of a heads group, each holding s rows
    grid = SimpleNamespace(heads=a, cp_size=cp_size)  # what the layout steps read
    cu = torch.tensor([0, 24, 40, 64], dtype=torch.int32)
    documents = {"zigzag": None, "documents": Documents.from_cu_seqlens(cu),
                 "placed": place_documents(cu, cp_size)}[layout]
    for device in ("meta", "cpu"):
        y = torch.randn(a * s, 1, 3, 8).to(device)  # b = 1: packed documents are THD
        pieces = y.new_empty(a, s, 1, 3, 8)
        heads._to_pieces(y, pieces, grid, documents)
        back = torch.empty_like(y)
        heads._to_sequence(pieces, back, grid, documents)
        assert pieces.shape == (a, s, 1, 3, 8) and back.shape == y.shape
        if device == "cpu":
            assert torch.equal(back, y)
            assert not torch.equal(pieces.reshape(y.shape), y) or layout == "placed"
