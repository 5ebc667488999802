"""Inference through the mesh against the formula in fp64 over the whole cache: prefill
(mesh_attention's forward, its K / V share written into the sharded cache) and decode steps
(one new token per sequence, appended round robin; partial (out, lse) per rank, one
all-gather and the log-sum-exp merge, or the two all-reduces; the sink after it) for a
batch of prompts of different lengths (not multiples of 2P), MHA / GQA / MQA, a window,
sinks, a prefix-LM model (its prefix bidirectional in prefill, each generated token's row
read from the same mask in decode), on 2x2, 1x4 and 2x1x2; the cache of each rank holds
1 / P of the tokens, and the bytes counted equal the formulas (prefill: the mesh forward's;
decode: the exchange's)."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import megatron_mesh as mm
from megatron_mesh.attention import layer_shape, plan_for
from megatron_mesh.calls.layout import zigzag_split
from megatron_mesh.cost_models.decode_traffic import cache_slots, decode_step_bytes
from megatron_mesh.inference import (
    CacheLayout,
    KVShard,
    PackedShard,
    decode_attention,
    prefill_attention,
    prefill_packed,
)
from megatron_mesh.inference.packed import placed_positions
from megatron_mesh.inference.session import DECODE, InferenceSession
from megatron_mesh.runtime import agreement

from dist_utils import run_distributed

LENGTHS = (5, 11, 14)  # real prompt lengths of the batch; padded to 16 (2P = 8)
STEPS = 7  # decode steps: not a multiple of P, so the round robin ends unevenly


@dataclass(frozen=True)
class DecodeCase:
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 8
    window: int | None = None  # left window (causal)
    sink: bool = False
    seed: int = 0
    prefix: int | None = None  # a prefix-LM model: its first `prefix` tokens bidirectional

    def __str__(self) -> str:
        return (f"hq={self.q_heads} hkv={self.kv_heads} window={self.window} sink={self.sink}"
                + ("" if self.prefix is None else f" prefix-LM {self.prefix}"))

    def mask(self, seq: int) -> mm.SliceMask | None:
        """The model's mask over the whole generated sequence of `seq` positions."""
        return None if self.prefix is None else mm.prefix_lm_mask(seq, self.prefix)


CASES = [DecodeCase(), DecodeCase(kv_heads=4, seed=1), DecodeCase(kv_heads=1, seed=2),
         DecodeCase(window=6, seed=3), DecodeCase(sink=True, seed=4),
         DecodeCase(window=3, sink=True, kv_heads=1, seed=5),
         DecodeCase(prefix=4, kv_heads=1, seed=6), DecodeCase(prefix=5, window=3, seed=7)]


def tensors(case: DecodeCase, seq: int) -> dict[str, torch.Tensor]:
    """q [seq, b, hq, d], k / v [seq, b, hkv, d] of every position (prompt and decode), fp64,
    and the sink logits [hq]; the same on every rank (one seed)."""
    g = torch.Generator().manual_seed(case.seed)
    b = len(LENGTHS)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    return {"q": rnd(seq, b, case.q_heads, case.head_dim),
            "k": rnd(seq, b, case.kv_heads, case.head_dim),
            "v": rnd(seq, b, case.kv_heads, case.head_dim),
            "sink": rnd(case.q_heads)}


def formula(x: dict[str, torch.Tensor], seq_b: int, query: int, keys: list[int],
            case: DecodeCase) -> torch.Tensor:
    """out [hq, d] of sequence seq_b's query at position `query` over key positions `keys`
    (fp64): softmax over the visible keys (and the sink logit), times V."""
    scale = case.head_dim ** -0.5
    g = case.q_heads // case.kv_heads
    q = x["q"][query, seq_b]  # [hq, d]
    k = x["k"][keys, seq_b].repeat_interleave(g, dim=1)  # [n, hq, d]
    v = x["v"][keys, seq_b].repeat_interleave(g, dim=1)
    s = torch.einsum("hd,nhd->hn", q, k) * scale
    if case.sink:
        s = torch.cat([s, x["sink"][:, None]], dim=1)
        v = torch.cat([v, torch.zeros_like(v[:1])], dim=0)
    return torch.einsum("hn,nhd->hd", torch.softmax(s, dim=1), v)


def seen(case: DecodeCase, query: int, length: int, step: int | None) -> list[int]:
    """Key positions a query at `query` sees: the prompt's real tokens and decoded ones up
    to itself, within the window; a prefix-LM's prefix sees all of the prefix."""
    last = query if step is not None else min(query, length - 1)
    if case.prefix is not None and query < case.prefix and case.window is None:
        last = case.prefix - 1  # within every prompt (prefix <= its length); a window (L, 0)
        # keeps no later key
    lo = 0 if case.window is None else max(0, query - case.window)
    return list(range(lo, last + 1))


def check(rank: int, world: int, shape: tuple[int, int, int], device: str = "cpu"
          ) -> tuple[list[str], int]:
    """(failures, key tokens this rank's cache holds after the first case); the cache and
    every tensor the attention takes on `device`."""
    heads, rows, cols = shape
    grid = mm.MeshGrid.build(rows=rows, cols=cols, heads=heads)
    failures: list[str] = []
    held = 0
    b = len(LENGTHS)
    prompt = -(-max(LENGTHS) // (2 * world)) * 2 * world
    layout = CacheLayout(world, rank, prompt, STEPS)
    lengths = torch.tensor(LENGTHS)
    for case in CASES:
        x = tensors(case, prompt + STEPS + max(LENGTHS))
        sink = x["sink"].float().to(device) if case.sink else None
        shard = KVShard.allocate(layout, b, case.kv_heads, case.head_dim, case.head_dim,
                                 torch.float32, device)
        share = [zigzag_split(x[n][:prompt].float(), world)[rank].to(device) for n in "qkv"]
        positions = layout.prompt_positions()
        window = None if case.window is None else (case.window, 0)
        mask = case.mask(prompt + STEPS)
        with mm.TrafficCounter() as counter:
            out = prefill_attention(*share, grid, shard, positions, lengths, window_size=window,
                                    softmax_offset=sink, attention_mask=mask)
        if window is None and mask is None:  # the forward's formula (else the sparse one's)
            want = mm.mesh_traffic(layer_shape(share[0], share[1], grid),
                                   plan_for(share[0], share[1], grid)).forward
            if counter.total_bytes != want:
                failures.append(f"{shape} {case} prefill sent {counter.total_bytes}, "
                                f"formula {want}")
        for i, p in enumerate(positions.tolist()):
            for sb, n in enumerate(LENGTHS):
                if p < n:
                    ref = formula(x, sb, p, seen(case, p, n, None), case)
                    err = (out[i, sb].double().cpu() - ref).abs().max().item()
                    if err > 1e-5:
                        failures.append(f"{shape} {case} prefill pos {p} seq {sb}: {err:.2e}")
        for step in range(STEPS):
            # sequence sb's step-th new token sits at position LENGTHS[sb] + step; its q, k, v
            # are row `prompt + step` of x (any fresh values do)
            row = prompt + step
            q_pos = lengths + step
            new = {n: x[n][row].float().to(device) for n in "qkv"}
            if layout.owner(step) == rank:
                shard.append(layout.slot(step), new["k"], new["v"], q_pos.to(device))
            with mm.TrafficCounter() as counter:
                got = decode_attention(new["q"], shard, q_pos.to(device), case.head_dim ** -0.5,
                                       None, world, case.window, sink, attention_mask=mask)
            want = decode_step_bytes(b, case.q_heads, case.head_dim, world)
            if counter.total_bytes != want:
                failures.append(f"{shape} {case} step {step}: sent {counter.total_bytes}, "
                                f"formula {want}")
            reduced = decode_attention(new["q"], shard, q_pos.to(device),
                                       case.head_dim ** -0.5, None, world, case.window, sink,
                                       exchange="all_reduce", attention_mask=mask)
            for name, result in (("all_gather", got), ("all_reduce", reduced)):
                failures += _compare(x, case, shape, step, prompt, row, result.cpu(), name)
        # the cache is sharded: this rank holds its slots, 1 / P of one device's
        if shard.k.shape[0] != cache_slots(max(LENGTHS), STEPS, world):
            failures.append(f"{shape} {case}: {shard.k.shape[0]} slots")
        if case == CASES[0]:
            held = shard.tokens()
    return failures, held


def _compare(x: dict[str, torch.Tensor], case: DecodeCase, shape: tuple[int, int, int],
             step: int, prompt: int, row: int, got: torch.Tensor, exchange: str) -> list[str]:
    """Failures of one decode step's out [b, hq, d] against the formula over the whole cache."""
    failures = []
    for sb, n in enumerate(LENGTHS):
        # reference keys: prompt tokens and new tokens 0 .. step, at their positions
        x_seq = {k: v.clone() for k, v in x.items()}
        for j in range(step + 1):
            for name in ("k", "v"):
                x_seq[name][n + j, sb] = x[name][prompt + j, sb]
        x_seq["q"][n + step, sb] = x["q"][row, sb]
        ref = formula(x_seq, sb, n + step, seen(case, n + step, n, step), case)
        err = (got[sb].double() - ref).abs().max().item()
        if err > 1e-5:
            failures.append(f"{shape} {case} {exchange} step {step} seq {sb}: {err:.2e}")
    return failures


def _run(shape: tuple[int, int, int]) -> None:
    world = shape[0] * shape[1] * shape[2]
    results = run_distributed(check, world, shape)
    errors = [e for failures, _ in results for e in failures]
    assert not errors, "\n".join(errors[:20])
    held = [n for _, n in results]
    assert sum(held) == len(LENGTHS) * STEPS + sum(LENGTHS)  # every token once
    # each rank: its zigzag share of the real prompt tokens and its round-robin steps
    for rank, n in enumerate(held):
        prompt = -(-max(LENGTHS) // (2 * world)) * 2 * world
        pos = zigzag_split(torch.arange(prompt), world)[rank]
        mine = sum(int((pos < n_b).sum()) for n_b in LENGTHS)
        steps = len(range(rank, STEPS, world))
        assert n == mine + steps * len(LENGTHS), (rank, n)


def _gpu_check(rank: int, world: int, shape: tuple[int, int, int]) -> tuple[list[str], int]:
    """`check` with the ranks sharing one GPU, their collectives staged through host memory."""
    import host_staging
    torch.cuda.set_device(0)
    with host_staging.staged_through_host():
        return check(rank, world, shape, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 2, 2), (2, 1, 2)])
def test_decode_on_ranks_sharing_one_gpu(shape: tuple[int, int, int]) -> None:
    """Prefill through the CUDA kernels into a cache on the GPU, then decode steps (both
    exchanges, windows, sinks, GQA / MQA) against the fp64 formula within 1e-5 in fp32."""
    results = run_distributed(_gpu_check, 4, shape, cuda=True)
    errors = [e for failures, _ in results for e in failures]
    assert not errors, "\n".join(errors[:20])


def test_decode_2x2() -> None:
    _run((1, 2, 2))
    failures = [f for rank in run_distributed(session_failures, 4, timeout_s=120) for f in rank]
    assert not failures, "\n".join(failures)


LAYERS = (1, 2)  # a session's layers


def session_failures(rank: int, world: int) -> list[str]:
    """InferenceSession on a 2x2 grid, 2 layers, 3 decode steps: exact against the formula
    (a prefix-LM model's too),
    the ranks agreeing once per layer at the first step and once per step after it; ranks
    that disagree (a window, an exchange or sinks on one rank, another step, a change on one
    rank after the first step, bad input on one rank) and a step past the cache's room
    raise ValueError on every rank, naming what differs, none hangs."""
    grid = mm.MeshGrid.build(rows=2, cols=2)
    case, steps = DecodeCase(), 3
    prompt = -(-max(LENGTHS) // (2 * world)) * 2 * world
    x = tensors(case, prompt + steps + max(LENGTHS))
    scale = case.head_dim ** -0.5
    calls = [0]
    counted = agreement.max_over_cp

    def counting(*args):
        calls[0] += 1
        return counted(*args)

    agreement.max_over_cp = counting  # counts the agreements' collectives; runs them

    def session(exchange: str = "all_gather") -> InferenceSession:
        s = InferenceSession(CacheLayout(world, rank, prompt, steps), torch.tensor(LENGTHS),
                             exchange=exchange)
        share = [zigzag_split(x[n][:prompt].float(), world)[rank] for n in "qkv"]
        for layer in LAYERS:
            s.attend(layer, *share, grid, scale)
        s.phase = DECODE
        return s

    def step(s: InferenceSession, n: int, changes: dict | None = None,
             batch: int = len(LENGTHS)) -> list[torch.Tensor]:
        s.step = n
        new = [x[name][prompt + n, :batch].float()[None] for name in "qkv"]  # [1, b, h, d]
        return [s.attend(layer, *new, grid, scale, **(changes or {}).get(layer, {}))
                for layer in LAYERS]

    failures = []
    s = session()
    for n in range(steps):
        calls[0] = 0
        for out in step(s, n):
            failures += _compare(x, case, (1, 2, 2), n, prompt, prompt + n, out[0], "session")
        if calls[0] != (len(LAYERS) if n == 0 else 1):
            failures.append(f"rank {rank} step {n}: {calls[0]} agreements")
    # a prefix-LM model's session: its prefix bidirectional in prefill, decode reading each
    # new token's row of the same mask
    lm = DecodeCase(prefix=4)
    s = InferenceSession(CacheLayout(world, rank, prompt, steps), torch.tensor(LENGTHS),
                         attention_mask=lm.mask(prompt + steps))
    share = [zigzag_split(x[n][:prompt].float(), world)[rank] for n in "qkv"]
    positions = zigzag_split(torch.arange(prompt), world)[rank].tolist()
    for layer in LAYERS:
        out = s.attend(layer, *share, grid, scale)
        for i, p in enumerate(positions):
            for sb, n in enumerate(LENGTHS):
                if p < n:
                    err = (out[i, sb].double() - formula(x, sb, p, seen(lm, p, n, None), lm))
                    if err.abs().max() > 1e-5:
                        failures.append(f"rank {rank} prefix-LM session prefill pos {p} seq {sb}")
    s.phase = DECODE
    for n in range(steps):
        for out in step(s, n):
            failures += _compare(x, lm, (1, 2, 2), n, prompt, prompt + n, out[0], "session")
    window, sink = {1: {"window": (3, 0)}}, {2: {"softmax_offset": x["sink"].float()}}

    def at_step_1_rank_0_adds_a_window() -> None:
        s = session()
        step(s, 0)
        step(s, 1, window if rank == 0 else None)

    cases = {  # what runs -> the words every rank's ValueError holds
        "window on rank 1": (lambda: step(session(), 0, window if rank == 1 else None),
                             ["window_size", "left 3", "CP rank 1"]),
        "exchange on rank 2": (lambda: step(session("all_reduce" if rank == 2 else
                                                    "all_gather"), 0),
                               ["exchange", "'all_reduce'", "CP rank 2"]),
        "sinks on rank 3": (lambda: step(session(), 0, sink if rank == 3 else None),
                            ["softmax_offset", "given", "CP rank 3"]),
        "another step on rank 0": (lambda: step(session(), 1 if rank == 0 else 0),
                                   ["arguments to a decode step: step", "CP rank 0"]),
        "a change after the first step": (
            at_step_1_rank_0_adds_a_window,
            ["changed since the last agreement", "layer 1 at step 1: window_size left 3 "
             "after none"]),
        "another batch on rank 3": (lambda: step(session(), 0, batch=2 if rank == 3 else 3),
                                    ["takes 3 sequences, got 2", "CP rank 3"]),
        "past the room": (lambda: step(session(), steps),
                          ["decode step 3 is past the KV cache's room", "steps 0 .. 2"]),
    }
    for name, (run, words) in cases.items():
        try:
            run()
            failures.append(f"rank {rank} {name}: not refused")
        except ValueError as e:
            failures += [f"rank {rank} {name}: {w!r} not in {e}" for w in words if w not in str(e)]
    return failures


def test_decode_1x4() -> None:
    _run((1, 1, 4))


def test_decode_heads_2x1x2() -> None:
    _run((2, 1, 2))


def test_decode_one_rank() -> None:
    """CP = 1: the same code on one rank (no exchange)."""
    _run((1, 1, 1))


DOCS = (7, 3, 12, 10)  # packed prompt documents (32 tokens: a multiple of 2P for P <= 4)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: torch.Tensor | None
           ) -> torch.Tensor:
    """The formula in fp64: q [hq, d] over keys k, v [n, hkv, d] (and a sink logit per
    head) -> [hq, d]."""
    g = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = torch.einsum("hd,nhd->hn", q, k) * q.shape[-1] ** -0.5
    if sink is not None:
        s = torch.cat([s, sink[:, None]], dim=1)
        v = torch.cat([v, torch.zeros_like(v[:1])], dim=0)
    return torch.einsum("hn,nhd->hd", torch.softmax(s, dim=1), v)


PACKED_CASES = (DecodeCase(), DecodeCase(kv_heads=1, window=4, sink=True, seed=7),
                DecodeCase(prefix=3, kv_heads=1, seed=8),  # prefix <= every document
                DecodeCase(prefix=2, window=2, sink=True, seed=9))


def check_packed(rank: int, world: int, shape: tuple[int, int, int]) -> tuple[list[str], int]:
    """Packed prompts placed by place_documents: prefill with the placement, then decode
    steps continuing every document, causal or under a prefix-LM model's mask (over each
    document's positions: its prefix bidirectional in prefill, each new token's row in
    decode); (failures, tokens this rank's cache holds)."""
    heads, rows, cols = shape
    grid = mm.MeshGrid.build(rows=rows, cols=cols, heads=heads)
    cu = [0]
    for n in DOCS:
        cu.append(cu[-1] + n)
    placement = mm.place_documents(cu, world)
    layout = CacheLayout(world, rank, sum(DOCS), STEPS)  # the session's: who owns each step
    failures, held = [], 0
    for case in PACKED_CASES:
        mask = case.mask(max(DOCS) + STEPS)  # the model's, over one document's positions
        g = torch.Generator().manual_seed(case.seed)
        docs = [{n: torch.randn(length + STEPS, h, case.head_dim, generator=g,
                                dtype=torch.float64)
                 for n, h in (("q", case.q_heads), ("k", case.kv_heads), ("v", case.kv_heads))}
                for length in DOCS]
        sink = torch.randn(case.q_heads, generator=g, dtype=torch.float64) if case.sink else None
        sink32 = None if sink is None else sink.float()
        whole = {n: torch.cat([d[n][:length] for d, length in zip(docs, DOCS)]) for n in "qkv"}
        share = [placement.permute(whole[n], rank).float() for n in "qkv"]
        shard = PackedShard.allocate(placement, STEPS, case.kv_heads, case.head_dim,
                                     case.head_dim, torch.float32, "cpu")
        window = None if case.window is None else (case.window, 0)
        with mm.TrafficCounter() as counter:
            out = prefill_packed(*share, grid, shard, placement, window_size=window,
                                 softmax_offset=sink32, attention_mask=mask)
        bytes_shape = mm.AttentionShape(sum(DOCS), 1, case.q_heads, case.kv_heads,
                                        case.head_dim, 4)
        want = mm.placement_traffic(bytes_shape, placement, rows, cols, heads,
                                    window_size=window, cp_rank=rank).forward
        if counter.total_bytes != want and mask is None:
            failures.append(f"{shape} packed {case} prefill sent {counter.total_bytes}, "
                            f"formula {want}")
        seq, pos = placed_positions(placement, rank)
        for i, (doc, p) in enumerate(zip(seq.tolist(), pos.tolist())):
            keys = seen(case, p, DOCS[doc], None)
            d = docs[doc]
            ref = attend(d["q"][p], d["k"][keys], d["v"][keys], sink)
            err = (out[i].double() - ref).abs().max().item()
            if err > 1e-5:
                failures.append(f"{shape} packed {case} prefill doc {doc} pos {p}: {err:.2e}")
        lengths = torch.tensor(DOCS)
        for step in range(STEPS):
            q_pos = lengths + step
            new = {n: torch.stack([d[n][length + step] for d, length in zip(docs, DOCS)])
                   for n in "qkv"}
            if layout.owner(step) == rank:
                shard.append(step, new["k"].float(), new["v"].float(), q_pos)
            for exchange in ("all_gather", "all_reduce"):
                got = decode_attention(new["q"].float(), shard, q_pos, case.head_dim ** -0.5,
                                       None, world, case.window, sink32, exchange,
                                       attention_mask=mask)
                for doc, (d, length) in enumerate(zip(docs, DOCS)):
                    keys = seen(case, length + step, length, step)
                    ref = attend(d["q"][length + step], d["k"][keys], d["v"][keys], sink)
                    err = (got[doc].double() - ref).abs().max().item()
                    if err > 1e-5:
                        failures.append(f"{shape} packed {case} {exchange} step {step} doc "
                                        f"{doc}: {err:.2e}")
        if mask is not None:
            failures += _packed_session(grid, placement, layout, case, docs, share, sink)
        held = shard.tokens()
    return failures, held


def _packed_session(grid: mm.MeshGrid, placement: mm.DocumentPlacement, layout: CacheLayout,
                    case: DecodeCase, docs: list[dict[str, torch.Tensor]],
                    share: list[torch.Tensor], sink: torch.Tensor | None) -> list[str]:
    """Failures of an `InferenceSession` of the packed prompts under the case's model mask:
    prefill and every decode step against the formula."""
    scale, failures = case.head_dim ** -0.5, []
    sink32 = None if sink is None else sink.float()
    window = None if case.window is None else (case.window, 0)
    s = InferenceSession(layout, torch.tensor(DOCS), placement=placement,
                         attention_mask=case.mask(max(DOCS) + STEPS))
    out = s.attend(0, *(t[:, None] for t in share), grid, scale, window, sink32)
    seq, pos = placed_positions(placement, grid.cp_rank)
    for i, (doc, p) in enumerate(zip(seq.tolist(), pos.tolist())):
        keys = seen(case, p, DOCS[doc], None)
        ref = attend(docs[doc]["q"][p], docs[doc]["k"][keys], docs[doc]["v"][keys], sink)
        if (out[i, 0].double() - ref).abs().max() > 1e-5:
            failures.append(f"packed session {case} prefill doc {doc} pos {p}")
    s.phase = DECODE
    for step in range(STEPS):
        s.step = step
        new = [torch.stack([d[n][length + step] for d, length in zip(docs, DOCS)]).float()[None]
               for n in "qkv"]
        got = s.attend(0, *new, grid, scale, window, sink32)[0]
        for doc, (d, length) in enumerate(zip(docs, DOCS)):
            keys = seen(case, length + step, length, step)
            ref = attend(d["q"][length + step], d["k"][keys], d["v"][keys], sink)
            if (got[doc].double() - ref).abs().max() > 1e-5:
                failures.append(f"packed session {case} step {step} doc {doc}")
    return failures


def test_packed_prompts_placed_documents() -> None:
    """Packed prompts on 2x2, 1x4 and 2x1x2: exact prefill and decode (causal, and under a
    prefix-LM model's mask in every document), every token held once over the ranks, T / P
    prompt rows and the round-robin steps on each."""
    for shape in ((1, 2, 2), (1, 1, 4), (2, 1, 2)):
        world = shape[0] * shape[1] * shape[2]
        results = run_distributed(check_packed, world, shape)
        errors = [e for failures, _ in results for e in failures]
        assert not errors, "\n".join(errors[:20])
        held = [n for _, n in results]
        assert sum(held) == sum(DOCS) + len(DOCS) * STEPS
        for rank, n in enumerate(held):
            steps = len(range(rank, STEPS, world))
            assert n == sum(DOCS) // world + steps * len(DOCS), (shape, rank, n)
