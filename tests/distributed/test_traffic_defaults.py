"""`mm.mesh_traffic(shape, R, C)` with no dtype arguments is what `mesh_attention` sends with
its default arguments: the formula with its defaults equals the byte counter around a real
call on gloo ranks, per pass, in bf16 (where the defaults matter: dK, dV
in bf16, dQ in fp32, streamed_q's partial outputs in fp32)."""
from __future__ import annotations

import torch

import megatron_mesh as mm
from megatron_mesh.cost_models.traffic import grid_traffic

from dist_utils import run_distributed

WORLD = 4
GRIDS = [(1, 4, 1), (1, 2, 2), (1, 1, 4), (2, 2, 1)]  # (A, R, C); the defaults run streamed_kv
# on 4x1 and 2x2x1, streamed_q on 2x2 and 1x4
CASES = [(2, 4, 4, 8), (1, 4, 1, 8)]  # (batch, q heads, kv heads, head dim): MHA, MQA
SEQ = 4 * WORLD


def count_worker(rank: int, world: int) -> list[dict]:
    """Forward + backward of `mesh_attention` with default arguments; bytes counted."""
    out = []
    for a, r, c in GRIDS:
        grid = mm.MeshGrid.build(rows=r, cols=c, heads=a)
        for idx, (b, hq, hkv, d) in enumerate(CASES):
            g = torch.Generator().manual_seed(10 * idx + rank)
            s = SEQ // world
            q, k, v = (torch.randn(s, b, h, d, generator=g).to(torch.bfloat16).requires_grad_()
                       for h in (hq, hkv, hkv))
            dout = torch.randn(s, b, hq, d, generator=g).to(torch.bfloat16)
            with mm.TrafficCounter() as counter:
                mm.mesh_attention(q, k, v, grid).backward(dout)
            out.append({"grid": (a, r, c), "case": idx,
                        "counted": {p: counter.bytes(phase=p) for p in ("forward", "backward")}})
    return out


def test_mesh_traffic_defaults_equal_mesh_attention_defaults_counted_in_bf16() -> None:
    per_rank = run_distributed(count_worker, WORLD)
    checked = 0
    for rank, results in enumerate(per_rank):
        assert len(results) == len(GRIDS) * len(CASES)
        for got in results:
            a, r, c = got["grid"]
            b, hq, hkv, d = CASES[got["case"]]
            shape = mm.AttentionShape(SEQ, b, hq, hkv, d, dtype_bytes=2)
            formula = mm.mesh_traffic(shape, r, c) if a == 1 else grid_traffic(shape, a, r, c)
            where = f"rank {rank}, grid {a}x{r}x{c}, case {CASES[got['case']]}"
            assert got["counted"]["forward"] == formula.forward, where
            assert got["counted"]["backward"] == formula.backward, where
            checked += 1
    assert checked == WORLD * len(GRIDS) * len(CASES)
