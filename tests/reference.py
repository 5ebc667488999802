"""Independent reference: torch SDPA on the whole sequence in one process, then sliced
by the zigzag layout; and an independent count of the bytes torch.distributed sends."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

import megatron_mesh as mm
from megatron_mesh.layer_plan import DEFAULT_GRAD_DTYPE, Schedule
from megatron_mesh.runtime import comm


@dataclass(frozen=True)
class Case:
    seq: int
    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    causal: bool
    dtype: torch.dtype = torch.float32
    softmax_scale: float | None = None
    seed: int = 0
    schedule: str = "streamed"
    grad_reduce_dtype: str = DEFAULT_GRAD_DTYPE
    contiguous: bool = True  # False: q, k, v are [s, b, h, d] views of [b, s, h, d] storage
    layout: str = "dense"  # or a strided view of the same values: one of LAYOUTS
    device: str = "cpu"  # where mesh_attention runs ("cuda": the rank's current GPU)

    def __str__(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        return (f"S={self.seq} b={self.batch} hq={self.q_heads} hkv={self.kv_heads} "
                f"d={self.head_dim} causal={self.causal} {dt} scale={self.softmax_scale} "
                f"{self.schedule} grads={self.grad_reduce_dtype}"
                + ("" if self.contiguous else " non-contiguous")
                + ("" if self.layout == "dense" else f" {self.layout}"))


LAYOUTS = ("dense", "last_dim_stride_2", "transposed", "broadcast_batch")
CONCRETE_SCHEDULES = tuple(str(s) for s in Schedule)  # every schedule, new ones included


class Failure(NamedTuple):
    """One failure of a batched distributed test, under the id of its case: what a rank
    returns, so that a failing run names every case that failed (`assert_no_failures`)."""

    case: str  # e.g. "P4 2x2 S=16 b=2 hq=4 hkv=2 d=16 causal=True float32 ..."
    message: str

    def __str__(self) -> str:
        return f"[{self.case}] {self.message}"


def case_id(case: object, grid: mm.MeshGrid | None = None) -> str:
    """The id of a case: its CP size and grid (when given) and its own description."""
    where = f"P{grid.cp_size} {grid.shape_text} " if grid is not None else ""
    return f"{where}{case}"


def assert_no_failures(per_rank: list[list[Failure]]) -> None:
    """Every rank's failures, deduplicated, grouped by case id, in one assertion message."""
    failures = sorted({Failure(*f) for rank in per_rank for f in rank})
    cases = sorted({f.case for f in failures})
    assert not failures, (f"{len(cases)} failing case(s):\n"
                          + "\n".join(str(f) for f in failures))


def as_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """The values of t [s, b, h, d] as a view with `layout`'s strides:
    last_dim_stride_2: every other element of a [s, b, h, 2d] tensor (x[..., ::2]);
    transposed: a permuted view of [b, h, d, s] storage (last-dim stride s);
    broadcast_batch: batch 0 expanded over b (stride 0; needs equal batches)."""
    if layout == "dense":
        return t
    if layout == "last_dim_stride_2":
        wide = t.new_zeros(*t.shape[:-1], 2 * t.shape[-1])
        wide[..., ::2] = t
        return wide[..., ::2]
    if layout == "transposed":
        return t.permute(1, 2, 3, 0).contiguous().permute(3, 0, 1, 2)
    if layout == "broadcast_batch":
        assert torch.equal(t, t[:, :1].expand_as(t)), "broadcast_batch needs equal batches"
        return t[:, :1].expand_as(t)
    raise ValueError(f"layout {layout!r} is not one of {LAYOUTS}")


def expected_traffic(case: Case, grid: mm.MeshGrid) -> int:
    """Bytes per rank `traffic.mesh_traffic` gives for the case on the grid, with the
    gradient and partial-output dtypes of the schedule that runs."""
    from megatron_mesh.cost_models.plan import resolve_plan

    shape = mm.AttentionShape(case.seq, case.batch, case.q_heads, case.kv_heads,
                              case.head_dim, torch.finfo(case.dtype).bits // 8)
    plan = resolve_plan(shape, grid.rows, grid.cols, case.schedule, case.grad_reduce_dtype,
                        heads=grid.heads)
    return mm.mesh_traffic(shape, plan).total


def full_inputs(case: Case) -> dict[str, torch.Tensor]:
    """Whole-sequence q, k, v, dout [S, b, h, d] in fp32, the same on every rank."""
    g = torch.Generator().manual_seed(case.seed)
    s, b, d = case.seq, case.batch, case.head_dim
    nb = 1 if case.layout == "broadcast_batch" else b  # equal batches, broadcast later
    x = {
        "q": torch.randn(s, nb, case.q_heads, d, generator=g),
        "k": torch.randn(s, nb, case.kv_heads, d, generator=g),
        "v": torch.randn(s, nb, case.kv_heads, d, generator=g),
        "dout": torch.randn(s, nb, case.q_heads, d, generator=g),
    }
    return {n: t.expand(s, b, *t.shape[2:]).contiguous() for n, t in x.items()}


def sdpa_reference(case: Case, x: dict[str, torch.Tensor], dtype: torch.dtype,
                   device: str = "cpu") -> dict[str, torch.Tensor]:
    """out, dq, dk, dv of torch SDPA over the whole sequence in `dtype` on `device`, returned
    in fp32 (fp64 if dtype is) on the CPU."""
    q, k, v = (x[n].to(device, dtype).permute(1, 2, 0, 3).requires_grad_()
               for n in ("q", "k", "v"))
    out = F.scaled_dot_product_attention(
        q, k, v, is_causal=case.causal, scale=case.softmax_scale, enable_gqa=True
    )
    out.backward(x["dout"].to(device, dtype).permute(1, 2, 0, 3))
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    sbhd = lambda t: t.detach().permute(2, 0, 1, 3).to("cpu", wide)  # noqa: E731
    return {"out": sbhd(out), "dq": sbhd(q.grad), "dk": sbhd(k.grad), "dv": sbhd(v.grad)}


def mesh_result(case: Case, x: dict[str, torch.Tensor], grid: mm.MeshGrid,
                cp_rank: int) -> dict[str, torch.Tensor]:
    """out, dq, dk, dv of mesh_attention on this rank's zigzag share, in fp32."""
    share = {n: mm.zigzag_split(t, grid.cp_size)[cp_rank].to(case.device, case.dtype)
             for n, t in x.items()}
    if not case.contiguous:  # as Megatron's views of a fused QKV or a b-major layout
        share = {n: t.transpose(0, 1).contiguous().transpose(0, 1) for n, t in share.items()}
    share = {n: as_layout(t, case.layout) for n, t in share.items()}
    q, k, v = (share[n].requires_grad_() for n in ("q", "k", "v"))
    out = mm.mesh_attention(q, k, v, grid, causal=case.causal, softmax_scale=case.softmax_scale,
                            schedule=case.schedule, grad_reduce_dtype=case.grad_reduce_dtype)
    assert out.dtype == case.dtype and out.shape == q.shape
    out.backward(share["dout"])
    return {"out": out.detach().to("cpu", torch.float32), "dq": q.grad.to("cpu", torch.float32),
            "dk": k.grad.to("cpu", torch.float32), "dv": v.grad.to("cpu", torch.float32)}


def partial_results(grid: mm.MeshGrid) -> int:
    """At most how many partial results the mesh assembles one row's output, or one K/V
    row's gradient, from on `grid`: one per zigzag chunk, 2P (a placed document's share
    of a rank is at most two such blocks too; heads grids have fewer)."""
    return 2 * grid.cp_size


def merged_error_limit(base: float, base32: float, scale: float, dtype: torch.dtype,
                       partials: int) -> float:
    """The error the mesh may make where the reference (one kernel call over the whole
    sequence, in `dtype` on the same device) makes `base` (`base32` in fp32), both
    measured against fp64; `scale` is the largest value of the result.

    The reference's own rule: twice its error plus two ulps of `dtype` (another kernel, or
    the same one summing in another order, is no worse). On top, what assembling a row
    from `partials` partial results adds, all of it in fp32 whatever `dtype` (accumulators,
    lse, dQ): (1) each partial carries the kernel's own per-element error once more (the
    exponent of its scores taken against the merged lse, its output rounded to fp32, its
    gradient against the merged lse and D = rowsum(dO * O)): at most `base32` per partial;
    (2) each log-sum-exp merge of the forward, and each sum of the partial gradients (in
    the tile and across ranks), rounds once in fp32: at most one fp32 ulp of `scale` per
    partial. (TF32 plays no part: the fp32 kernels are the memory-efficient op's, in full
    fp32, and the merge is elementwise.) In bf16 / fp16 the rounding of the probabilities
    to the dtype before each product makes `base` dwarf these fp32 terms; in fp32 they are
    the error: `partials` + 2 times the reference's, where it would be 2 in one call.
    """
    eps, eps32 = torch.finfo(dtype).eps, torch.finfo(torch.float32).eps
    return 2 * base + 2 * eps * scale + partials * (base32 + eps32 * scale)


def beyond_tolerance(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor],
                     same: dict[str, torch.Tensor], dtype: torch.dtype, where: str,
                     partials: int, same32: dict[str, torch.Tensor] | None = None) -> list[str]:
    """Tensors of `got` whose max error against the fp64 reference `ref` exceeds
    `merged_error_limit`: `same` is the reference computed in `dtype` on the device that
    ran the mesh, `same32` in fp32 there (None: `same` is in fp32); `partials` from
    `partial_results`."""
    bad = []
    for n, t in ref.items():
        err = (got[n].double() - t).abs().max().item()
        base = (same[n].double() - t).abs().max().item()
        base32 = base if same32 is None else (same32[n].double() - t).abs().max().item()
        limit = merged_error_limit(base, base32, t.abs().max().item(), dtype, partials)
        if not err <= limit:
            bad.append(f"{where} {n}: max error {err:.3g} > {limit:.3g} (the reference's "
                       f"{base:.3g}, {partials} partial results)")
    return bad


def errors(case: Case, got: dict, grid: mm.MeshGrid, cp_rank: int, x: dict) -> list[Failure]:
    """Failures of one case: fp32 within 1e-5; bf16 / fp16 within 2x single-device SDPA's
    error in that dtype (both against fp32 SDPA), plus a floor of a few ulps."""
    split = lambda t: mm.zigzag_split(t, grid.cp_size)[cp_rank]  # noqa: E731
    ref = {n: split(t) for n, t in sdpa_reference(case, x, torch.float32).items()}
    bad = []
    if case.dtype == torch.float32:
        for n, t in ref.items():
            err = (got[n] - t).abs().max().item()
            if err > 1e-5 * max(1.0, t.abs().max().item()):
                bad.append(Failure(case_id(case, grid), f"{n}: max error {err:.3g} > 1e-5"))
        return bad
    same = {n: split(t) for n, t in sdpa_reference(case, x, case.dtype).items()}
    ulp = torch.finfo(case.dtype).eps
    for n, t in ref.items():
        err = (got[n] - t).abs().max().item()
        base = (same[n] - t).abs().max().item()
        if err > 2 * base + 2 * ulp * t.abs().max().item():
            bad.append(Failure(case_id(case, grid),
                               f"{n}: error {err:.3g} > 2 x SDPA's {base:.3g}"))
    return bad


class CountingTransport:
    """A `comm.Transport` that counts the bytes this rank hands to torch.distributed, by
    what each collective really carries, and runs the real collective."""

    def __init__(self) -> None:
        self.inner = comm.TorchTransport()
        self.sent = [0]  # a list, so that a reader holds the live count

    def all_gather(self, out, inp, group, async_op=False):
        self.sent[0] += (dist.get_world_size(group) - 1) * inp.numel() * inp.element_size()
        return self.inner.all_gather(out, inp, group, async_op)

    def reduce_scatter(self, out, inp, group, async_op=False):
        self.sent[0] += (dist.get_world_size(group) - 1) * out.numel() * out.element_size()
        return self.inner.reduce_scatter(out, inp, group, async_op)

    def all_to_all(self, out, inp, group):
        n = dist.get_world_size(group)
        self.sent[0] += inp.numel() * inp.element_size() * (n - 1) // n
        self.inner.all_to_all(out, inp, group)

    def batch_isend_irecv(self, ops):
        self.sent[0] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops
                         if op.op in (dist.isend, dist.send))
        return self.inner.batch_isend_irecv(ops)


@contextlib.contextmanager
def count_sent_bytes():
    """Count bytes this rank sends through torch.distributed under the mesh's collectives
    (`CountingTransport`). Yields a one-item list."""
    with comm.using(CountingTransport()) as counting:
        yield counting.sent


def check_cases(grid: mm.MeshGrid, cases: list[Case]) -> list[Failure]:
    """Run each case on `grid`; its failures (exactness, and the bytes sent: counted on the
    real collectives, by the TrafficCounter and by the formula, all equal)."""
    bad = []
    for case in cases:
        x = full_inputs(case)
        with count_sent_bytes() as sent, mm.TrafficCounter() as counter:
            got = mesh_result(case, x, grid, grid.cp_rank)
        bad += errors(case, got, grid, grid.cp_rank, x)
        expected = expected_traffic(case, grid)
        if not sent[0] == counter.total_bytes == expected:
            bad.append(Failure(case_id(case, grid), f"sent {sent[0]} B, counter "
                               f"{counter.total_bytes} B, formula {expected} B"))
    return bad


def block_pairs(mask, q_rank: int, kv_rank: int, local_len: int) -> torch.Tensor:
    """[local_len, local_len] bool: local query row i of q_rank sees local key row j of
    kv_rank under `mask` (an `AttentionMask`): its slices (`mask_slices`) read on the rows'
    positions by the one rule (`seen.sees`)."""
    from megatron_mesh.calls.layout import global_positions, mask_slices
    from megatron_mesh.masks.seen import sees

    return sees(mask_slices(mask, local_len), global_positions(mask, q_rank, local_len),
                global_positions(mask, kv_rank, local_len))



def seen_of_slices(slices, shape: tuple[int, int]) -> torch.Tensor:
    """bool [sq, sk] from the definition of slices (q0, q1, k0, k1, lo, hi): some slice has
    q0 <= i < q1, k0 <= j < k1 and lo <= j - i <= hi (None: unbounded)."""
    sq, sk = shape
    i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
    seen = torch.zeros(sq, sk, dtype=torch.bool)
    for q0, q1, k0, k1, lo, hi in slices:
        inside = (i >= q0) & (i < q1) & (j >= k0) & (j < k1)
        if lo is not None:
            inside &= j - i >= lo
        if hi is not None:
            inside &= j - i <= hi
        seen |= inside
    return seen


def fp64_masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          dout: torch.Tensor, seen: torch.Tensor, scale: float):
    """out, lse, dq, dk, dv in fp64 of softmax attention of q [sq, b, hq, d] against
    k, v [sk, b, hkv, d] under bool `seen` [sq, sk] (rows seeing nothing: out 0, lse -inf,
    no gradient)."""
    x = [t.double().requires_grad_() for t in (q, k, v)]
    kk, vv = (t.repeat_interleave(q.shape[2] // k.shape[2], 2) for t in x[1:])
    scores = torch.einsum("ibhd,jbhd->bhij", x[0], kk) * scale
    scores = scores.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    p = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("bhij,jbhd->ibhd", p, vv)
    out.backward(dout.double())
    return out.detach(), lse.detach(), *(t.grad for t in x)
