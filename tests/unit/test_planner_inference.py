"""`megatron-mesh plan --inference`: the prefill of each method is the training plan's forward
(the mesh's bytes the traffic formula's), a decode step's bytes and cache per GPU as worked
out by hand for the 64-GPU, 1M-token case, and the command's table and JSON."""
from __future__ import annotations

import json

import pytest

import megatron_mesh as mm
from megatron_mesh.cli import main
from megatron_mesh.planner import plan
from megatron_mesh.planner.inference import decode_estimates, inference_report

S, P, HQ, HKV, D = 1 << 20, 64, 32, 8, 128
FLAGS = ["--gpus", str(P), "--seq-length", str(S), "--num-heads", str(HQ), "--num-kv-heads",
         str(HKV), "--head-dim", str(D)]


def test_prefill_is_the_forward_of_each_method() -> None:
    result = plan(P, seq_length=S, num_heads=HQ, num_kv_heads=HKV, head_dim=D)
    rows = {r["method"]: r for r in inference_report(result)["prefill"]}
    assert len(rows) == len(result.estimates)
    for e in result.estimates:
        assert rows[e.label]["forward_bytes"] == e.bytes("forward")
        assert rows[e.label]["forward_s"] == e.time_s["forward"]
    shape = mm.AttentionShape(S, 1, HQ, HKV, D, 2)
    assert rows["mesh 8x8"]["forward_bytes"] == mm.mesh_traffic(shape, 8, 8).forward


def test_decode_bytes_and_cache_by_hand() -> None:
    result = plan(P, seq_length=S, num_heads=HQ, num_kv_heads=HKV, head_dim=D, batch=2)
    est = {d.method: d for d in decode_estimates(result.workload, result.cluster)}
    cache = (S // P) * 2 * HKV * 2 * D * 2  # tokens x batch x heads x (K + V) x bf16
    assert est["mesh all_gather"].cache_bytes == cache == 128 * 2**20
    assert est["mesh all_gather"].sent_bytes == 63 * 2 * 32 * 129 * 4
    assert est["mesh all_gather"].hops == 63
    # a max of 2 x 32 lse and a sum of 2 x 32 x 129 values, 2 (P-1)/P of each
    assert est["mesh all_reduce"].sent_bytes == int(2 * 63 / 64 * 2 * 32 * 4
                                                    + 2 * 63 / 64 * 2 * 32 * 129 * 4)
    assert est["mesh all_reduce"].hops == 2 * 2 * 6
    assert est["all_gather"].sent_bytes == 63 * cache  # the whole cache every step
    assert "a2a" not in est  # 32 heads do not split over 64 GPUs
    assert min(est.values(), key=lambda d: d.time_s).method == "mesh all_reduce"


def test_inference_command_prints_both_tables_and_json(capsys) -> None:
    assert main(["plan", "--inference", *FLAGS]) == 0
    out = capsys.readouterr().out
    assert "prefill (forward only):" in out and "decode step" in out
    assert "mesh all_reduce" in out and "mesh 8x8" in out
    assert main(["plan", "--inference", "--json", "--batch", "4", *FLAGS]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {r["method"] for r in data["decode"]} >= {"mesh all_gather", "mesh all_reduce"}
    assert data["best_decode"] == "mesh all_reduce"


def test_inference_refuses_a_plot_it_would_not_draw(capsys, tmp_path) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--inference", "--plot", str(tmp_path / "p.png"), *FLAGS])
    assert exit_.value.code == 2
    assert "--plot" in capsys.readouterr().err


def test_inference_refuses_a_layer_mix_it_would_not_price(capsys) -> None:
    """--inference prices one layer: a windowed / global mix is refused, not ignored."""
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--inference", "--window-size", "128", "--window-attn-skip-freq", "2",
              *FLAGS])
    assert exit_.value.code == 2
    assert "--window-attn-skip-freq 2: --inference prices one layer" in capsys.readouterr().err
