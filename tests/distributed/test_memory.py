"""Extra memory of each schedule, measured on CPU tensors, against `memory.extra_memory`
(every R x C shape and every heads x rows x cols grid, fp32 and bf16 with a small head dim;
the tiles' kernel calls grouped, as they run by default, and in fp32 also with the causal
diagonal folded into bottom-right calls, `bottom_right=True`, and with each call capped at
one chunk's keys or query rows, MESH_GROUP_TOKENS): streamed_kv holds two K/V
chunks instead of R, streamed_q two Q chunks instead of C, "streamed" picks the one that
holds less, and the model stays close to measurement. FlexAttention's whole tiles
(backend='flex', one call a group on hand) against `extra_memory(..., whole_tile=True)`:
the schedule's buffers, the calls' joined copies, masks (and their making) and results,
the kernel's own work unseen (`peak_memory.untracked`: on the CPU the eager op scores every pair, which the
compiled CUDA kernel never holds)."""
from __future__ import annotations

import os

import pytest
import torch

import megatron_mesh as mm
from megatron_mesh.cost_models.memory import extra_memory, streamed_schedule
from megatron_mesh.kernels import FlexTileKernel, TorchFlashKernel
from megatron_mesh.layer_plan import MeshPlan, Schedule, grid_shapes
from megatron_mesh.runtime.peak_memory import CpuPeakMemory, pass_peaks, untracked
from megatron_mesh.schedules import whole_tile

from dist_utils import run_distributed
from reference import Failure, assert_no_failures


def test_peak_memory_counts_live_storages() -> None:
    with CpuPeakMemory() as mem:
        a = torch.ones(1000, 250)  # 1 MB
        view = a[:10]
        b = torch.ones(500, 1000)  # 2 MB
        del a
        assert mem.live_bytes == 3_000_000  # the view keeps a's storage alive
        del view
        b.add_(1)  # in place: nothing new
        assert mem.live_bytes == 2_000_000
    assert mem.peak_bytes == 3_000_000


# one rank's share: fp32 with GQA 8/2, and bf16 with d = 4, where the fp32 lse and
# softmax statistics weigh as much as the chunks themselves
SIZES = {"fp32": dict(s=64, b=1, hq=8, hkv=2, d=32, dtype=torch.float32),
         "bf16 d4": dict(s=128, b=1, hq=16, hkv=4, d=4, dtype=torch.bfloat16),
         "fp32 folded": dict(s=64, b=1, hq=8, hkv=2, d=32, dtype=torch.float32),
         "fp32 capped": dict(s=64, b=1, hq=8, hkv=2, d=32, dtype=torch.float32)}
# "capped": at most one chunk's keys (or query rows) per grouped call (the R x C meshes)
CAPPED = "64"
# "folded": the diagonal folded into bottom-right calls, as CUDA's flash op takes them; on
# the CPU by the band's mask, which a layer makes once per shape and keeps (not counted:
# measured on a second pass)
FOLDED = TorchFlashKernel(band_bottom_right=True)
SCHEDULES = tuple(str(s) for s in Schedule)


def problem(size: str, world: int) -> mm.AttentionShape:
    s, b, hq, hkv, d, dtype = SIZES[size].values()
    return mm.AttentionShape(s * world, b, hq, hkv, d, dtype.itemsize)


def cases(world: int) -> list[tuple[str, int, int, int, str]]:
    """(size, heads, rows, cols, schedule): every R x C shape with each schedule (those
    without their ring run the gathered code) and every heads grid A > 1 with each schedule
    that has its ring."""
    out = []
    for size in SIZES:
        for a, r, c in grid_shapes(world):
            for schedule in SCHEDULES:
                ringless = (schedule == "streamed_kv" and r == 1) or (
                    schedule == "streamed_q" and c == 1)
                if (a == 1 or not ringless) and (a == 1 or size not in ("fp32 folded",
                                                                        "fp32 capped")):
                    out.append((size, a, r, c, schedule))
    return out


def measure_worker(rank: int, world: int) -> dict:
    results, grids = {}, {}
    for size, a, rows, cols, schedule in cases(world):
        s, b, hq, hkv, d, dtype = SIZES[size].values()
        if (a, rows, cols) not in grids:
            grids[a, rows, cols] = mm.MeshGrid.build(rows=rows, cols=cols, heads=a)
        g = torch.Generator().manual_seed(rank)
        q, k, v = (torch.randn(s, b, h, d, generator=g).to(dtype).requires_grad_()
                   for h in (hq, hkv, hkv))
        dout = torch.randn(s, b, hq, d, generator=g).to(dtype)
        grid = grids[a, rows, cols]
        folded = size == "fp32 folded"
        run = lambda: mm.mesh_attention(q, k, v, grid, schedule=schedule,  # noqa: E731
                                        backend=FOLDED if folded else "auto")
        if folded:  # the band masks made once
            pass_peaks(run, dout)
            q.grad = k.grad = v.grad = None  # else the next backward adds into them
        if size == "fp32 capped":  # the runtime and the model read the cap alike
            os.environ["MESH_GROUP_TOKENS"] = CAPPED
        try:
            measured = pass_peaks(run, dout)
            model = extra_memory(problem(size, world), MeshPlan(rows, cols, schedule, heads=a),
                                 bottom_right=folded)
        finally:
            os.environ.pop("MESH_GROUP_TOKENS", None)
        results[(size, a, rows, cols, schedule)] = {
            phase: (measured[phase], model[phase]) for phase in ("forward", "backward")}
    return results


@pytest.mark.parametrize("q_heads,kv_heads,rows,cols,expected", [
    (32, 32, 64, 1, "streamed_kv"),  # one column: no Q ring to run
    (32, 32, 1, 64, "streamed_q"),  # one row: no K/V ring
    (32, 8, 8, 8, "streamed_q"),  # GQA: K/V chunks are small, gathering them costs little
    (32, 32, 16, 4, "streamed_kv"),  # MHA, tall: R K/V chunks would cost the most
])
def test_streamed_picks_the_ring_that_holds_less(q_heads, kv_heads, rows, cols, expected) -> None:
    shape = mm.AttentionShape(131072, 1, q_heads, kv_heads, 128, 2)
    assert streamed_schedule(shape, rows, cols) == expected
    other = "streamed_q" if expected == "streamed_kv" else "streamed_kv"
    mine, theirs = (extra_memory(shape, rows, cols, s) for s in (expected, other))
    assert max(mine.values()) < max(theirs.values())


def peak(phases: dict) -> int:
    return max(measured for measured, _ in phases.values())


def test_streaming_bounds_memory_and_the_model_matches() -> None:
    per_rank = run_distributed(measure_worker, 8)
    problems = []
    for key, phases in per_rank[0].items():  # the model is the peak of the rank that holds most
        for phase, (_, model) in phases.items():
            worst = max(results[key][phase][0] for results in per_rank)
            if not 0.9 * model <= worst <= 1.1 * model:
                size, a, r, c, schedule = key
                problems.append(Failure(f"{size} {a}x{r}x{c} {schedule} {phase}",
                                        f"measured {worst} B on the rank holding most, model "
                                        f"{model} B ({worst / model:.2f})"))
    for rank, everything in enumerate(per_rank):
        results = {key[2:]: v for key, v in everything.items() if key[:2] == ("fp32", 1)}
        for rows, cols in ((8, 1), (4, 2)):  # K/V: two chunks streamed instead of R gathered
            streamed = results[(rows, cols, "streamed_kv")]["backward"][0]
            gathered = results[(rows, cols, "gathered")]["backward"][0]
            if not streamed < gathered:
                problems.append(Failure(f"fp32 {rows}x{cols} streamed_kv backward",
                                        f"rank {rank}: {streamed} B is not below gathered "
                                        f"{gathered} B"))
        tall = results[(8, 1, "streamed_kv")]["backward"][0] / results[(8, 1, "gathered")]["backward"][0]
        if tall > 0.6:
            problems.append(Failure("fp32 8x1 streamed_kv backward",
                                    f"rank {rank}: /gathered memory {tall:.2f} > 0.6"))
        for phase in ("forward", "backward"):  # Q: two chunks streamed instead of C gathered
            wide = results[(1, 8, "streamed_q")][phase][0] / results[(1, 8, "gathered")][phase][0]
            if wide > 0.6:
                problems.append(Failure(f"fp32 1x8 streamed_q {phase}",
                                        f"rank {rank}: /gathered memory {wide:.2f} > 0.6"))
        shape = problem("fp32", 8)
        for rows, cols in mm.mesh_shapes(8):  # "streamed" runs the ring that measured less
            chosen = streamed_schedule(shape, rows, cols)  # (a tie within 5% may go either way)
            other = "streamed_q" if chosen == "streamed_kv" else "streamed_kv"
            if peak(results[(rows, cols, chosen)]) > 1.05 * peak(results[(rows, cols, other)]):
                problems.append(Failure(f"fp32 {rows}x{cols} streamed",
                                        f"rank {rank}: picks {chosen} "
                                        f"({peak(results[(rows, cols, chosen)])} B) over {other} "
                                        f"({peak(results[(rows, cols, other)])} B)"))
    assert_no_failures([problems])


# FlexAttention's whole tiles: chunks of 256 tokens (each zigzag half whole 128 x 128 blocks)
FLEX_SIZE = dict(s=256, b=1, hq=8, hkv=2, d=32)
FLEX_GRIDS = ((2, 2), (1, 4), (4, 1))


class FusedFlex(FlexTileKernel):
    """FlexAttention's kernel with its own work unseen: counted are its results and the
    BlockMask it makes of the tile's mask, as the compiled CUDA kernel holds them."""

    def tile_forward(self, q, k, v, mask, scale):
        return untracked(lambda: FlexTileKernel.tile_forward(self, q, k, v, mask, scale),
                         lambda _: block_mask_tensors(mask, q.device))

    def tile_backward(self, dout, q, k, v, out, lse, mask, scale):
        return untracked(lambda: FlexTileKernel.tile_backward(self, dout, q, k, v, out, lse,
                                                              mask, scale),
                         lambda _: block_mask_tensors(mask, q.device))


def block_mask_tensors(mask, device) -> list[torch.Tensor]:
    return [t for t in mask.block_mask(device).as_tuple() if isinstance(t, torch.Tensor)]


def blocks_unseen(make):
    """`whole_tile.blocks_for` for the measurement: the blocks' calls (made once per shape
    and micro-batch, for every backend, and kept) unseen; the masks made of them seen,
    each made for its call (none kept for later calls): the making and the mask."""
    def blocks_for(*args, **kwargs):
        return untracked(lambda: make(*args, **kwargs))
    return blocks_for


def flex_worker(rank: int, world: int) -> dict:
    s, b, hq, hkv, d = FLEX_SIZE.values()
    shape = mm.AttentionShape(s * world, b, hq, hkv, d, 4)
    make, kept = whole_tile.blocks_for, whole_tile._tile_mask.dense_size
    whole_tile.blocks_for, whole_tile._tile_mask.dense_size = blocks_unseen(make), 0
    results = {}
    try:
        for rows, cols in FLEX_GRIDS:
            grid = mm.MeshGrid.build(rows=rows, cols=cols)
            for schedule in SCHEDULES:
                g = torch.Generator().manual_seed(rank)
                q, k, v = (torch.randn(s, b, h, d, generator=g).requires_grad_()
                           for h in (hq, hkv, hkv))
                dout = torch.randn(s, b, hq, d, generator=g)
                measured = pass_peaks(lambda: mm.mesh_attention(  # noqa: B023
                    q, k, v, grid, schedule=schedule, backend=FusedFlex()), dout)
                model = extra_memory(shape, rows, cols, schedule, whole_tile=True)
                results[rows, cols, schedule] = {phase: (measured[phase], model[phase])
                                                 for phase in measured}
    finally:
        whole_tile.blocks_for, whole_tile._tile_mask.dense_size = make, kept
    return results


def test_whole_tiles_memory_matches_the_model() -> None:
    """backend='flex' on 2x2, 1x4, 4x1 with each schedule, causal fp32: the rank holding
    most within 0.9x - 1.1x of `extra_memory(..., whole_tile=True)`."""
    per_rank = run_distributed(flex_worker, 4)
    problems = []
    for key, phases in per_rank[0].items():
        for phase, (_, model) in phases.items():
            worst = max(results[key][phase][0] for results in per_rank)
            if not 0.9 * model <= worst <= 1.1 * model:
                r, c, schedule = key
                problems.append(Failure(f"flex {r}x{c} {schedule} {phase}",
                                        f"measured {worst} B on the rank holding most, model "
                                        f"{model} B ({worst / model:.2f})"))
    assert_no_failures([problems])
