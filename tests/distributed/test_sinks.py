"""Attention sinks through the mesh against the formula in fp64 on the whole sequence (not
SDPA: one more logit per head with value 0, built here), forward and backward, with the
sink's gradient summed over the CP group; every grid of P = 2, 4, 8 (heads grids too),
every schedule, causal and not, a window, packed documents (THD and placed), GQA / MQA,
bf16, and "off-by-one" (offset 0, no gradient)."""
from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
import torch.distributed as dist

import megatron_mesh as mm
from megatron_mesh.calls.layout import zigzag_split
from megatron_mesh.layer_plan import Schedule
from megatron_mesh.masks.documents import Documents, thd_split

from dist_utils import run_distributed
from reference import beyond_tolerance, partial_results


@dataclass(frozen=True)
class SinkCase:
    seq: int = 64
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 8
    causal: bool = True
    window: tuple[int, int] | None = None
    documents: tuple[int, ...] | None = None  # lengths (multiples of 2P for THD)
    placed: bool = False
    learnable: bool = True
    dtype: torch.dtype = torch.float32
    schedule: str = "streamed"
    seed: int = 0

    def __str__(self) -> str:
        return (f"hq={self.q_heads} hkv={self.kv_heads} causal={self.causal} "
                f"window={self.window} docs={self.documents} placed={self.placed} "
                f"learnable={self.learnable} {str(self.dtype)[6:]} {self.schedule}")


def cases(cp_size: int) -> list[SinkCase]:
    unit = 2 * cp_size
    docs = (3 * unit, unit, 4 * unit)
    schedules = [str(s) for s in Schedule]
    return [
        SinkCase(schedule=schedules[0]),
        SinkCase(causal=False, kv_heads=1, schedule=schedules[1], seed=1),
        SinkCase(window=(7, 0), schedule=schedules[2], seed=2),
        SinkCase(documents=docs, seq=sum(docs), seed=3),
        SinkCase(documents=(5, 17, sum(docs) - 22), seq=sum(docs), placed=True, seed=4),
        SinkCase(learnable=False, seed=5),
        SinkCase(dtype=torch.bfloat16, kv_heads=4, seed=6),
    ]


def reference(case: SinkCase, x: dict[str, torch.Tensor], dtype: torch.dtype,
              device: str = "cpu") -> dict:
    """out, dq, dk, dv [S, h, d] and d offset [h] of the formula, in `dtype` (fp64 out, on
    the CPU)."""
    q, k, v = (x[n].detach().to(device, dtype).clone().requires_grad_()
               for n in ("q", "k", "v"))
    offset = x["offset"].detach().to(device, dtype).clone().requires_grad_(case.learnable)
    group = case.q_heads // case.kv_heads
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("ihd,jhd->hij", q, kk) * case.head_dim ** -0.5
    lengths = case.documents or (case.seq,)
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.cat([torch.arange(n) for n in lengths]).to(device)
    seen = (doc[:, None] == doc[None, :]).to(device)
    if case.causal:
        seen &= pos[None, :] <= pos[:, None]
    if case.window is not None:
        seen &= pos[None, :] >= pos[:, None] - case.window[0]
    scores = scores.masked_fill(~seen, float("-inf"))
    sink = offset[:, None, None].expand(-1, case.seq, 1)
    probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
    out = torch.einsum("hij,jhd->ihd", probs, vv)
    out.backward(x["dout"].to(device, dtype))
    grad = offset.grad if case.learnable else torch.zeros_like(offset)
    return {n: t.detach().double().cpu() for n, t in (
        ("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad), ("doffset", grad))}


def check_case(case: SinkCase, grid: mm.MeshGrid, device: str = "cpu") -> list[str]:
    """Failures of one case on this rank against the formula in fp64, within
    `reference.merged_error_limit` of the formula's own error in the case's dtype on
    `device`. The kernel is the automatic choice on every device."""
    g = torch.Generator().manual_seed(case.seed)
    s, d = case.seq, case.head_dim
    x = {"q": torch.randn(s, case.q_heads, d, generator=g, dtype=torch.float64),
         "k": torch.randn(s, case.kv_heads, d, generator=g, dtype=torch.float64),
         "v": torch.randn(s, case.kv_heads, d, generator=g, dtype=torch.float64),
         "dout": torch.randn(s, case.q_heads, d, generator=g, dtype=torch.float64),
         "offset": torch.randn(case.q_heads, generator=g, dtype=torch.float64)}
    if not case.learnable:
        x["offset"].zero_()
    p, rank = grid.cp_size, grid.cp_rank
    kwargs: dict = {}
    if case.documents is None:
        mine = lambda t: zigzag_split(t, p)[rank].unsqueeze(1)  # noqa: E731
        back = lambda t: t.squeeze(1)  # noqa: E731
    else:
        cu = torch.tensor([0, *torch.tensor(case.documents).cumsum(0).tolist()],
                          dtype=torch.int32)
        if case.placed:
            placement = mm.place_documents(cu, p)
            index = placement.token_indices(rank)
            mine = lambda t: t.index_select(0, index)  # noqa: E731
            kwargs["placement"] = placement
        else:
            docs = Documents.from_cu_seqlens(cu)
            mine = lambda t: thd_split(t, docs, p)[rank]  # noqa: E731
            kwargs["cu_seqlens"] = cu
        back = lambda t: t  # noqa: E731
    share = {n: mine(x[n]).to(device, case.dtype) for n in ("q", "k", "v", "dout")}
    q, k, v = (share[n].requires_grad_() for n in ("q", "k", "v"))
    offset = x["offset"].float().to(device).requires_grad_(case.learnable)
    out = mm.mesh_attention(q, k, v, grid, causal=case.causal, schedule=case.schedule,
                            window_size=case.window, softmax_offset=offset,
                            backend="auto", **kwargs)
    out.backward(share["dout"])
    doffset = offset.grad.cpu() if case.learnable else torch.zeros(case.q_heads)
    dist.all_reduce(doffset)  # the partials sum to the gradient, as Megatron's reduction does
    got = {"out": back(out.detach()), "dq": back(q.grad), "dk": back(k.grad),
           "dv": back(v.grad)}
    got = {**{n: t.cpu() for n, t in got.items()}, "doffset": doffset}
    where = f"{case} grid {grid.shape_text} rank {rank} {device}"
    bad = []
    local = lambda dtype, on: {n: v if n == "doffset" else back(mine(v))  # noqa: E731
                               for n, v in reference(case, x, dtype, on).items()}
    same32 = None if case.dtype == torch.float32 else local(torch.float32, device)
    bad += beyond_tolerance(got, local(torch.float64, "cpu"), local(case.dtype, device),
                            case.dtype, where, partial_results(grid), same32)
    if not case.learnable and offset.grad is not None:
        bad.append(f"{where}: off-by-one got a gradient")
    return bad


def _shapes(world: int) -> list[tuple[int, int, int]]:
    """Every (A, R, C) with A x R x C = P and A in 1, 2."""
    return [(a, r, world // (a * r)) for a in (1, 2) for r in range(1, world // a + 1)
            if world % (a * r) == 0]


def _run(rank: int, world: int) -> list[str]:
    bad = []
    every = cases(world)
    for n, (a, r, c) in enumerate(_shapes(world)):
        grid = mm.MeshGrid.build(rows=r, cols=c, heads=a)
        for case in (every if world <= 4 else every[n % 3::3]):
            try:
                bad += check_case(case, grid)
            except Exception as e:  # noqa: BLE001 (reported with the case)
                bad.append(f"{case} grid {grid.shape_text} rank {rank}: {type(e).__name__}: {e}")
    return bad


def _gpu_run(rank: int, world: int) -> list[str]:
    """Every case at head dim 64, the ranks sharing one GPU; case i in fp32, bf16 or fp16
    by turns."""
    import host_staging
    return host_staging.check_on_one_gpu(
        rank, _shapes(world), cases(world),
        lambda case, dtype: replace(case, head_dim=64, dtype=dtype), check_case)


@pytest.mark.gpu
@pytest.mark.parametrize("cp_size", [2, 4])
def test_sinks_on_ranks_sharing_one_gpu(cp_size: int) -> None:
    """The sink merged once per row after the CUDA kernels' partials, and its gradient,
    within `reference.merged_error_limit` of the formula's own error on that GPU, every grid."""
    bad = [b for rank_bad in run_distributed(_gpu_run, cp_size, cuda=True) for b in rank_bad]
    assert not bad, "\n".join(bad[:20])


@pytest.mark.parametrize("cp_size", [2, 4, 8])
def test_sinks_exact_on_every_grid(cp_size: int) -> None:
    bad = [b for rank_bad in run_distributed(_run, cp_size) for b in rank_bad]
    assert not bad, "\n".join(bad[:20])


@pytest.mark.parametrize("offset, message", [
    (torch.zeros(3), r"\[4\]"), (torch.zeros(4, dtype=torch.float64), "float32"),
    ([0.0] * 4, "list"), (torch.tensor([0.0, float("nan"), 0.0, 0.0]), "non-finite"),
])
def test_bad_offsets_are_named(offset, message: str) -> None:
    from megatron_mesh.masks.sink import check_offset

    with pytest.raises(ValueError, match=message):
        check_offset(offset, 4)
