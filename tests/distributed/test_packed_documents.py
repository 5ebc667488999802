"""Packed documents (THD) through the mesh against whole-sequence SDPA with an explicit
block-diagonal (causal) mask in fp64, forward and backward, on gloo ranks.

One spawned group per CP size runs every 2D and heads x mesh grid, every schedule, and
documents of random lengths, of exactly 2P tokens, one long beside many short, one
document (= plain causal), padded lengths, MHA / GQA / MQA, fp32 and bf16. Each case also
checks that the bytes sent equal those of the dense layout (`mesh_traffic`).
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

import megatron_mesh as mm
from megatron_mesh.kernels import TorchFlashKernel
from megatron_mesh.masks.documents import Documents, thd_merge, thd_partition_indices, thd_split

from dist_utils import run_distributed
from reference import beyond_tolerance, partial_results


@dataclass(frozen=True)
class DocCase:
    lengths: tuple[int, ...]  # actual document lengths
    padded: tuple[int, ...]  # padded lengths (multiples of 2P)
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 8
    causal: bool = True
    dtype: torch.dtype = torch.float32
    schedule: str = "streamed"
    seed: int = 0

    @property
    def documents(self) -> Documents:
        cum = lambda xs: [0] + [sum(xs[:i + 1]) for i in range(len(xs))]  # noqa: E731
        return Documents.from_cu_seqlens(torch.tensor(cum(self.lengths), dtype=torch.int32),
                                         torch.tensor(cum(self.padded), dtype=torch.int32))

    def __str__(self) -> str:
        return (f"docs={self.lengths}/{self.padded} hq={self.q_heads} hkv={self.kv_heads} "
                f"causal={self.causal} {str(self.dtype)[6:]} {self.schedule}")


def doc_cases(cp_size: int) -> list[DocCase]:
    """Documents of every kind the layout meets, on one CP size."""
    unit = 2 * cp_size
    rnd = random.Random(cp_size)
    padded = tuple(unit * rnd.randint(1, 3) for _ in range(4))
    actual = tuple(n - rnd.randint(0, unit - 1) for n in padded)
    return [
        DocCase(padded, padded),  # random lengths, unpadded
        DocCase((6 * unit,), (6 * unit,), kv_heads=1, seed=1),  # one document: plain causal
        DocCase((unit,) * 3, (unit,) * 3, q_heads=2, kv_heads=2, seed=2),  # exactly 2P each
        DocCase((5 * unit, unit, unit, unit), (5 * unit, unit, unit, unit), seed=3),  # long + short
        DocCase(actual, padded, seed=4, schedule="gathered"),  # padded lengths
        DocCase((1, unit - 1, 3 * unit), (unit, unit, 3 * unit), seed=5, schedule="streamed_q"),
        DocCase(padded, padded, causal=False, seed=6, schedule="streamed_kv"),
        DocCase(actual, padded, dtype=torch.bfloat16, seed=7),
    ]


def doc_inputs(case: DocCase) -> dict[str, torch.Tensor]:
    """Whole packed q, k, v, dout [T, h, d] in fp64 (dout 0 on padding tokens)."""
    g = torch.Generator().manual_seed(case.seed)
    t, d = case.documents.total, case.head_dim
    x = {"q": torch.randn(t, case.q_heads, d, generator=g, dtype=torch.float64),
         "k": torch.randn(t, case.kv_heads, d, generator=g, dtype=torch.float64),
         "v": torch.randn(t, case.kv_heads, d, generator=g, dtype=torch.float64),
         "dout": torch.randn(t, case.q_heads, d, generator=g, dtype=torch.float64)}
    x["dout"][~real_tokens(case.documents)] = 0
    return x


def real_tokens(documents: Documents) -> torch.Tensor:
    """[T] bool: True for a document's tokens, False for padding."""
    real = torch.zeros(documents.total, dtype=torch.bool)
    for start, n in zip(documents.cu_padded, documents.lengths):
        real[start:start + n] = True
    return real


def document_mask(documents: Documents, causal: bool) -> torch.Tensor:
    """[T, T] bool: query i may see key j (same document, both real, j <= i if causal).
    A padding query sees only itself, so that SDPA stays finite; its output is zeroed."""
    doc = torch.zeros(documents.total, dtype=torch.int64)
    for i, (start, n) in enumerate(zip(documents.cu_padded, documents.padded_lengths)):
        doc[start:start + n] = i
    real = real_tokens(documents)
    seen = (doc[:, None] == doc[None, :]) & real[:, None] & real[None, :]
    if causal:
        seen &= torch.ones_like(seen).tril()
    return seen | torch.diag(~real)


def reference(case: DocCase, x: dict[str, torch.Tensor], dtype: torch.dtype
              ) -> dict[str, torch.Tensor]:
    """out, dq, dk, dv of SDPA over the whole packed sequence with the explicit document
    mask, in `dtype`, returned in fp64."""
    q, k, v = (x[n].to(dtype).transpose(0, 1).unsqueeze(0).requires_grad_()
               for n in ("q", "k", "v"))
    mask = document_mask(case.documents, case.causal)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    real = real_tokens(case.documents)[None, None, :, None]
    out = out * real  # padding tokens: output 0
    out.backward(x["dout"].to(dtype).transpose(0, 1).unsqueeze(0))
    thd = lambda t: t.detach()[0].transpose(0, 1).double()  # noqa: E731
    return {"out": thd(out), "dq": thd(q.grad), "dk": thd(k.grad), "dv": thd(v.grad)}


def check_case(case: DocCase, grid: mm.MeshGrid, backend: object = "torch") -> list[str]:
    """Failures of one case on this rank: exactness and bytes."""
    x = doc_inputs(case)
    docs = case.documents
    share = {n: thd_split(t, docs, grid.cp_size)[grid.cp_rank].to(case.dtype)
             for n, t in x.items()}
    q, k, v = (share[n].requires_grad_() for n in ("q", "k", "v"))
    cu = torch.tensor([0] + [sum(case.lengths[:i + 1]) for i in range(len(case.lengths))],
                      dtype=torch.int32)
    cu_padded = torch.tensor(docs.cu_padded, dtype=torch.int32)
    with mm.TrafficCounter() as counter:
        out = mm.mesh_attention(q, k, v, grid, causal=case.causal, schedule=case.schedule,
                                cu_seqlens=cu, cu_seqlens_padded=cu_padded, backend=backend)
        out.backward(share["dout"])
    got = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    folded = "" if backend == "torch" else " diagonal folded"
    where = f"{case}{folded} grid {grid.shape_text} rank {grid.cp_rank}"
    bad = []
    if out.shape != q.shape or out.dtype != case.dtype:
        bad.append(f"{where}: out {tuple(out.shape)} {out.dtype}")
    mine = lambda t: thd_split(t, docs, grid.cp_size)[grid.cp_rank]  # noqa: E731
    ref = {n: mine(t) for n, t in reference(case, x, torch.float64).items()}
    same = {n: mine(t) for n, t in reference(case, x, case.dtype).items()}
    same32 = ({n: mine(t) for n, t in reference(case, x, torch.float32).items()}
              if case.dtype != torch.float32 else None)
    bad += beyond_tolerance(got, ref, same, case.dtype, where, partial_results(grid), same32)
    padding = ~mine(real_tokens(docs))
    if padding.any() and (got["out"][padding].abs().max() != 0 or got["dq"][padding].abs().max()
                          != 0 or got["dk"][padding].abs().max() != 0):
        bad.append(f"{where}: padding tokens have nonzero output or gradients")
    # the same bytes as the dense layout of the same padded length (one sequence of T tokens)
    shape = mm.AttentionShape(docs.total, 1, case.q_heads, case.kv_heads, case.head_dim,
                              torch.finfo(case.dtype).bits // 8)
    from megatron_mesh.cost_models.plan import resolve_plan
    plan = resolve_plan(shape, grid.rows, grid.cols, case.schedule, heads=grid.heads)
    if counter.total_bytes != mm.mesh_traffic(shape, plan).total:
        bad.append(f"{where}: sent {counter.total_bytes} B, dense layout "
                   f"{mm.mesh_traffic(shape, plan).total} B")
    return bad


def grids(cp_size: int) -> list[tuple[int, int, int]]:
    """Every (A, R, C) with A x R x C = P and A in 1, 2, 4."""
    out = []
    for a in (1, 2, 4):
        if cp_size % a:
            continue
        for r in range(1, cp_size // a + 1):
            if cp_size % (a * r) == 0:
                c = cp_size // (a * r)
                out.append((a, r, c))
    return out


def _run(rank: int, world: int) -> list[str]:
    bad = []
    cases = doc_cases(world)
    for g, (a, r, c) in enumerate(grids(world)):
        grid = mm.MeshGrid.build(rows=r, cols=c, heads=a)
        # every grid meets the plain, padded and bf16 cases; the others take turns
        chosen = [cases[0], cases[4], cases[7]] + cases[1:4][g % 3:g % 3 + 1] \
            + cases[5:7][g % 2:g % 2 + 1]
        if world <= 4:
            chosen = cases
        for case in chosen:
            if case.q_heads % a:  # A must divide the query heads
                continue
            try:
                bad += check_case(case, grid)
            except Exception as e:  # noqa: BLE001 (reported with the case)
                bad.append(f"{case} grid {grid.shape_text} rank {rank}: {type(e).__name__}: {e}")
        # documents joined with the causal diagonal's keys last, bottom-right aligned (as
        # CUDA's flash op takes them; on the CPU by the calls' slices): padded lengths
        if cases[4].q_heads % a == 0:
            bad += check_case(cases[4], grid, TorchFlashKernel(band_bottom_right=True))
    bad += _disagreeing_documents(rank, world)
    return bad


def _disagreeing_documents(rank: int, world: int) -> list[str]:
    """Rank 0 passes other documents of the same total: every rank raises, none hangs."""
    grid = mm.MeshGrid.build(rows=world, cols=1)
    unit = 2 * world
    cu = [0, unit, 3 * unit] if rank else [0, 2 * unit, 3 * unit]
    q = torch.randn(3 * unit // world, 2, 8)
    try:
        mm.mesh_attention(q, q, q, grid, cu_seqlens=torch.tensor(cu, dtype=torch.int32))
    except ValueError as e:
        return [] if "cu_seqlens" in str(e) else [f"rank {rank}: unclear error {e}"]
    return [f"rank {rank}: different cu_seqlens on different ranks were not refused"]


@pytest.mark.parametrize("cp_size", [2, 4, 8])
def test_packed_documents_exact_on_every_grid(cp_size: int) -> None:
    bad = [b for rank_bad in run_distributed(_run, cp_size) for b in rank_bad]
    assert not bad, "\n".join(bad[:20])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_branches_of_the_document_tiles_on_meta(dtype: torch.dtype) -> None:
    """The CUDA calls (varlen flash for fp16 / bf16, memory-efficient with a mask for fp32)
    run on meta tensors: aten checks their argument lists, shapes and dtypes."""
    from megatron_mesh.calls.tile_slices import TileSlices
    from megatron_mesh.kernels.torch_flash import TorchFlashKernel

    documents = TileSlices.documents((0, 3, 8), (0, 3, 8), True, torch.device("meta"))
    q = torch.empty(8, 1, 4, 16, device="meta", dtype=dtype)
    kv = torch.empty(8, 1, 2, 16, device="meta", dtype=dtype)
    kernel = TorchFlashKernel()
    out, lse = kernel.forward(q, kv, kv, True, 0.25, slices=documents)
    assert (out.shape, out.dtype, lse.shape, lse.dtype) == (q.shape, dtype, (1, 4, 8),
                                                            torch.float32)
    dq, dk, dv = kernel.backward(out, q, kv, kv, out, lse, True, 0.25, slices=documents)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, kv.shape, kv.shape)
    assert dq.dtype == dk.dtype == dv.dtype == dtype


def test_thd_layout_round_trips_and_matches_the_piece_rule() -> None:
    docs = DocCase((5, 8, 3), (8, 8, 16)).documents
    whole = torch.arange(docs.total)
    shares = thd_split(whole, docs, 2)
    assert torch.equal(thd_merge(shares, docs), whole)
    # P = 2: pieces of 2, 2, 4 tokens; rank 0 holds pieces 0 and 3 of every document
    assert shares[0].tolist() == [0, 1, 6, 7, 8, 9, 14, 15, 16, 17, 18, 19, 28, 29, 30, 31]
    assert torch.equal(thd_partition_indices(docs, 2, 1), shares[1])


@pytest.mark.parametrize("cu, padded, message", [
    ([0, 4, 8], None, "int32"),
    (torch.tensor([0, 4, 4], dtype=torch.int32), None, "strictly increasing"),
    (torch.tensor([1, 4], dtype=torch.int32), None, "start at 0"),
    (torch.tensor([0, 4, 8], dtype=torch.int32), torch.tensor([0, 4], dtype=torch.int32),
     "documents"),
    (torch.tensor([0, 5, 8], dtype=torch.int32), torch.tensor([0, 4, 8], dtype=torch.int32),
     "must not exceed"),
])
def test_bad_cu_seqlens_are_named(cu, padded, message: str) -> None:
    if isinstance(cu, list):
        cu = torch.tensor(cu, dtype=torch.int64)
    with pytest.raises(ValueError, match=message):
        Documents.from_cu_seqlens(cu, padded)


def test_bad_packed_shapes_are_named_before_any_collective() -> None:
    grid = mm.MeshGrid(rows=1, cols=1, cp_rank=0, cp_ranks=(0,), row_group=None, col_group=None)
    q = torch.randn(8, 2, 4)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="3-D"):
        mm.mesh_attention(q[:, None], q[:, None], q[:, None], grid, cu_seqlens=cu)
    with pytest.raises(ValueError, match="CP size x local tokens"):
        mm.mesh_attention(q[:6], q[:6], q[:6], grid, cu_seqlens=cu)
    with pytest.raises(ValueError, match="cu_seqlens_padded was given without"):
        mm.mesh_attention(q, q, q, grid, cu_seqlens_padded=cu)
    two = Documents.from_cu_seqlens(torch.tensor([0, 6, 8], dtype=torch.int32))
    with pytest.raises(ValueError, match="multiple of 2 \\* CP = 4"):
        two.check_cp(2, 4)
