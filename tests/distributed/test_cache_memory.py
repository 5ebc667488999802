"""Packed documents with a sliding window over a long run: the caches of block data (index
tensors, window masks) hold a few micro-batches' worth, not one entry per micro-batch ever
seen (`caches.py`); a backward whose blocks were dropped meanwhile is still exact."""
from __future__ import annotations

import gc
import random
import warnings

import torch

import megatron_mesh as mm
from megatron_mesh.common import caches
from megatron_mesh.masks.documents import Documents, thd_split

from dist_utils import run_distributed

TOTAL, HEADS, DIM, WINDOW = 256, 2, 8, (8, 0)
MICRO_BATCHES = 200


def new_documents(rng: random.Random, cp_size: int) -> Documents:
    """Random documents of TOTAL padded tokens, each padded to a multiple of 2P, each with
    a random number of real tokens."""
    unit = 2 * cp_size
    cuts = sorted(rng.sample(range(1, TOTAL // unit), rng.randint(1, 8)))
    padded = [0] + [c * unit for c in cuts] + [TOTAL]
    real = [0]
    for a, b in zip(padded, padded[1:]):
        real.append(real[-1] + rng.randint(1, b - a))
    return Documents.from_cu_seqlens(real, padded)


def reference(x: dict[str, torch.Tensor], documents: Documents) -> dict[str, torch.Tensor]:
    """out, dq, dk, dv [T, h, d] in fp64 from the definition: query i sees key j in its
    own document, both real tokens, j <= i and i - j <= WINDOW[0]; padding gets 0."""
    doc = torch.full((TOTAL,), -1)
    pos = torch.zeros(TOTAL, dtype=torch.int64)
    for d, (start, n) in enumerate(zip(documents.cu_padded, documents.lengths)):
        doc[start:start + n] = d
        pos[start:start + n] = torch.arange(n)
    seen = ((doc[:, None] == doc[None, :]) & (doc[:, None] >= 0)
            & (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] <= WINDOW[0]))
    real = seen.any(1)
    q, k, v = (x[n].double().requires_grad_() for n in "qkv")
    scores = torch.einsum("ihd,jhd->hij", q, k) * DIM ** -0.5
    scores = scores.masked_fill(~seen, float("-inf")).masked_fill(~real[:, None], 0.0)
    p = scores.softmax(-1) * real[:, None]
    out = torch.einsum("hij,jhd->ihd", p, v)
    out.backward(x["dout"].double())
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def live_tensor_bytes() -> int:
    """Bytes of every CPU tensor storage alive in this process, each storage once: whatever
    holds them (the caches, or anything else), found without asking the caches."""
    gc.collect()
    storages = {}
    with warnings.catch_warnings():  # isinstance on torch's deprecated aliases warns
        warnings.simplefilter("ignore", FutureWarning)
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for t in tensors:
        if t.device.type == "cpu" and not t.is_meta:
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def worker(rank: int, world: int) -> dict:
    grid = mm.MeshGrid.build(rows=world, cols=1)
    rng, gen = random.Random(7), torch.Generator().manual_seed(7)
    problems, held, live = [], {}, {}

    def call(documents: Documents):
        x = {n: torch.randn(TOTAL, HEADS, DIM, generator=gen) for n in ("q", "k", "v", "dout")}
        share = {n: thd_split(t, documents, world)[rank] for n, t in x.items()}
        q, k, v = (share[n].clone().requires_grad_() for n in "qkv")
        out = mm.mesh_attention(q, k, v, grid, causal=True, cu_seqlens=documents,
                                window_size=WINDOW)
        return x, share, (q, k, v), out

    # a backward after KEEP_DOCUMENTS + 2 newer micro-batches' forwards: its blocks are gone
    first_docs = new_documents(rng, world)
    first = call(first_docs)
    for _ in range(caches.KEEP_DOCUMENTS + 2):
        call(new_documents(rng, world))
    x, share, (q, k, v), out = first
    out.backward(share["dout"])
    ref = {n: thd_split(t, first_docs, world)[rank] for n, t in reference(x, first_docs).items()}
    for name, got in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        err = (got.detach().double() - ref[name]).abs().max().item()
        if err > 1e-5:
            problems.append(f"rank {rank}: {name} of a micro-batch whose blocks were dropped: "
                            f"max error {err:.3g}")
    for n in range(1, MICRO_BATCHES + 1):
        _, share, (q, k, v), out = call(new_documents(rng, world))
        out.backward(share["dout"])
        if n in (1, 8, 50, 100, MICRO_BATCHES):
            held[n] = caches.held_bytes()
            live[n] = live_tensor_bytes()
    return {"problems": problems, "held": held, "live": live}


def test_block_caches_stay_bounded_over_200_micro_batches_of_new_documents() -> None:
    world = 2
    results = run_distributed(worker, world)
    local = TOTAL // world
    # per micro-batch at most every block of the P x P with an explicit mask (bool and fp32,
    # local x local) and its row indices (int64), for KEEP_DOCUMENTS micro-batches
    bound = caches.KEEP_DOCUMENTS * world ** 2 * (5 * local ** 2 + 8 * 8 * local)
    inputs = 2 * 4 * TOTAL * HEADS * DIM * 4  # a micro-batch's inputs and their shares, alive
    for rank, result in enumerate(results):
        print(f"rank {rank}: after n micro-batches, bytes held by the block caches "
              f"{result['held']}, bytes of all live CPU tensors {result['live']} "
              f"(bound {bound} + inputs {inputs})")
        assert not result["problems"], result["problems"]
        assert result["held"][MICRO_BATCHES] <= bound, (rank, result["held"], bound)
        assert result["live"][MICRO_BATCHES] <= bound + inputs, (rank, result["live"])
