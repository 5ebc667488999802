"""The start-up banner names what cuts the causal attention (document masks, a window), and
the model FLOPs follow Megatron-LM's count there: causal attention over the whole sequence,
whatever the masks, said on the FLOPs line."""
from __future__ import annotations

import pytest
from preloaded import TINY

from megatron_mesh.training.config.arguments import parse_args
from megatron_mesh.training.model.flops import flops_per_iteration
from megatron_mesh.training.run import banner_lines

# a GPT-3 shape (GELU MLP of 4h, one K / V head per head) where Megatron-LM's formula is
# 72 GBS s L h^2 (1 + s / (12 h) + V / (12 h L))
GPT = ["--config", TINY, "--no-swiglu", "--no-group-query-attention", "--num-query-groups", "4"]
MASKS = {
    "none": [],
    "documents": ["--reset-attention-mask"],
    "window": ["--window-size", "16", "0", "--window-attn-skip-freq", "2"],
    "both": ["--reset-attention-mask", "--window-size", "16", "0"],
    "chunks": ["--context-parallel-algo", "mesh", "--attention-chunk-size", "16",
               "--no-rope-freq", "2"],
    "builder": ["--context-parallel-algo", "mesh", "--mesh-mask-builder",
                "examples.mask_builders:prefix_lm"],
}


def _megatron_lm_flops(args, vocab: int) -> float:
    b, s, layers, h = args.global_batch_size, args.seq_length, args.num_layers, args.hidden_size
    return 72 * b * s * layers * h * h * (1 + s / (12 * h) + vocab / (12 * h * layers))


@pytest.mark.parametrize("case", MASKS)
def test_banner_names_masks_and_flops_count_them_as_megatron_lm(case: str, monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "1")
    args = parse_args([*GPT, *MASKS[case]])
    flops = flops_per_iteration(args, 256)
    assert flops == pytest.approx(_megatron_lm_flops(args, 256), rel=1e-12)
    world, model, _ = banner_lines(args, None, 1000, 256, flops)
    documents = "documents masked (--reset-attention-mask: each attends only within itself)"
    window = "window 16 left, 0 right (--window-size; "
    assert (documents in world) == (case in ("documents", "both")), world
    assert (window in world) == (case in ("window", "both")), world
    if case == "window":
        assert "one layer in 2 global" in world
    assert ("chunks of 16 (--attention-chunk-size; one layer in 2 global)" in world) == (
        case == "chunks"), world
    assert ("mask per micro-batch from examples.mask_builders:prefix_lm" in world) == (
        case == "builder"), world
    convention = "(Megatron-LM's count: causal attention over the whole --seq-length, not reduced"
    assert model.endswith(f"model FLOPs per iteration {flops:.4e}") == (case == "none"), model
    assert (convention in model) == (case != "none"), model
    if case == "both":
        assert model.endswith("not reduced for document masks or the window)"), model


def test_banner_names_sinks_and_experts_and_counts_the_routed_experts(monkeypatch) -> None:
    """MoE FLOPs count each token's top-k experts (Megatron-LM's count): top 2 of experts
    2h wide is the dense 4h MLP's count; the banner names the sinks, Q / K norms and MoE."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    dense = parse_args(GPT)
    args = parse_args([*GPT, "--num-experts", "4", "--moe-router-topk", "2",
                       "--moe-ffn-hidden-size", str(2 * dense.hidden_size),
                       "--disable-bias-linear", "--softmax-type", "learnable", "--qk-layernorm"])
    flops = flops_per_iteration(args, 256)
    assert flops == pytest.approx(_megatron_lm_flops(args, 256), rel=1e-12)
    _, model, _ = banner_lines(args, None, 1000, 256, flops)
    assert "sinks learnable (--softmax-type), qk layernorm, MoE 4 experts (SequentialMLP, " \
           "hidden 128), top 2, aux_loss coeff 0, EP 1, allgather dispatcher" in model, model
    wider = parse_args([*GPT, "--num-experts", "4", "--moe-router-topk", "3",
                        "--moe-ffn-hidden-size", str(2 * dense.hidden_size),
                        "--disable-bias-linear"])
    assert flops_per_iteration(wider, 256) > flops
