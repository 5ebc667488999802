"""A megatron-core GPTModel with mesh context parallelism matches the same model with CP = 1.

One spawned job of 8 gloo ranks runs every layout in turn (spawning is the slow part):
TP x CP x DP = 1x4x2 as 2x2, 4x1 and 1x4 grids (two CP groups, two data replicas) and as
heads x rows x cols grids 2x2x1 and 4x1x1 (an all-to-all over 2 or 4 CP ranks; with 2 K/V
heads, A = 4 repeats them), 2x2x2 with the shape chosen automatically and as 2x1x1 (a TP rank
holds 2 query heads and 1 K/V head), and 1x1x8; then Megatron's features: selective
recomputation (core attention re-run in backward) on 1x4x2, full recomputation on 2x2x2.
(Sequence parallelism needs Transformer Engine or Apex norms: megatron-core's torch norms
refuse it, so it is not testable on a CPU.) For each, the reference is the same
GPTModel (same weights, same TP) at CP = 1 whose core attention is torch SDPA on the whole
sequence; the mesh run gets its batch from megatron-core's get_batch_on_this_cp_rank, its
per-rank partial loss and gradients are summed over the CP group with all-reduces (as
Megatron's finalize_model_grads does), and both are compared. Bad configurations are tried
in the same job and must raise on every rank, not hang.
"""
from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams

from dist_utils import run_distributed

WORLD = 8
SEQ, BATCH, VOCAB = 32, 2, 64
HEADS, GROUPS, HIDDEN, LAYERS = 4, 2, 64, 2
JOB_TIMEOUT_S = 240
HAVE_TE = importlib.util.find_spec("transformer_engine") is not None

# (name, tp, cp, grid (R, C) / (A, R, C) or None for automatic, TransformerConfig features)
FULL_RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform",
                      recompute_num_layers=1)
LAYOUTS = [
    ("cp4_2x2", 1, 4, (2, 2), {}),
    ("cp4_4x1", 1, 4, (4, 1), {}),
    ("cp4_1x4", 1, 4, (1, 4), {}),
    ("cp4_2x2x1", 1, 4, (2, 2, 1), {}),
    ("cp4_4x1x1", 1, 4, (4, 1, 1), {}),
    ("tp2_cp2_auto", 2, 2, None, {}),
    ("tp2_cp2_2x1x1", 2, 2, (2, 1, 1), {}),
    ("cp1", 1, 1, None, {}),
    ("cp4_2x2_recompute_selective", 1, 4, (2, 2), dict(recompute_granularity="selective")),
    ("tp2_cp2_recompute_full", 2, 2, (2, 1), FULL_RECOMPUTE),
]
# packed documents (THD): (name, tp, cp, grid)
PACKED_LAYOUTS = [
    ("packed_cp4_2x2", 1, 4, (2, 2)),
    ("packed_cp4_2x1x2", 1, 4, (2, 1, 2)),
    ("packed_tp2_cp2_1x2", 2, 2, (1, 2)),
    ("packed_cp1", 1, 1, None),
]


# ---------------------------------------------------------------- worker (every rank)


def _sdpa_core_attention_class():
    """Reference core attention: torch SDPA on the whole sequence (CP = 1 only)."""
    from megatron.core.transformer.module import MegatronModule

    class SDPACoreAttention(MegatronModule):
        def __init__(self, config, layer_number, attn_mask_type, attention_type,
                     attention_dropout=None, softmax_scale=None, cp_comm_type=None,
                     pg_collection=None):
            super().__init__(config=config)
            assert config.context_parallel_size == 1

        def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                    attention_bias=None, packed_seq_params=None):
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)

    return SDPACoreAttention


def _config(tp: int, cp: int, **overrides):
    from megatron.core.transformer import TransformerConfig

    kwargs = dict(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
        num_query_groups=GROUPS, attention_dropout=0.0, hidden_dropout=0.0,
        use_cpu_initialization=True, tensor_model_parallel_size=tp,
        context_parallel_size=cp, params_dtype=torch.float32,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def _gpt(config, layer_spec):
    from megatron.core.models.gpt import GPTModel

    return GPTModel(config, layer_spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                    position_embedding_type="rope")


def _reference_spec():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_mesh.megatron.spec import use_mesh_core_attention

    spec = use_mesh_core_attention(get_gpt_layer_local_spec())  # copy, then swap in SDPA
    spec.submodules.self_attention.submodules.core_attention = _sdpa_core_attention_class()
    return spec


def _batch(replica: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + replica)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return {
        "tokens": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "loss_mask": (torch.rand(BATCH, SEQ, generator=g) > 0.2).float(),
        "position_ids": torch.arange(SEQ).expand(BATCH, SEQ).contiguous(),
    }


def _loss_and_grads(model, batch, denominator, traffic=None):
    from megatron_mesh.runtime.comm import TrafficCounter

    traffic = {} if traffic is None else traffic
    with TrafficCounter() as forward:
        per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        loss = (per_token * batch["loss_mask"]).sum() / denominator
    model.zero_grad(set_to_none=True)
    with TrafficCounter() as backward:
        loss.backward()
    traffic.update(forward=forward.total_bytes, backward=backward.total_bytes,
                   heads=forward.bytes(direction="heads") + backward.bytes(direction="heads"),
                   backward_phases=(backward.bytes(phase="forward"),
                                    backward.bytes(phase="backward")))
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return loss.detach(), grads


def _init_parallel(tp: int, cp: int) -> None:
    from megatron.core import parallel_state as ps

    from megatron_mesh.megatron.groups import destroy_mesh_grids

    destroy_mesh_grids()
    ps.destroy_model_parallel()
    _destroy_subgroups()
    ps.initialize_model_parallel(tp, 1, context_parallel_size=cp, create_gloo_process_groups=False)


_INHERITED_GROUPS: set = set()  # groups this rank held when its job started


def _destroy_subgroups() -> None:
    """Destroy every process group but the default one: parallel_state forgets its groups
    without destroying them, and the gloo groups of earlier layouts left alive slow every
    later collective of 8 ranks on 2 cores (the job took 4x longer)."""
    for group in list(dist.distributed_c10d._world.pg_map):
        if group is not dist.GroupMember.WORLD and group not in _INHERITED_GROUPS:
            dist.destroy_process_group(group)


def _expect_error(fn, *exc_types) -> str:
    """Run fn; return the message of the expected exception ('' if none was raised)."""
    try:
        fn()
    except exc_types as error:  # noqa: PERF203
        return str(error)
    return ""


def _run_layout(name, tp, cp, shape, features, out):
    from megatron.core import parallel_state as ps

    from megatron_mesh.megatron import get_gpt_layer_spec, initialize_mesh_grids
    from megatron_mesh.megatron.compat import get_batch_on_this_cp_rank

    rank = dist.get_rank()
    replica = rank // (tp * cp)  # order tp-cp-dp: the data-parallel replica of this rank
    full = _batch(replica)
    denominator = full["loss_mask"].sum()

    _init_parallel(tp, 1)
    torch.manual_seed(1234)
    reference = _gpt(_config(tp, 1), _reference_spec())
    ref_loss, ref_grads = _loss_and_grads(reference, full, denominator)

    _init_parallel(tp, cp)
    grid = initialize_mesh_grids(
        shape, num_attention_heads=HEADS, num_query_groups=GROUPS, seq_length=SEQ
    )
    model = _gpt(_config(tp, cp, **features), get_gpt_layer_spec("mesh", grid=grid))
    model.load_state_dict(reference.state_dict())
    local = get_batch_on_this_cp_rank(dict(full))
    traffic = {}
    loss, grads = _loss_and_grads(model, local, denominator, traffic)
    cp_group = ps.get_context_parallel_group()
    dist.all_reduce(loss, group=cp_group)
    for g in grads.values():
        dist.all_reduce(g, group=cp_group)

    out[name] = {
        "grid": (grid.heads, grid.rows, grid.cols, grid.cp_rank, grid.cp_ranks),
        "row_ranks": dist.get_process_group_ranks(grid.row_group),
        "col_ranks": dist.get_process_group_ranks(grid.col_group),
        "heads_ranks": (dist.get_process_group_ranks(grid.heads_group)
                        if grid.heads > 1 else None),
        "megatron_cp_ranks": ps.get_context_parallel_global_ranks(),
        "megatron_cp_rank": ps.get_context_parallel_rank(),
        "local_seq": local["tokens"].shape[1],
        "loss": (loss.item(), ref_loss.item()),
        "grad_err": max(
            ((grads[n] - ref_grads[n]).abs().max() / (ref_grads[n].abs().max() + 1e-6)).item()
            for n in grads
        ),
        "grad_abs_err": max((grads[n] - ref_grads[n]).abs().max().item() for n in grads),
        "grad_names": sorted(grads),
        "core_class": type(model.decoder.layers[0].self_attention.core_attention).__name__,
        "grid_passed_in": all(layer.self_attention.core_attention.grid is grid
                              for layer in model.decoder.layers),
        "traffic": traffic,
    }


def _run_packed(name, tp, cp, shape, out):
    """Packed documents: the GPT model on this rank's THD share of a micro-batch of
    EOD-separated documents (`training.packing.pack_documents`, its PackedSeqParams) against
    the same model at CP = 1 run on each document ALONE (SDPA core attention)."""
    from megatron.core import parallel_state as ps

    from megatron_mesh.megatron import get_gpt_layer_spec, initialize_mesh_grids
    from megatron_mesh.training.data.packing import pack_documents

    rank = dist.get_rank()
    replica = rank // (tp * cp)
    g = torch.Generator().manual_seed(2000 + replica)
    lengths = [5, 11, 1, 3, 12]  # 32 tokens; each document ends in EOD (VOCAB - 1)
    tokens = torch.randint(0, VOCAB - 1, (1, sum(lengths)), generator=g)
    ends = torch.tensor(lengths).cumsum(0) - 1
    tokens[0, ends] = VOCAB - 1
    full = {"tokens": tokens, "labels": torch.randint(0, VOCAB, tokens.shape, generator=g),
            "loss_mask": (torch.rand(tokens.shape, generator=g) > 0.2).float()}
    full["position_ids"] = torch.cat([torch.arange(n) for n in lengths])[None]
    denominator = full["loss_mask"].sum()

    _init_parallel(tp, 1)
    torch.manual_seed(1234)
    reference = _gpt(_config(tp, 1), _reference_spec())
    ref_loss, ref_per_token = 0, []
    for start, n in zip([0] + ends[:-1].add(1).tolist(), lengths):
        doc = {k: v[:, start:start + n] for k, v in full.items()}
        per_token = reference(doc["tokens"], doc["position_ids"], None, labels=doc["labels"])
        ref_loss = ref_loss + (per_token * doc["loss_mask"]).sum() / denominator
        ref_per_token.append(per_token.detach())
    reference.zero_grad(set_to_none=True)
    ref_loss.backward()
    ref_grads = {n: p.grad.detach().clone() for n, p in reference.named_parameters()}

    _init_parallel(tp, cp)
    initialize_mesh_grids(shape, num_attention_heads=HEADS, num_query_groups=GROUPS,
                          seq_length=SEQ)
    model = _gpt(_config(tp, cp), get_gpt_layer_spec("mesh"))
    model.load_state_dict(reference.state_dict())
    # each token's loss alone, and which tokens are real, packed and split as the batch is
    full = {**full, "ref_per_token": torch.cat(ref_per_token, 1),
            "real": torch.ones_like(full["loss_mask"])}
    local = pack_documents(full, VOCAB - 1, cp, ps.get_context_parallel_rank())
    per_token = model(local["tokens"], local["position_ids"], None, labels=local["labels"],
                      packed_seq_params=local["packed_seq_params"])
    real = local["real"].bool()
    loss = (per_token * local["loss_mask"]).sum() / denominator
    model.zero_grad(set_to_none=True)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    cp_group = ps.get_context_parallel_group()
    dist.all_reduce(loss, group=cp_group)
    for grad in grads.values():
        dist.all_reduce(grad, group=cp_group)
    out[name] = {
        "loss": (loss.item(), ref_loss.item()),
        "grad_abs_err": max((grads[n] - ref_grads[n]).abs().max().item() for n in grads),
        "grad_err": max(
            ((grads[n] - ref_grads[n]).abs().max() / (ref_grads[n].abs().max() + 1e-6)).item()
            for n in grads),
        "local_tokens": local["tokens"].shape[1],
        "token_loss_err": (per_token.detach()[real] - local["ref_per_token"][real]).abs().max().item(),
        "real_tokens": int(real.sum()),
    }


def _bad_configurations(out):
    """Each must raise the same clear error on every rank (a hang fails the job timeout)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_mesh.megatron import (
        MeshDotProductAttention,
        destroy_mesh_grids,
        get_gpt_layer_spec,
        initialize_mesh_grids,
    )

    rank = dist.get_rank()
    errors = {}
    _init_parallel(1, 4)
    errors["shape_3x1"] = _expect_error(lambda: initialize_mesh_grids((3, 1)), ValueError)
    errors["seq_not_divisible"] = _expect_error(
        lambda: initialize_mesh_grids((2, 2), seq_length=36), ValueError
    )
    disagree = (2, 2) if rank == 0 else (4, 1)
    errors["ranks_disagree"] = _expect_error(lambda: initialize_mesh_grids(disagree), ValueError)
    errors["model_before_grids"] = _expect_error(
        lambda: _gpt(_config(1, 4), get_gpt_layer_spec("mesh")), RuntimeError
    )
    initialize_mesh_grids((2, 2))
    errors["dropout"] = _expect_error(
        lambda: _gpt(_config(1, 4, attention_dropout=0.1), get_gpt_layer_spec("mesh")), ValueError
    )
    if not HAVE_TE:
        errors["p2p_without_te"] = _expect_error(
            lambda: _gpt(_config(1, 4), get_gpt_layer_spec("p2p")), ValueError
        )
    errors["backend"] = _expect_error(
        lambda: _gpt(_config(1, 4), get_gpt_layer_spec("mesh", backend="flash3")), ValueError
    )
    core_kwargs = dict(layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    errors["padding_mask"] = _expect_error(
        lambda: MeshDotProductAttention(
            config=_config(1, 4), layer_number=1, attn_mask_type=AttnMaskType.padding,
            attention_type="self",
        ),
        ValueError,
    )
    # the algorithm can also come from TransformerConfig.cp_comm_type (no spec params)
    chosen = MeshDotProductAttention(config=_config(1, 4, cp_comm_type="mesh"), **core_kwargs)
    errors["config_cp_comm_type_mesh"] = type(chosen).__name__
    errors["mesh_class_asked_for_a2a"] = _expect_error(
        lambda: MeshDotProductAttention(config=_config(1, 4, cp_comm_type="a2a"), **core_kwargs),
        ValueError,
    )
    q = torch.randn(SEQ // 4, BATCH, HEADS, HIDDEN // HEADS)
    k = torch.randn(SEQ // 4, BATCH, GROUPS, HIDDEN // HEADS)
    errors["packed"] = _expect_error(
        lambda: chosen(q, k, k, None, packed_seq_params=PackedSeqParams(qkv_format="sbhd")),
        ValueError
    )
    # one CP rank of each group rejects its input, or passes another mask: every rank raises
    odd = rank % 4 == 0
    errors["packed_on_one_rank"] = _expect_error(
        lambda: chosen(q, k, k, None, packed_seq_params=PackedSeqParams(qkv_format="sbhd")
                       if odd else None), ValueError)
    errors["causal_on_one_rank"] = _expect_error(
        lambda: chosen(q, k, k, None, attn_mask_type=AttnMaskType.no_mask if odd else None),
        ValueError)
    model = dict(num_attention_heads=HEADS, num_query_groups=GROUPS)
    _init_parallel(2, 4)  # TP 2: 2 query heads per rank, but A = 4
    errors["heads_after_tp"] = _expect_error(
        lambda: initialize_mesh_grids((4, 1, 1), **model), ValueError)
    errors["heads_disagree"] = _expect_error(
        lambda: initialize_mesh_grids("2x2x1", mesh_heads=4, **model), ValueError)
    _init_parallel(2, 4)  # a grid built without head counts: the layer checks A itself
    initialize_mesh_grids((4, 1, 1))
    errors["layer_heads_after_tp"] = _expect_error(
        lambda: _gpt(_config(2, 4), get_gpt_layer_spec("mesh")), ValueError)
    _init_parallel(1, 1)  # no initialize_mesh_grids(): CP = 1 needs none
    if not HAVE_TE:
        plain = MeshDotProductAttention(config=_config(1, 1), cp_comm_type="p2p", **core_kwargs)
        errors["cp1_p2p_without_te"] = type(plain).__name__
    # grids of an earlier CP layout, then parallel_state re-initialized with another one
    _init_parallel(1, 2)
    stale = initialize_mesh_grids((2, 1))
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 1, context_parallel_size=4, create_gloo_process_groups=False)
    errors["stale_grid"] = _expect_error(
        lambda: _gpt(_config(1, 4), get_gpt_layer_spec("mesh")), ValueError
    )
    errors["stale_grid_passed_in"] = _expect_error(
        lambda: _gpt(_config(1, 4), get_gpt_layer_spec("mesh", grid=stale)), ValueError
    )
    errors["not_a_grid"] = _expect_error(
        lambda: _gpt(_config(1, 4), get_gpt_layer_spec("mesh", grid=(2, 2))), ValueError
    )
    # a grid passed in needs no registry (as megatron-core's layers take pg_collection)
    _init_parallel(1, 4)
    passed = initialize_mesh_grids((2, 2))
    destroy_mesh_grids()
    model = _gpt(_config(1, 4), get_gpt_layer_spec("mesh", grid=passed))
    out["passed_grid_used"] = all(layer.self_attention.core_attention.grid is passed
                                  for layer in model.decoder.layers)
    out["errors"] = errors


def _shape_decided_once(out):
    """Megatron-LM's path: the grid validate_mesh_args logs is the grid initialize_mesh_grids
    builds, chosen by the planner (from the flags, or again from the model's head counts) and
    given, with 2 CP ranks per node: MQA, where the planner's default node of 8 picks 1x4x1,
    and GQA (2 K/V heads), where it picks the heads x rows x cols grid 4x1x1 (Ulysses over
    the 4 ranks, its 2 K/V heads repeated)."""
    import argparse

    from megatron_mesh.megatron import initialize_mesh_grids, validate_mesh_args

    os.environ["LOCAL_WORLD_SIZE"] = "2"  # as torchrun sets it on nodes of two ranks
    try:
        for groups in (1, GROUPS):
            model = dict(num_attention_heads=HEADS, num_query_groups=groups,
                         seq_length=2 * SEQ, head_dim=HIDDEN // HEADS)
            args = argparse.Namespace(
                context_parallel_algo="mesh", cp_comm_type=None, mesh_shape=None,
                mesh_heads=None, context_parallel_size=4, tensor_model_parallel_size=1,
                group_query_attention=True, kv_channels=model["head_dim"],
                attention_dropout=0.0, **{k: v for k, v in model.items() if k != "head_dim"})
            logged = validate_mesh_args(args)
            built = {}
            for how, shape in (("planner", None), ("given", logged)):
                _init_parallel(1, 4)
                # the flags train in fp32 (no --bf16): the group builder sizes the same
                grid = initialize_mesh_grids(shape, **model, dtype="fp32")
                built[how] = (grid.heads, grid.rows, grid.cols)
            out[f"shape_once_{groups}"] = {"logged": logged, **built}
    finally:
        del os.environ["LOCAL_WORLD_SIZE"]


def _worker(rank: int, world: int) -> dict:
    _INHERITED_GROUPS.update(dist.distributed_c10d._world.pg_map)  # never destroy these
    from megatron_mesh.megatron.cpu import megatron_on_cpu

    out: dict = {}
    with megatron_on_cpu():
        for name, tp, cp, shape, features in LAYOUTS:
            _run_layout(name, tp, cp, shape, features, out)
        for name, tp, cp, shape in PACKED_LAYOUTS:
            _run_packed(name, tp, cp, shape, out)
        _bad_configurations(out)
        _shape_decided_once(out)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # ranks forked from the preloaded server: megatron-core is imported there once
    try:
        return run_distributed(_worker, WORLD, timeout_s=60, job_timeout_s=JOB_TIMEOUT_S)
    except TimeoutError as e:
        pytest.fail(f"{e} (hang?)")


# ---------------------------------------------------------------- checks (pytest process)


@pytest.mark.parametrize("name", [n for n, *_ in LAYOUTS])
def test_loss_and_gradients_match_cp1(results, name):
    for rank, res in enumerate(results):
        r = res[name]
        loss, ref_loss = r["loss"]
        assert math.isclose(loss, ref_loss, rel_tol=1e-5, abs_tol=1e-6), (rank, loss, ref_loss)
        assert r["grad_abs_err"] < 1e-5 or r["grad_err"] < 1e-5, (rank, r["grad_abs_err"])
        assert len(r["grad_names"]) > 10  # embedding, layers, output layer all checked
        assert r["core_class"] == "MeshDotProductAttention"  # the spec's class, as built


@pytest.mark.parametrize("name", [n for n, *_ in LAYOUTS])
def test_grid_follows_megatron_cp_groups(results, name):
    _, tp, cp, shape, _ = next(layout for layout in LAYOUTS if layout[0] == name)
    from megatron_mesh.megatron.shape import resolve_mesh_shape

    expected = resolve_mesh_shape(cp, shape, num_attention_heads=HEADS, num_query_groups=GROUPS,
                                  seq_length=SEQ, tensor_parallel_size=tp)[0]
    for rank, res in enumerate(results):
        r = res[name]
        heads, rows, cols, cp_rank, cp_ranks = r["grid"]
        assert (heads, rows, cols) == expected
        assert list(cp_ranks) == r["megatron_cp_ranks"] and cp_rank == r["megatron_cp_rank"]
        assert rank in cp_ranks and r["local_seq"] == SEQ // cp
        # A consecutive CP ranks share an all-to-all; the mesh is every A-th CP rank
        mesh, (i, j) = cp_ranks[cp_rank % heads::heads], divmod(cp_rank // heads, cols)
        first = cp_rank - cp_rank % heads
        assert r["heads_ranks"] == (list(cp_ranks[first:first + heads]) if heads > 1 else None)
        assert (r["traffic"]["heads"] > 0) == (heads > 1)  # the all-to-all ran, or did not
        assert r["row_ranks"] == [mesh[i * cols + c] for c in range(cols)]  # consecutive
        assert r["col_ranks"] == [mesh[x * cols + j] for x in range(rows)]


@pytest.mark.parametrize("name", [n for n, *_ in PACKED_LAYOUTS])
def test_packed_documents_match_each_document_run_alone(results, name):
    """The loss and gradients of a packed micro-batch equal the sum over its documents,
    each run alone at CP = 1: attention never crossed a document, padding changed nothing."""
    _, tp, cp, _ = next(layout for layout in PACKED_LAYOUTS if layout[0] == name)
    for rank, res in enumerate(results):
        r = res[name]
        loss, ref_loss = r["loss"]
        assert math.isclose(loss, ref_loss, rel_tol=1e-5, abs_tol=1e-6), (rank, loss, ref_loss)
        assert r["grad_abs_err"] < 1e-5 or r["grad_err"] < 1e-5, (rank, r["grad_abs_err"])
        # documents padded to multiples of 2 CP: 8 + 16 + 8 + 8 + 16 = 56 tokens at CP 4
        assert r["local_tokens"] == {4: 56 // 4, 2: 40 // 2, 1: 32}[cp]
        # token by token: each token's loss (its logits) is the one it has in its document
        # run alone
        assert r["token_loss_err"] < 1e-5, (rank, r["token_loss_err"])
    # rank 0's CP group (order tp-cp-dp: every tp-th rank) holds every real token once
    assert sum(results[i * tp][name]["real_tokens"] for i in range(cp)) == 32


def test_selective_recompute_reruns_the_mesh_forward_once_and_counts_it_once(results):
    """Selective recomputation re-runs core attention in backward: its communication is
    real and counted once more as forward traffic; nothing else changes or doubles."""
    for rank, res in enumerate(results):
        plain = res["cp4_2x2"]["traffic"]
        again = res["cp4_2x2_recompute_selective"]["traffic"]
        assert plain["forward"] > 0 and plain["backward_phases"] == (0, plain["backward"])
        assert again["forward"] == plain["forward"], rank
        assert again["backward_phases"] == (plain["forward"], plain["backward"]), rank


def test_two_cp_groups_get_separate_grids(results):
    groups = {tuple(res["cp4_2x2"]["grid"][4]) for res in results}
    assert groups == {(0, 1, 2, 3), (4, 5, 6, 7)}
    # the two data-parallel replicas saw different data, and each matched its own reference
    assert results[0]["cp4_2x2"]["loss"][1] != results[4]["cp4_2x2"]["loss"][1]
    tp_cp = {tuple(res["tp2_cp2_auto"]["grid"][4]) for res in results}
    assert tp_cp == {(0, 2), (1, 3), (4, 6), (5, 7)}


def test_layers_use_the_grid_passed_in(results):
    """A grid passed through the spec (as megatron-core hands its layers pg_collection) is
    the layers' grid, also with no grid registered on the rank."""
    for res in results:
        assert res["passed_grid_used"]
        assert all(layout["grid_passed_in"] for layout in res.values()
                   if isinstance(layout, dict) and "grid_passed_in" in layout)


@pytest.mark.parametrize(
    "case, words",
    [
        ("shape_3x1", ["3x1", "4x1, 2x2, 1x4"]),
        ("seq_not_divisible", ["36", "8"]),
        ("ranks_disagree", ["rank 0: 2x2", "rank 1: 4x1"]),
        ("model_before_grids", ["initialize_mesh_grids"]),
        ("dropout", ["dropout", "0.1"]),
        ("p2p_without_te", ["'p2p'", "Transformer Engine", "mesh"]),
        ("backend", ["flash3", "auto"]),
        ("padding_mask", ["padding", "causal"]),
        ("packed", ["packed"]),
        ("packed_on_one_rank", ["qkv_format='sbhd'", "CP rank 0 of the 2x2 grid"]),
        ("causal_on_one_rank", ["causal", "True", "False", "CP rank 0"]),
        ("stale_grid", ["CP group", "initialize_mesh_grids"]),
        ("stale_grid_passed_in", ["the mesh grid covers CP ranks", "this layer's CP group",
                                  "pass the grid initialize_mesh_grids() returned"]),
        ("not_a_grid", ["grid must be a MeshGrid", "tuple"]),
        ("mesh_class_asked_for_a2a", ["'a2a'", "Transformer Engine"]),
        ("heads_after_tp", ["--mesh-heads 4", "2 query heads (1 K/V heads) per rank after "
                            "tensor parallelism 2", "valid: 1, 2"]),
        ("heads_disagree", ["--mesh-heads 4 disagrees with --mesh-shape 2x2x1"]),
        ("layer_heads_after_tp", ["--mesh-heads 4", "tensor parallelism 2", "valid: 1, 2"]),
    ],
)
def test_bad_configuration_fails_on_every_rank(results, case, words):
    if HAVE_TE and case == "p2p_without_te":
        pytest.skip("Transformer Engine is installed: p2p is handed to it")
    for rank, res in enumerate(results):
        message = res["errors"][case]
        assert message, f"rank {rank}: no error for {case}"
        for word in words:
            assert word in message, (rank, case, message)


def test_logged_shape_is_the_built_shape(results):
    from megatron_mesh.megatron.shape import auto_mesh_shape

    for res in results:
        assert res["shape_once_1"] == {"logged": (1, 2, 2), "planner": (1, 2, 2),
                                       "given": (1, 2, 2)}
        assert res[f"shape_once_{GROUPS}"] == {"logged": (4, 1, 1), "planner": (4, 1, 1),
                                               "given": (4, 1, 1)}
    # without the launcher's node size the planner would have said otherwise
    assert auto_mesh_shape(4, HEADS, 1, HIDDEN // HEADS, 2 * SEQ) == (1, 4, 1)


def test_mesh_selected_by_config_cp_comm_type(results):
    for res in results:
        assert res["errors"]["config_cp_comm_type_mesh"] == "MeshDotProductAttention"
        if not HAVE_TE:  # with CP = 1 every algorithm is plain attention
            assert res["errors"]["cp1_p2p_without_te"] == "MeshDotProductAttention"
