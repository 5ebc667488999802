"""Placed documents (`place_documents`, or any placement) through the mesh against
whole-sequence SDPA in fp64 with the causal block-diagonal mask built here from cu_seqlens,
forward and backward, on gloo ranks; the bytes each rank sends equal `placement_traffic`,
and are zero (but for the heads all-to-all) when no document spans ranks.

One spawned group per CP size runs every 2D and heads x mesh grid over documents that are
all short, one long beside many short, one document (= the zigzag layout), a log-normal
mix, 1-token documents and arbitrary placements (documents cut at random points, the
pieces dealt out in a random order), with MHA / GQA, MLA, a window, non-causal, bf16.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, replace

import pytest
import torch
import torch.nn.functional as F

import megatron_mesh as mm
from megatron_mesh.cost_models.sparse import placement_traffic
from megatron_mesh.masks.document_placement import DocumentPlacement
from megatron_mesh.masks.document_placer import place_documents

from dist_utils import run_distributed
from reference import beyond_tolerance, partial_results


@dataclass(frozen=True)
class PlacedCase:
    lengths: tuple[int, ...]
    shuffled: int | None = None  # seed of an arbitrary placement; None: place_documents
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 8
    v_head_dim: int = 8
    causal: bool = True
    window: tuple[int, int] | None = None
    dtype: torch.dtype = torch.float32
    schedule: str = "streamed"
    seed: int = 0

    @property
    def cu_seqlens(self) -> torch.Tensor:
        cu = [0]
        for n in self.lengths:
            cu.append(cu[-1] + n)
        return torch.tensor(cu, dtype=torch.int32)

    def placement(self, cp_size: int) -> DocumentPlacement:
        if self.shuffled is None:
            return place_documents(self.cu_seqlens, cp_size)
        return shuffled_placement(self.lengths, cp_size, self.shuffled)

    def __str__(self) -> str:
        docs = self.lengths if len(self.lengths) <= 6 else f"{len(self.lengths)} documents"
        return (f"docs={docs} {'placed' if self.shuffled is None else f'shuffled {self.shuffled}'}"
                f" hq={self.q_heads} hkv={self.kv_heads} dv={self.v_head_dim} "
                f"causal={self.causal} window={self.window} {str(self.dtype)[6:]} {self.schedule}")


def shuffled_placement(lengths: tuple[int, ...], cp_size: int, seed: int) -> DocumentPlacement:
    """Every document cut at random points, the pieces laid out in a random order and the
    stream cut into cp_size equal shares: an arbitrary placement, nothing like zigzag."""
    rnd = random.Random(seed)
    pieces = []
    for d, n in enumerate(lengths):
        cuts = sorted(rnd.sample(range(1, n), min(n - 1, rnd.randint(0, 3))))
        bounds = [0, *cuts, n]
        pieces += [(d, a, b - a) for a, b in zip(bounds, bounds[1:])]
    rnd.shuffle(pieces)
    share = sum(lengths) // cp_size
    runs: list[list[tuple[int, int, int]]] = [[] for _ in range(cp_size)]
    rank, room = 0, share
    for d, first, n in pieces:
        while n:
            take = min(n, room)
            runs[rank].append((d, first, take))
            first, n, room = first + take, n - take, room - take
            if room == 0 and rank < cp_size - 1:
                rank, room = rank + 1, share
    return DocumentPlacement.from_runs(cp_size, tuple(lengths), tuple(map(tuple, runs)))


def lognormal_lengths(total: int, seed: int) -> tuple[int, ...]:
    """Documents of log-normal lengths (median 24, 1 to 160 tokens) filling `total`."""
    rnd = random.Random(seed)
    out: list[int] = []
    while sum(out) < total:
        out.append(min(160, max(1, round(rnd.lognormvariate(3.2, 1.0)))))
    out[-1] -= sum(out) - total
    return tuple(n for n in out if n > 0)


def cases(cp_size: int) -> list[PlacedCase]:
    t = 32 * cp_size  # whole packed sequence
    share = t // cp_size
    return [
        PlacedCase((share,) * cp_size),  # every document whole on a rank: no bytes
        PlacedCase((t,), kv_heads=1, seed=1),  # one document: the zigzag layout
        PlacedCase((t // 2, *([t // 16] * 8)), seed=2, schedule="gathered"),  # long + short
        PlacedCase(lognormal_lengths(t, 3), seed=3, schedule="streamed_q"),
        PlacedCase((1, 1, 3, t - 5), seed=4, schedule="streamed_kv"),  # 1-token documents
        PlacedCase(lognormal_lengths(t, 5), shuffled=5, seed=5),  # arbitrary placement
        PlacedCase((t // 4, t // 4, t // 2), shuffled=6, head_dim=12, v_head_dim=8, seed=6),
        PlacedCase(lognormal_lengths(t, 7), window=(5, 0), seed=7),
        PlacedCase(lognormal_lengths(t, 8), shuffled=8, causal=False, seed=8),
        PlacedCase(lognormal_lengths(t, 9), dtype=torch.bfloat16, seed=9),
    ]


def document_mask(lengths: tuple[int, ...], causal: bool) -> torch.Tensor:
    """[T, T] bool from the definition: query i sees key j of its own document (j <= i)."""
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    seen = doc[:, None] == doc[None, :]
    return seen & torch.ones_like(seen).tril() if causal else seen


def window_mask(lengths: tuple[int, ...], window: tuple[int, int]) -> torch.Tensor:
    """[T, T] bool: key position within [i - left, i + right] of query position i, positions
    counted within each document."""
    pos = torch.cat([torch.arange(n) for n in lengths])
    delta = pos[None, :] - pos[:, None]
    left, right = window
    seen = torch.ones(delta.shape, dtype=torch.bool)
    if left >= 0:
        seen &= delta >= -left
    if right >= 0:
        seen &= delta <= right
    return seen


def inputs(case: PlacedCase) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(case.seed)
    t = sum(case.lengths)
    randn = lambda h, d: torch.randn(t, h, d, generator=g, dtype=torch.float64)  # noqa: E731
    return {"q": randn(case.q_heads, case.head_dim), "k": randn(case.kv_heads, case.head_dim),
            "v": randn(case.kv_heads, case.v_head_dim),
            "dout": randn(case.q_heads, case.v_head_dim)}


def reference(case: PlacedCase, x: dict[str, torch.Tensor], dtype: torch.dtype,
              device: str = "cpu") -> dict[str, torch.Tensor]:
    """out, dq, dk, dv [T, h, d] of SDPA over the whole packed sequence in `dtype`."""
    q, k, v = (x[n].to(device, dtype).transpose(0, 1).unsqueeze(0).requires_grad_()
               for n in ("q", "k", "v"))
    mask = document_mask(case.lengths, case.causal)
    if case.window is not None:
        mask &= window_mask(case.lengths, case.window)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(device), enable_gqa=True,
                                         scale=case.head_dim ** -0.5)
    out.backward(x["dout"].to(device, dtype).transpose(0, 1).unsqueeze(0))
    thd = lambda t: t.detach()[0].transpose(0, 1).double()  # noqa: E731
    return {"out": thd(out), "dq": thd(q.grad), "dk": thd(k.grad), "dv": thd(v.grad)}


def check_case(case: PlacedCase, grid: mm.MeshGrid, device: str = "cpu") -> list[str]:
    """Failures of one case on this rank: exactness against SDPA in fp64 within
    `reference.merged_error_limit` of SDPA's own error in the case's dtype on `device`, and
    bytes. The kernel is the automatic choice on every device."""
    x = inputs(case)
    placement = case.placement(grid.cp_size)
    index = placement.token_indices(grid.cp_rank)
    share = {n: t.index_select(0, index).to(device, case.dtype) for n, t in x.items()}
    q, k, v = (share[n].requires_grad_() for n in ("q", "k", "v"))
    with mm.TrafficCounter() as counter:
        out = mm.mesh_attention(q, k, v, grid, causal=case.causal, schedule=case.schedule,
                                placement=placement, window_size=case.window,
                                backend="auto")
        out.backward(share["dout"])
    got = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    got = {n: t.cpu() for n, t in got.items()}
    where = f"{case} grid {grid.shape_text} rank {grid.cp_rank} {device}"
    bad = []
    mine = lambda dtype, on: {n: t.cpu().index_select(0, index)  # noqa: E731
                              for n, t in reference(case, x, dtype, on).items()}
    same32 = None if case.dtype == torch.float32 else mine(torch.float32, device)
    bad += beyond_tolerance(got, mine(torch.float64, "cpu"), mine(case.dtype, device),
                            case.dtype, where, partial_results(grid), same32)
    shape = mm.AttentionShape(placement.total, 1, case.q_heads, case.kv_heads, case.head_dim,
                              torch.finfo(case.dtype).bits // 8,
                              v_head_dim=None if case.v_head_dim == case.head_dim
                              else case.v_head_dim)
    model = placement_traffic(shape, placement, grid.rows, grid.cols, grid.heads, case.causal,
                              case.window, cp_rank=grid.cp_rank)
    if counter.total_bytes != model.total:
        bad.append(f"{where}: sent {counter.total_bytes} B, placement_traffic {model.total} B")
    if case.lengths == (placement.local_tokens,) * grid.cp_size and case.shuffled is None:
        split = [d for d in range(len(case.lengths)) if len(placement.spans(d)) > 1]
        if split:  # one rank's share each: every document fits a rank whole
            bad.append(f"{where}: documents {split} of one rank's share each were split")
    if all(len(placement.spans(d)) == 1 for d in range(len(case.lengths))):
        mesh_bytes = model.total - model.forward_heads - model.backward_heads
        if mesh_bytes:
            bad.append(f"{where}: no document spans ranks, yet {mesh_bytes} B counted")
    return bad


def grids(cp_size: int) -> list[tuple[int, int, int]]:
    """Every (A, R, C) with A x R x C = P and A in 1, 2."""
    return [(a, r, cp_size // (a * r)) for a in (1, 2) if cp_size % a == 0
            for r in range(1, cp_size // a + 1) if cp_size % (a * r) == 0]


def _run(rank: int, world: int) -> list[str]:
    bad = []
    every = cases(world)
    for g, (a, r, c) in enumerate(grids(world)):
        grid = mm.MeshGrid.build(rows=r, cols=c, heads=a)
        chosen = every if world <= 4 else every[g % 2::2]
        for case in chosen:
            try:
                bad += check_case(case, grid)
            except Exception as e:  # noqa: BLE001 (reported with the case)
                bad.append(f"{case} grid {grid.shape_text} rank {rank}: {type(e).__name__}: {e}")
    return bad


@pytest.mark.parametrize("cp_size", [2, 4, 6, 8])
def test_placed_documents_exact_on_every_grid(cp_size: int) -> None:
    bad = [b for rank_bad in run_distributed(_run, cp_size) for b in rank_bad]
    assert not bad, "\n".join(bad[:20])


def _gpu_run(rank: int, world: int) -> list[str]:
    """Every case at head dim 64 (the flash kernels' sizes), the ranks sharing one GPU;
    case i in fp32, bf16 or fp16 by turns."""
    import host_staging
    return host_staging.check_on_one_gpu(
        rank, grids(world), cases(world), lambda case, dtype: replace(
            case, dtype=dtype, head_dim=64,
            v_head_dim=64 if case.v_head_dim == case.head_dim else 32), check_case)


@pytest.mark.gpu
@pytest.mark.parametrize("cp_size", [2, 4])
def test_placed_documents_on_ranks_sharing_one_gpu(cp_size: int) -> None:
    """The placed tiles (causal squares, full varlen calls, bands) through the CUDA kernels
    within `reference.merged_error_limit` of SDPA's own error on that GPU, every grid,
    forward and backward; the bytes still equal `placement_traffic`."""
    bad = [b for rank_bad in run_distributed(_gpu_run, cp_size, cuda=True) for b in rank_bad]
    assert not bad, "\n".join(bad[:20])


def _bad_placements(rank: int, world: int) -> list[str]:
    """Each bad call raises ValueError naming the problem on every rank (no hang): a
    placement of another CP size, cu_seqlens of other documents beside it, tensors that are
    not the placement's share, and a bad one on one rank only."""
    grid = mm.MeshGrid.build(rows=2, cols=world // 2)
    cu = torch.tensor([0, 24, 40, 32 * world], dtype=torch.int32)
    placement = place_documents(cu, world)
    share = placement.local_tokens
    q = torch.randn(share, 2, 8)
    calls = {
        "another CP size": (dict(placement=place_documents(cu, 2 * world)), q, "CP ranks"),
        "other documents": (dict(placement=placement, cu_seqlens=torch.tensor(
            [0, 20, 40, 32 * world], dtype=torch.int32)), q, "lengths"),
        "padded lengths": (dict(placement=placement, cu_seqlens=cu, cu_seqlens_padded=cu), q,
                           "not padded"),
        "a longer share": (dict(placement=placement), torch.randn(share + 2, 2, 8), "tokens"),
        "one rank's share": (dict(placement=placement),
                             torch.randn(share + 2 * (rank == 0), 2, 8), "tokens"),
    }
    bad = []
    for name, (kwargs, x, words) in calls.items():
        try:
            mm.mesh_attention(x, x, x, grid, backend="torch", **kwargs)
            bad.append(f"rank {rank}: {name} was accepted")
        except ValueError as e:
            if words not in str(e):
                bad.append(f"rank {rank}: {name}: unclear error {e}")
    out = mm.mesh_attention(q, q, q, grid, placement=placement, backend="torch")
    if out.shape != q.shape:  # a good call after the refused ones still runs
        bad.append(f"rank {rank}: a good call after refused ones gave {tuple(out.shape)}")
    return bad


def test_bad_placements_are_named_on_every_rank() -> None:
    bad = [b for rank_bad in run_distributed(_bad_placements, 4) for b in rank_bad]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_branches_of_placed_blocks_on_meta(dtype: torch.dtype) -> None:
    """Every block of an arbitrary placement over 2 ranks (causal squares, full varlen
    calls with unequal query and key segments, bands), built on the tiles' device (meta)
    and run through the CUDA branches of the torch kernel (varlen flash in bf16, the
    memory-efficient op with the segments' mask in fp32), forward and backward: aten checks
    each call's arguments, shapes and dtypes."""
    from megatron_mesh.calls.layout import AttentionMask, block_for
    from megatron_mesh.common.merge import empty_accumulators
    from megatron_mesh.kernels.torch_flash import TorchFlashKernel
    from megatron_mesh.schedules.blocks import backward_block, forward_block, kv_grads

    placement = shuffled_placement((40, 9, 15), 2, seed=3)
    mask = AttentionMask(True, None, 2, None, placement)
    s, meta = placement.local_tokens, torch.device("meta")
    q = torch.empty(s, 1, 4, 16, device=meta, dtype=dtype)
    k, v = (torch.empty(s, 1, 2, 16, device=meta, dtype=dtype) for _ in range(2))
    kernel, calls = TorchFlashKernel(), 0
    for x in range(2):
        out, lse = empty_accumulators(s, 1, 4, 16, meta)
        dq = torch.zeros(s, 1, 4, 16, device=meta)
        dkv = torch.zeros(k.numel() + v.numel(), device=meta)
        for y in range(2):
            calls += len(block_for(x, y, s, mask, meta).calls)
            forward_block(kernel, q, k, v, x, y, mask, 0.25, out, lse)
            backward_block(kernel, q, q, q, lse, k, v, x, y, mask, 0.25, dq, kv_grads(dkv, k, v))
        assert out.shape == q.shape and lse.shape == (1, 4, s) and dq.shape == q.shape
    assert calls >= 3  # the diagonal squares and at least one full varlen call ran
