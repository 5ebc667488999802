"""Kernel calls per tile: the blocks a rank has on hand together go to the kernel as few
calls (`calls.groups`; the default, MESH_GROUP_CALLS=0 the blocks' own calls), counted on
the real kernel (torch's, wrapped to count) in every schedule and grid, held to
`cost_models.tile_calls` on a dense sequence and on packed documents (joined document by
document), and never more than one call per block under a window; grouped, every schedule
and grid equals whole-sequence SDPA, forward and backward (causal and full, fp32 and bf16),
with the causal diagonal a call of its own (the CPU op's causal is top-left) and folded
into one bottom-right call (as CUDA's flash op takes it natively; on the CPU op one call
with the band's mask, made once per shape), and with each call capped at fewer rows than a tile holds
(MESH_GROUP_TOKENS), its calls as the model counts them. Masks reach the CPU op as runs: no
additive mask for documents (THD or slices), a bidirectional prefix, chunked-causal
documents or causal; a window's only of one block of rows."""
from __future__ import annotations

import contextlib
import os

import pytest
import torch

import megatron_mesh as mm
from megatron_mesh.cost_models.tile_calls import backward_calls, forward_calls
from megatron_mesh.kernels import TorchFlashKernel
from megatron_mesh.layer_plan import grid_shapes

from dist_utils import run_distributed
from reference import Case, Failure, assert_no_failures, check_cases, errors, full_inputs

WORLD = 4
CAP = 8  # MESH_GROUP_TOKENS of the capped cases: one zigzag half of a 16-row chunk per call
SCHEDULES = ("gathered", "streamed_kv", "streamed_q")
MASKS = ("causal", "full", "documents", "placed", "window")


class CountingKernel:
    """torch's tile kernel, counting its forward and backward calls; `fold`: causal
    diagonals folded into bottom-right calls (on the CPU: one call with the band's mask)."""

    def __init__(self, fold: bool = False) -> None:
        self.inner = TorchFlashKernel(band_bottom_right=fold)
        self.name, self.caps = "counting", self.inner.caps
        self.bottom_right_mask_free = self.inner.bottom_right_mask_free
        self.calls = {"forward": 0, "backward": 0}

    def forward(self, *args, **kwargs):
        self.calls["forward"] += 1
        return self.inner.forward(*args, **kwargs)

    def backward(self, *args, **kwargs):
        self.calls["backward"] += 1
        return self.inner.backward(*args, **kwargs)


@contextlib.contextmanager
def capped(cap: int):
    """MESH_GROUP_TOKENS = cap while the block runs."""
    os.environ["MESH_GROUP_TOKENS"] = str(cap)
    try:
        yield
    finally:
        os.environ.pop("MESH_GROUP_TOKENS")


def count_calls(grid: mm.MeshGrid, schedule: str, mask: str, grouped: bool,
                fold: bool = False) -> dict:
    """Calls of one forward and one backward of mesh attention on this rank."""
    s, hq, hkv, d = 16, 4, 2, 8
    g = torch.Generator().manual_seed(3 + grid.cp_rank)
    q, k, v = (torch.randn(s, 1, h, d, generator=g).requires_grad_() for h in (hq, hkv, hkv))
    kw = {"causal": mask != "full"}
    if mask in ("documents", "placed"):  # whole sequence 64: documents of 24, 40
        cu = torch.tensor([0, 24, 64], dtype=torch.int32)
        if mask == "documents":
            kw["cu_seqlens"] = cu
        else:  # placed over the ranks, the sparse exchange: the column joined per query chunk
            kw["placement"] = mm.place_documents(cu, grid.cp_size)
        q, k, v = (t.detach()[:, 0].requires_grad_() for t in (q, k, v))
    if mask == "window":
        kw["window_size"] = (20, 0)
        kw["window_exchange"] = "gathered"
    kernel = CountingKernel(fold)
    os.environ["MESH_GROUP_CALLS"] = "1" if grouped else "0"
    try:
        out = mm.mesh_attention(q, k, v, grid, backend=kernel, schedule=schedule, **kw)
        forward = dict(kernel.calls)
        out.backward(torch.ones_like(out))
    finally:
        os.environ.pop("MESH_GROUP_CALLS")
    return {"forward": forward["forward"], "backward": kernel.calls["backward"]}


def folded_errors(case: Case, grid: mm.MeshGrid) -> list:
    """The case's failures against SDPA on the whole sequence, its causal diagonals folded
    into bottom-right calls (torch's kernel with the band's mask)."""
    x = full_inputs(case)
    share = {n: mm.zigzag_split(t, grid.cp_size)[grid.cp_rank].to(case.dtype)
             for n, t in x.items()}
    q, k, v = (share[n].requires_grad_() for n in "qkv")
    out = mm.mesh_attention(q, k, v, grid, causal=case.causal, schedule=case.schedule,
                            backend=TorchFlashKernel(band_bottom_right=True))
    out.backward(share["dout"])
    got = {"out": out.detach().float(), "dq": q.grad.float(), "dk": k.grad.float(),
           "dv": v.grad.float()}
    return [Failure(f"folded {f.case}", f.message) for f in errors(case, got, grid, grid.cp_rank,
                                                                  x)]


def calls_worker(rank: int, world: int) -> dict:
    got = {"exactness": []}
    for a, r, c in grid_shapes(world):
        grid = mm.MeshGrid.build(rows=r, cols=c, heads=a)
        cases = [Case(64, 2, 4, 2, 16, causal=n % 2 == 0, schedule=schedule, seed=n,
                      dtype=torch.bfloat16 if n % 3 == 0 else torch.float32)
                 for n, schedule in enumerate(SCHEDULES * 2)]
        # grouped calls (the default) against SDPA on the whole sequence
        got["exactness"] += check_cases(grid, cases)
        for case in cases:  # and with the causal diagonal folded in
            if case.causal:
                got["exactness"] += folded_errors(case, grid)
        for schedule in SCHEDULES:
            for mask in MASKS:
                for grouped in (True, False):
                    got[(a, r, c, schedule, mask, grouped)] = count_calls(grid, schedule, mask,
                                                                          grouped)
            for mask in ("causal", "documents"):
                got[(a, r, c, schedule, mask, "folded")] = count_calls(grid, schedule, mask,
                                                                       True, fold=True)
        with capped(CAP):  # every call at most CAP keys or query rows: exact, as counted
            got["exactness"] += [Failure(f"capped {f.case}", f.message)
                                 for f in check_cases(grid, cases)]
            for case in cases:
                if case.causal:
                    got["exactness"] += folded_errors(case, grid)
            for schedule in SCHEDULES:
                for mask in ("causal", "full"):
                    got[(a, r, c, schedule, mask, "capped")] = count_calls(grid, schedule, mask,
                                                                           True)
                got[(a, r, c, schedule, "causal", "capped folded")] = count_calls(
                    grid, schedule, "causal", True, fold=True)
    return got


@pytest.fixture(scope="module")
def counted() -> list[dict]:
    return run_distributed(calls_worker, WORLD)


def test_grouped_calls_are_exact(counted) -> None:
    assert_no_failures([per_rank["exactness"] for per_rank in counted])


def test_dense_tiles_make_the_modelled_calls(counted) -> None:
    """Causal and full: each rank's calls equal `tile_calls` for its mesh rank (the CPU
    op's causal is top-left: the diagonal a call of its own; 'folded': one bottom-right
    call with the keys before it); ungrouped, one call per block. Packed documents with
    rows in every block (24 and 40 tokens) make the causal sequence's calls: each group's
    blocks joined document by document into one variable-length call."""
    bad = []
    for cp_rank, per_case in enumerate(counted):
        for key, calls in per_case.items():
            if key == "exactness":
                continue
            a, r, c, schedule, mask, grouped = key
            if mask not in ("causal", "full", "documents"):
                continue
            mesh_rank = cp_rank // a
            causal, fold = mask != "full", grouped in ("folded", "capped folded")
            # capped: a mesh chunk of 16 rows per head group (64 x a / 4)
            cap = {"chunk_tokens": 16 * a, "cap_tokens": CAP} if "capped" in str(grouped) else {}
            grouped = bool(grouped)
            want = {"forward": forward_calls(r, c, causal, schedule, rank=mesh_rank,
                                             grouped=grouped, bottom_right=fold, **cap),
                    "backward": backward_calls(r, c, causal, schedule, rank=mesh_rank,
                                               grouped=grouped, bottom_right=fold, **cap)}
            if not grouped and want != {"forward": r * c, "backward": r * c}:
                bad.append(Failure(f"{r}x{c} {schedule} model", f"ungrouped: {want}"))
            if calls != want:
                bad.append(Failure(f"{a}x{r}x{c} {schedule} {mask} grouped={grouped} "
                                   f"rank {cp_rank}", f"calls {calls}, want {want}"))
    assert_no_failures([bad])


def test_tiles_of_several_blocks_make_fewer_calls(counted) -> None:
    """Every mask kind: never more calls than blocks' calls; packed documents (THD or
    placed) one call per block ungrouped; a causal tile of R >= 2 K/V
    chunks on one query chunk (R x 1) in at most three calls per pass, whatever R (two
    forward where the diagonal is folded in)."""
    bad = []
    for cp_rank, per_case in enumerate(counted):
        for key, calls in per_case.items():
            if key == "exactness" or not key[-1]:
                continue
            a, r, c, schedule, mask, grouped = key
            blocks = per_case[(a, r, c, schedule, mask, False)]
            for phase in calls:
                if calls[phase] > blocks[phase]:
                    bad.append(Failure(f"{a}x{r}x{c} {schedule} {mask} rank {cp_rank}",
                                       f"{phase}: {calls[phase]} calls > {blocks[phase]} "
                                       "ungrouped"))
            if mask in ("documents", "placed") and max(blocks.values()) > r * c:
                # each block's documents in one variable-length call, whatever the grid: a
                # document's runs are gathered in the order of their positions (after the
                # heads all-to-all a mesh rank holds its members' runs one after another)
                bad.append(Failure(f"{a}x{r}x{c} {schedule} {mask} rank {cp_rank}",
                                   f"{blocks} calls for {r * c} blocks ungrouped"))
            if (mask == "causal" and c == 1 and r >= 2 and schedule != "streamed_kv"
                    and "capped" not in str(grouped)):
                most = 2 if grouped == "folded" else 3
                if calls["forward"] > most or calls["backward"] > 3:
                    bad.append(Failure(f"{a}x{r}x{c} {schedule} {grouped} rank {cp_rank}",
                                       f"calls {calls}: want at most {most} forward, 3 "
                                       "backward"))
    assert_no_failures([bad])


LOCAL = 64  # tokens per rank of the mask cases


def _mask_cases(seq: int) -> dict[str, dict]:
    """mesh_attention's keyword arguments of each mask the driver can build."""
    docs = [(a, min(seq, a + 11), a, min(seq, a + 11), "causal") for a in range(0, seq, 11)]
    chunks = [(c, min(b, c + 8), c, min(b, c + 8), "causal")
              for a, b in ((0, 40), (40, seq)) for c in range(a, b, 8)]
    cu = torch.tensor([0, 4, 40, 44, 92, seq], dtype=torch.int32)  # multiples of 2P
    return {"causal": dict(causal=True), "documents (cu_seqlens)": dict(cu_seqlens=cu),
            "documents (slices)": dict(mask=docs), "chunked": dict(mask=chunks),
            "prefix": dict(mask=mm.prefix_lm_mask(seq, seq // 3)),
            "window": dict(window_size=(8, 0))}


def masks_worker(rank: int, world: int) -> list[str]:
    """Each mask's forward and backward under `AttentionOps` on every grid and schedule:
    the additive masks the CPU op got (element counts)."""
    from attention_ops import AttentionOps

    bad = []
    for a, r, c in grid_shapes(world):
        grid = mm.MeshGrid.build(rows=r, cols=c, heads=a)
        for n, (name, kwargs) in enumerate(_mask_cases(LOCAL * world).items()):
            shape = (LOCAL,) if "cu_seqlens" in kwargs else (LOCAL, 2)
            q, k, v = (torch.randn(*shape, 4, 16, requires_grad=True) for _ in range(3))
            with AttentionOps() as ops:
                out = mm.mesh_attention(q, k, v, grid, schedule=SCHEDULES[n % 3], **kwargs)
                out.backward(torch.ones_like(out))
            biggest = max(ops.masks, default=0)
            limit = 128 * 2 * LOCAL if name == "window" else 0  # a block of rows: keys
            if biggest > limit:
                bad.append(f"{name} grid {grid.shape_text} rank {rank}: an additive mask of "
                           f"{biggest} elements reached the CPU op (at most {limit})")
    return bad


def test_masks_reach_the_cpu_op_without_a_mask() -> None:
    bad = [b for per_rank in run_distributed(masks_worker, 2) for b in per_rank]
    assert not bad, "\n".join(bad[:20])
