"""FlexAttention tiles (backend='flex', `kernels/flex.py`) on gloo ranks: every group of
blocks a schedule has on hand is ONE kernel call (its query chunks against its K/V chunks
with the tile's block mask), run eagerly on the CPU, forward and backward exact against an
fp64 formula over the whole sequence with the mask built here from its definition: causal,
full, packed documents (cu_seqlens), a sliding window and a SliceMask, on 2x2, 1x4, 4x1 and
2x1x2 grids over the three schedules (and a causal 2x2 of 128 tokens a rank: the mask
made block by block, FlexAttention's blocks). On the gathered schedule (the row's whole tile
one call forward, the diagonal then the rest backward) more masks in one process, one after
another with the same lengths (nothing kept for one mask may serve the next): padded
documents (one of 1 token, one longer than a chunk; the same lengths in another order), a
window of the chunk's length with attention sinks, a window longer than the sequence, a
two-sided window, prefix-LM and chunked (Llama 4) slices, with chunks not whole 128-row
blocks, GQA and V of its own head dim. The calls are counted on the kernel: one per group
and pass, as `cost_models.tile_calls` counts them for a kernel taking whole tiles (dense
sequences and documents in every block: exactly; slices, whole chunks gathered: at most;
a window's sparse exchange: at most the diagonal and one per query chunk of the row), and
none through the per-call interface."""
from __future__ import annotations

import pytest
import torch

import megatron_mesh as mm
from megatron_mesh.cost_models.tile_calls import backward_calls, forward_calls
from megatron_mesh.kernels import FlexTileKernel
from megatron_mesh.kernels.flex import BLOCK
from megatron_mesh.masks.documents import Documents, thd_split

from dist_utils import run_distributed

WORLD = 4
SEQ = 64  # 16 tokens a rank
CU = (0, 24, 40, 64)  # documents of multiples of 2P tokens
WINDOW = 9
SLICES = [(0, 20, 0, 20, "causal"), (20, 64, 0, 8, "full"), (20, 64, 10, 40, "causal"),
          (40, 50, 45, 60, "full")]
GRIDS = ((1, 2, 2), (1, 1, 4), (1, 4, 1), (2, 1, 2))
MASKS = ("causal", "full", "documents", "window", "slices")
SCHEDULES = ("gathered", "streamed_kv", "streamed_q")


def seen(mask: str, seq: int = SEQ) -> torch.Tensor:
    """[seq, seq] bool from the definition: query i sees key j."""
    i, j = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
    if mask == "full":
        return torch.ones(seq, seq, dtype=torch.bool)
    if mask == "causal":
        return j <= i
    if mask == "window":
        return (j <= i) & (i - j <= WINDOW)
    if mask == "documents":
        doc = torch.bucketize(torch.arange(SEQ), torch.tensor(CU[1:]), right=True)
        return (doc[:, None] == doc[None, :]) & (j <= i)
    out = torch.zeros(SEQ, SEQ, dtype=torch.bool)
    for q0, q1, k0, k1, kind in SLICES:
        inside = (i >= q0) & (i < q1) & (j >= k0) & (j < k1)
        if kind == "causal":  # aligned at the bottom right of the slice
            inside &= (j - k0) <= (i - q0) + (k1 - k0) - (q1 - q0)
        out |= inside
    return out


def reference(x: dict, mask: str, seq: int = SEQ) -> dict:
    """out, dq, dk, dv [S, b, h, d] in fp64 under the mask named `mask`."""
    return masked_reference(x, seen(mask, seq))


def masked_reference(x: dict, seen: torch.Tensor, sink: torch.Tensor | None = None) -> dict:
    """out, dq, dk, dv [S, b, h, d] in fp64: softmax(q k^T * scale, masked by `seen`
    [S, S]) v, rows that see nothing 0; GQA by repeating K/V; `sink` [hq]: one more logit
    per head with a value of 0 (and its gradient "dsink")."""
    q, k, v = (x[n].double().requires_grad_() for n in "qkv")
    groups = q.shape[2] // k.shape[2]
    kk, vv = (t.repeat_interleave(groups, 2) for t in (k, v))
    scores = torch.einsum("ibhd,jbhd->bhij", q, kk) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~seen, float("-inf"))
    if sink is None:
        p = torch.softmax(scores, -1).nan_to_num()
    else:
        sink = sink.double().requires_grad_()
        column = sink[None, :, None, None].expand(*scores.shape[:3], 1)
        p = torch.softmax(torch.cat([scores, column], -1), -1)[..., :-1]
    out = torch.einsum("bhij,jbhd->ibhd", p, vv)
    out.backward(x["dout"].double())
    got = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    return got if sink is None else {**got, "dsink": sink.grad}


class CountingFlex(FlexTileKernel):
    """FlexAttention's kernel, counting its whole-tile calls and its per-call ones."""

    def __init__(self) -> None:
        self.calls = {"tile_forward": 0, "tile_backward": 0, "forward": 0, "backward": 0}

    def tile_forward(self, *args):
        self.calls["tile_forward"] += 1
        return super().tile_forward(*args)

    def tile_backward(self, *args):
        self.calls["tile_backward"] += 1
        return super().tile_backward(*args)

    def forward(self, *args, **kwargs):
        self.calls["forward"] += 1
        return super().forward(*args, **kwargs)

    def backward(self, *args, **kwargs):
        self.calls["backward"] += 1
        return super().backward(*args, **kwargs)


def run_case(grid: mm.MeshGrid, mask: str, schedule: str, seed: int, seq: int = SEQ
             ) -> tuple[list[str], dict]:
    g = torch.Generator().manual_seed(seed)
    b = 1 if mask == "documents" else 2
    x = {n: torch.randn(seq, b, h, 8, generator=g)
         for n, h in (("q", 4), ("k", 2), ("v", 2), ("dout", 4))}
    kw = {"causal": mask != "full"}
    if mask == "documents":
        docs = Documents.from_cu_seqlens(torch.tensor(CU, dtype=torch.int32))
        split = lambda t: thd_split(t[:, 0], docs, grid.cp_size)[grid.cp_rank]  # noqa: E731
        kw["cu_seqlens"] = torch.tensor(CU, dtype=torch.int32)
    else:
        split = lambda t: mm.zigzag_split(t, grid.cp_size)[grid.cp_rank]  # noqa: E731
    if mask == "window":
        kw["window_size"] = (WINDOW, 0)
    if mask == "slices":  # whole chunks gathered (the window: only the rows used travel)
        kw = {"mask": mm.SliceMask(SLICES, SEQ), "window_exchange": "gathered"}
    share = {n: split(t) for n, t in x.items()}
    q, k, v = (share[n].clone().requires_grad_() for n in "qkv")
    kernel = CountingFlex()
    out = mm.mesh_attention(q, k, v, grid, backend=kernel, schedule=schedule, **kw)
    forward = dict(kernel.calls)
    out.backward(share["dout"])
    got = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    where = f"{mask} {schedule} grid {grid.shape_text} rank {grid.cp_rank}"
    bad = []
    for n, want in reference(x, mask, seq).items():
        err = (got[n].double() - split(want)).abs().max().item()
        if not err <= 2e-5 * max(1.0, want.abs().max().item()):
            bad.append(f"{where} {n}: max error {err:.3g}")
    calls = {"forward": forward["tile_forward"],
             "backward": kernel.calls["tile_backward"] - forward["tile_backward"],
             "per call": kernel.calls["forward"] + kernel.calls["backward"]}
    return bad, calls


LONG = 8 * 66  # chunks of 66 tokens: tiles of 132 to 528 rows, not whole 128-row blocks
PADDED = ((1, 37, 200, 90, 13), (8, 40, 200, 96, 16))  # (lengths, padded lengths)
REORDERED = ((13, 90, 200, 37, 1), (16, 96, 200, 40, 8))  # the same, in another order


def document_seen(lengths, padded, causal: bool = True, window=None) -> torch.Tensor:
    """[T, T] bool over the padded packed sequence from the definition: a real token sees
    the real tokens of its own document (j <= i where causal; within the window's (left,
    right) of positions counted in the document), padding nothing."""
    doc = torch.repeat_interleave(torch.arange(len(padded)), torch.tensor(padded))
    pos = torch.cat([torch.arange(n) for n in padded])
    real = pos < torch.tensor(lengths)[doc]
    i, j = pos[:, None], pos[None, :]
    out = (doc[:, None] == doc[None, :]) & real[:, None] & real[None, :]
    if causal:
        out &= j <= i
    if window is not None:
        out &= ((window[0] < 0) | (i - j <= window[0])) & ((window[1] < 0) | (j - i <= window[1]))
    return out


def masked_cases() -> dict:
    """name -> (mesh_attention's mask keywords, seen [T, T] from the definition, documents
    or None, sinks); one after another with the same lengths."""
    i, j = torch.arange(LONG)[:, None], torch.arange(LONG)[None, :]
    cu = (0, 7, 200, LONG)  # chunked: chunks restart at each document
    doc = torch.bucketize(torch.arange(LONG), torch.tensor(cu[1:]), right=True)
    chunk = doc * LONG + (torch.arange(LONG) - torch.tensor(cu)[doc]) // 100
    cases = {}
    for name, (lengths, padded), kw, window in (
            ("padded documents", PADDED, {}, None),
            ("reordered documents", REORDERED, {}, None),
            ("documents, two-sided window", PADDED, {"causal": False, "window_size": (20, 7)},
             (20, 7))):
        cu_seqlens, cu_padded = ([0, *torch.tensor(n).cumsum(0).tolist()]
                                 for n in (lengths, padded))
        docs = Documents.from_cu_seqlens(cu_seqlens, cu_padded)
        cases[name] = ({"cu_seqlens": docs, **kw},
                       document_seen(lengths, padded, kw.get("causal", True), window), docs,
                       False)
    cases.update({
        "window of a chunk, sinks": ({"window_size": (66, 0)}, (j <= i) & (i - j <= 66), None,
                                     True),
        "window beyond the sequence": ({"window_size": (5000, 0)}, j <= i, None, False),
        "two-sided window, gathered": ({"causal": False, "window_size": (100, 60),
                                        "window_exchange": "gathered"},
                                       (i - j <= 100) & (j - i <= 60), None, False),
        "prefix-LM": ({"mask": mm.prefix_lm_mask(LONG, 133)}, (j < 133) | (j <= i), None,
                      False),
        "chunked": ({"mask": mm.chunked_mask(LONG, 100, cu)},
                    (chunk[:, None] == chunk[None, :]) & (j <= i), None, False),
    })
    return cases


def run_masked_case(grid: mm.MeshGrid, name: str, kw: dict, seen_: torch.Tensor, docs,
                    sinks: bool, seed: int) -> list[str]:
    """One mask on the gathered schedule with backend='flex' against `masked_reference`:
    out, dq, dk, dv of this rank's rows, and the sinks' gradient summed over the ranks."""
    g = torch.Generator().manual_seed(seed)
    total, b = len(seen_), 1 if docs is not None else 2
    x = {n: torch.randn(total, b, h, e, generator=g)
         for n, h, e in (("q", 4, 8), ("k", 2, 8), ("v", 2, 6), ("dout", 4, 6))}
    if docs is not None:
        split = lambda t: thd_split(t[:, 0], docs, grid.cp_size)[grid.cp_rank]  # noqa: E731
    else:
        split = lambda t: mm.zigzag_split(t, grid.cp_size)[grid.cp_rank]  # noqa: E731
    share = {n: split(t) for n, t in x.items()}
    q, k, v = (share[n].clone().requires_grad_() for n in "qkv")
    sink = torch.randn(4, generator=g).requires_grad_() if sinks else None
    out = mm.mesh_attention(q, k, v, grid, backend="flex", schedule="gathered",
                            softmax_offset=sink, **kw)
    out.backward(share["dout"])
    got = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    want = masked_reference(x, seen_, None if sink is None else sink.detach())
    want = {n: t if n == "dsink" else split(t) for n, t in want.items()}
    if sink is not None:  # each rank's rows' part
        got["dsink"] = sink.grad.clone()
        torch.distributed.all_reduce(got["dsink"])
    bad = []
    for n, t in want.items():
        err = (got[n].double() - t).abs().max().item()
        if not err <= 2e-5 * max(1.0, t.abs().max().item()):
            bad.append(f"{name} gathered grid {grid.shape_text} rank {grid.cp_rank} {n}: "
                       f"max error {err:.3g}")
    return bad


def worker(rank: int, world: int) -> dict:
    got: dict = {"bad": []}
    for n, (a, r, c) in enumerate(GRIDS):
        grid = mm.MeshGrid.build(rows=r, cols=c, heads=a)
        for m, mask in enumerate(MASKS):
            schedule = SCHEDULES[(n + m) % len(SCHEDULES)]
            bad, calls = run_case(grid, mask, schedule, seed=10 * n + m)
            got["bad"] += bad
            got[(a, r, c, mask, schedule)] = calls
    # chunks of whole FlexAttention blocks (128 rows a rank): the mask made block by block
    grid = mm.MeshGrid.build(rows=2, cols=2)
    got["bad"] += run_case(grid, "causal", "streamed_kv", seed=99, seq=BLOCK * WORLD)[0]
    for n, (a, r, c) in enumerate(GRIDS):
        grid = mm.MeshGrid.build(rows=r, cols=c, heads=a)
        for m, (name, case) in enumerate(masked_cases().items()):
            got["bad"] += run_masked_case(grid, name, *case, seed=100 + 10 * n + m)
    return got


@pytest.fixture(scope="module")
def flexed() -> list[dict]:
    return run_distributed(worker, WORLD)


def test_flex_tiles_are_exact(flexed) -> None:
    bad = [b for per_rank in flexed for b in per_rank["bad"]]
    assert not bad, "\n".join(bad)


def test_flex_makes_one_call_per_tile_and_pass(flexed) -> None:
    """Dense sequences and documents in every block: each rank's calls equal the model's
    for a kernel taking whole tiles, never more than the grouped calls; slices leave some
    groups empty: at most that; none through the per-call forward / backward."""
    bad = []
    for cp_rank, per_rank in enumerate(flexed):
        for key, calls in per_rank.items():
            if key == "bad":
                continue
            a, r, c, mask, schedule = key
            mesh_rank = cp_rank // a
            causal = mask != "full"
            want = {phase: count(r, c, causal, schedule, rank=mesh_rank, whole_tile=True)
                    for phase, count in (("forward", forward_calls),
                                         ("backward", backward_calls))}
            grouped = {phase: count(r, c, causal, schedule, rank=mesh_rank)
                       for phase, count in (("forward", forward_calls),
                                            ("backward", backward_calls))}
            if mask == "window":  # the sparse exchange: the diagonal, then each query
                want = {"forward": c + 1, "backward": c + 1}  # chunk against the column
            exact = mask in ("causal", "full", "documents")
            for phase in want:
                if (calls[phase] != want[phase] if exact else calls[phase] > want[phase]):
                    bad.append(f"{key} rank {cp_rank} {phase}: {calls[phase]} calls, model "
                               f"{want[phase]}")
                if exact and want[phase] > grouped[phase]:
                    bad.append(f"{key} {phase}: whole tiles {want[phase]} > grouped "
                               f"{grouped[phase]}")
            if calls["per call"]:
                bad.append(f"{key} rank {cp_rank}: {calls['per call']} per-call calls")
    assert not bad, "\n".join(bad)
