"""The driver's multi-latent attention flags end to end on CPU.

Where megatron-core builds MLA (0.17 and later, or Transformer Engine installed):
--multi-latent-attention with Q / K head dim 16 + 8 RoPE and V head dim 12 (V's own, as in
DeepSeek's MLA) on a 4-rank 2x2 mesh, and on TP 2 x CP 2 (mesh) with sequence parallelism,
gives the losses of the same flags at CP = 1; the model built has MLA's parameters (the
latent ranks and head dims reached it) and the model FLOPs that follow from them, its losses
differ from the tiny model's without the flags, and the mesh's bytes are those of V's own
head dim. With packed documents (--reset-attention-mask) the mesh matches CP = 1 too.
Where it cannot (megatron-core 0.16.1 without Transformer Engine), every rank of the job
exits 2 by itself with a message naming the flag and what would work, before any collective.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from preloaded import TINY, Job, build_eod_documents, build_indexed_dataset, job_env, launch

from megatron_mesh.megatron.compat import mla_unbuildable_reason

ITERS = 4
HIDDEN, HEADS, LAYERS, FFN = 64, 4, 2, 128  # tiny-cpu.yaml (SwiGLU: 2 x 4h / 3, to 64s)
Q_RANK, KV_RANK, QK, ROPE, V = 32, 32, 16, 8, 12
# tiny-cpu.yaml has GQA (2 query groups); MLA has none, as in Megatron-LM
MLA = ["--multi-latent-attention", "--no-group-query-attention", "--num-query-groups", str(HEADS),
       "--q-lora-rank", str(Q_RANK), "--kv-lora-rank", str(KV_RANK), "--qk-head-dim", str(QK),
       "--qk-pos-emb-head-dim", str(ROPE), "--v-head-dim", str(V)]
MESH = ["--context-parallel-size", "4", "--context-parallel-algo", "mesh", "--mesh-shape", "2x2"]
TP2_SP_MESH2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                "--context-parallel-size", "2", "--context-parallel-algo", "mesh"]
DOCUMENTS = ["--reset-attention-mask", "--reset-position-ids"]


def _mla_parameters(vocab: int) -> int:
    """The GPT's parameters with MLA layers (RMSNorm weights only, no biases, tied
    embeddings, RoPE; no latent norms: those come with Megatron-LM's --qk-layernorm),
    counted from the MLA sizes."""
    attention = (HIDDEN * Q_RANK                           # Q down-projection
                 + Q_RANK * HEADS * (QK + ROPE)            # Q up-projection
                 + HIDDEN * (KV_RANK + ROPE)               # KV latent + shared RoPE key
                 + KV_RANK * HEADS * (QK + V)              # K (no RoPE part) and V up
                 + HEADS * V * HIDDEN)                     # output projection
    mlp = HIDDEN * 2 * FFN + FFN * HIDDEN
    per_layer = HIDDEN + attention + HIDDEN + mlp          # with the two layer norms
    return vocab * HIDDEN + LAYERS * per_layer + HIDDEN    # + embedding, final norm


@pytest.fixture
def common(tmp_path: Path) -> list[str]:
    prefix = str(tmp_path / "arith")
    build_indexed_dataset(prefix)
    return ["--config", TINY, "--train-iters", str(ITERS), "--data-path", prefix,
            "--data-cache-path", str(tmp_path / "index-cache")]


def test_mla_mesh_matches_cp1(common: list[str]) -> None:
    """On a megatron-core that cannot build MLA, asserts the refusal instead."""
    if mla_unbuildable_reason() is not None:
        _assert_refused_on_every_rank([*common, *MLA, *MESH])
        return
    from megatron_mesh.cost_models.memory import streamed_schedule
    from megatron_mesh.cost_models.traffic import mesh_traffic
    from megatron_mesh.layer_plan import AttentionShape

    ref = launch(1, [*common, *MLA])
    mesh = launch(4, [*common, *MLA, *MESH])
    tp_sp = launch(4, [*common, *MLA, *TP2_SP_MESH2])
    plain = launch(1, common)
    for run in (ref, mesh, tp_sp, plain):
        assert run.returncode == 0, run.output[-3000:]
    for run in (ref, mesh):
        assert (f"multi-latent attention: Q/K head dim {QK + ROPE} = {QK} + {ROPE} RoPE, V head "
                f"dim {V}, latent ranks Q {Q_RANK}, KV {KV_RANK}") in run.output, run.output[-3000:]
        params = _mla_parameters(256)
        assert f"parameters on this rank {params:,}" in run.output, run.output[-3000:]
        # model FLOPs: 2 per weight of every matmul (tied embeddings: the logits) plus
        # causal Q K^T and P V, 3x for the backward, over 4 x 64 tokens
        norms = (2 * LAYERS + 1) * HIDDEN
        per_token = 2 * (params - norms) + LAYERS * 64 * HEADS * (QK + ROPE + V)
        assert f"model FLOPs per iteration {3 * 4 * 64 * per_token:.4e}" in run.output
    ref_l, mesh_l, plain_l = ref.losses(), mesh.losses(), plain.losses()
    assert sorted(ref_l) == sorted(mesh_l) == sorted(tp_sp.losses()) == list(range(1, ITERS + 1))
    for it in ref_l:
        assert mesh_l[it] == pytest.approx(ref_l[it], rel=2e-5), (it, ref_l, mesh_l)
        assert tp_sp.losses()[it] == pytest.approx(ref_l[it], rel=2e-5), (it, ref_l, tp_sp.losses())
    assert any(abs(plain_l[it] - ref_l[it]) > 1e-4 for it in range(1, ITERS + 1)), (
        plain_l, ref_l)  # the flags change the model
    # 2 layers x 2 micro-batches of 2 x 64 tokens, 4 heads (K/V too), Q / K 24 and V 12 wide
    shape = AttentionShape(64, 2, HEADS, HEADS, QK + ROPE, dtype_bytes=4, v_head_dim=V)
    expected = LAYERS * 2 * mesh_traffic(shape, 2, 2).total
    assert set(mesh.traffic()) == {f"{expected / 2**20:.3f}"}, mesh.traffic()
    assert f"(mesh 2x2, schedule {streamed_schedule(shape, 2, 2)} (streamed))" in mesh.output


def test_mla_packed_documents_mesh_matches_cp1(tmp_path: Path) -> None:
    """MLA over packed documents (--reset-attention-mask): megatron-core pads V to the Q / K
    head dim for THD and trims the output; the 2x2 mesh matches CP = 1 with documents masked,
    whose losses differ from CP = 1's without the mask. On a megatron-core that cannot build
    MLA, asserts the refusal instead."""
    prefix = str(tmp_path / "docs")
    build_eod_documents(prefix, 300, (5, 40), seed=1)
    common = ["--config", TINY, "--train-iters", str(ITERS), "--data-path", prefix,
              "--data-cache-path", str(tmp_path / "index-cache"), *MLA]
    if mla_unbuildable_reason() is not None:
        _assert_refused_on_every_rank([*common, *DOCUMENTS, *MESH])
        return
    unmasked = launch(1, common)
    ref = launch(1, [*common, *DOCUMENTS])
    mesh = launch(4, [*common, *DOCUMENTS, *MESH])
    for run in (unmasked, ref, mesh):
        assert run.returncode == 0, run.output[-3000:]
    ref_l, mesh_l, unmasked_l = ref.losses(), mesh.losses(), unmasked.losses()
    assert sorted(ref_l) == sorted(mesh_l) == list(range(1, ITERS + 1))
    for it in ref_l:
        assert mesh_l[it] == pytest.approx(ref_l[it], rel=2e-5), (it, ref_l, mesh_l)
    assert any(abs(unmasked_l[it] - ref_l[it]) > 1e-4 for it in range(1, ITERS + 1)), (
        unmasked_l, ref_l)  # the documents are masked


def _assert_refused_on_every_rank(args: list[str]) -> None:
    """Every rank exits 2 by itself (none is stopped for another's failure): the check runs
    before any process group exists, so no rank waits in a collective."""
    from megatron_mesh.megatron.compat import MEGATRON_CORE_VERSION

    job = Job(args, job_env(), nproc=4, stop_others=False)
    run = job.wait(timeout=100)
    assert job.exitcodes == [2, 2, 2, 2], run.output[-2000:]
    message = (f"pretrain_gpt: error: --multi-latent-attention: megatron-core "
               f"{MEGATRON_CORE_VERSION} cannot build multi-latent attention without "
               "Transformer Engine")
    assert run.output.count(message) == 1, run.output[-2000:]  # printed once (first local rank)
    assert "use megatron-core >= 0.17 (0.19.2 is tested) or install Transformer Engine" in (
        run.output)
    assert "iteration" not in run.output and " world 4 =" not in run.output
