"""CLI arguments, mesh-shape validation and layer specs (one process, no process groups)."""
from __future__ import annotations

import argparse
import functools
import logging
from types import SimpleNamespace

import pytest

from megatron_mesh.megatron import ALGORITHMS, add_mesh_args, parse_mesh_shape, validate_mesh_args
from megatron_mesh.planner import plan


def _args(**overrides) -> SimpleNamespace:
    base = dict(
        seq_length=4096, context_parallel_size=8, context_parallel_algo="mesh", mesh_shape=None,
        num_attention_heads=32, num_query_groups=None, hidden_size=4096, bf16=True,
    )
    base.update(overrides)
    return SimpleNamespace(**base)


def _megatron_like_parser() -> argparse.ArgumentParser:
    """Megatron-LM's two CP options, which ours must sit beside."""
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--context-parallel-size", type=int, default=1)
    parser.add_argument("--cp-comm-type", nargs="+", type=str, default=["p2p"])
    return parser


def test_add_mesh_args_parses_and_sits_beside_megatron_options():
    parser = add_mesh_args(_megatron_like_parser())
    assert add_mesh_args(parser) is parser  # a second call adds nothing
    args = parser.parse_args(
        ["--context-parallel-size", "8", "--context-parallel-algo", "mesh", "--mesh-shape", "2x4"]
    )
    got = (args.context_parallel_algo, args.mesh_shape, args.cp_comm_type)
    assert got == ("mesh", (2, 4), ["p2p"])
    three = parser.parse_args(["--mesh-shape", "2x2x2", "--mesh-heads", "2"])
    assert (three.mesh_shape, three.mesh_heads) == ((2, 2, 2), 2)
    defaults = parser.parse_args([])
    assert (defaults.context_parallel_algo, defaults.mesh_shape) == (None, None)
    assert defaults.mesh_heads is None
    assert validate_mesh_args(defaults) is None and defaults.context_parallel_algo == "p2p"
    for algo in ALGORITHMS:
        assert parser.parse_args(["--context-parallel-algo", algo]).context_parallel_algo == algo


@pytest.mark.parametrize(
    "argv, algo, comm",
    [
        (["--cp-comm-type", "mesh"], "mesh", ["mesh"]),
        (["--cp-comm-type", "mesh", "mesh"], "mesh", ["mesh", "mesh"]),
        (["--context-parallel-algo", "mesh", "--cp-comm-type", "mesh"], "mesh", ["mesh"]),
        (["--context-parallel-algo", "mesh"], "mesh", ["p2p"]),
        (["--context-parallel-algo", "a2a"], "a2a", ["a2a"]),
        (["--cp-comm-type", "all_gather"], "all_gather", ["all_gather"]),
        (["--cp-comm-type", "p2p", "a2a"], None, ["p2p", "a2a"]),  # Megatron's per-layer mix
        ([], "p2p", ["p2p"]),
    ],
)
def test_cp_comm_type_mesh_equals_context_parallel_algo_mesh(argv, algo, comm):
    from megatron_mesh.megatron.arguments import resolve_context_parallel_algo

    args = add_mesh_args(_megatron_like_parser()).parse_args(argv)
    assert resolve_context_parallel_algo(args) == algo
    assert (args.context_parallel_algo, args.cp_comm_type) == (algo, comm)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--cp-comm-type", "mesh", "p2p"], ["mesh p2p", "cannot be mixed", "--cp-comm-type mesh"]),
        (["--context-parallel-algo", "mesh", "--cp-comm-type", "a2a"],
         ["--context-parallel-algo mesh", "contradicts", "--cp-comm-type a2a"]),
        (["--cp-comm-type", "ring"], ["'ring'", "a2a+p2p", "mesh"]),
    ],
)
def test_cp_comm_type_conflicts_are_named(argv, words):
    args = add_mesh_args(_megatron_like_parser()).parse_args(argv)
    with pytest.raises(ValueError) as info:
        validate_mesh_args(args)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--context-parallel-algo", "ring"], ["ring", "a2a+p2p", "mesh"]),
        (["--mesh-shape", "2by4"], ["2by4", "RxC"]),
        (["--mesh-shape", "0x4"], ["0x4", "positive"]),
    ],
)
def test_bad_flags_exit_with_message(capsys, argv, words):
    parser = add_mesh_args(_megatron_like_parser())
    with pytest.raises(SystemExit) as info:
        parser.parse_args(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err, err


@pytest.mark.parametrize("text, shape", [("2x4", (2, 4)), ("8X1", (8, 1)), (" 1 x 16 ", (1, 16)),
                                         ("2x4x1", (2, 4, 1)), ("4 x 1 X 2", (4, 1, 2))])
def test_parse_mesh_shape(text, shape):
    assert parse_mesh_shape(text) == shape


@pytest.mark.parametrize("text", ["2x", "x4", "2*4", "-2x4", "2x0", "", "2x4x1x1", "0x2x2"])
def test_parse_mesh_shape_rejects(text):
    with pytest.raises(ValueError, match="RxC or AxRxC"):
        parse_mesh_shape(text)


def test_validate_explicit_shape():
    """The grid is always (A, R, C); RxC means A = 1 unless --mesh-heads says otherwise."""
    assert validate_mesh_args(_args(mesh_shape=(2, 4))) == (1, 2, 4)
    assert validate_mesh_args(_args(mesh_shape="4x2")) == (1, 4, 2)  # e.g. from a YAML config
    args = _args(mesh_shape="2x2", mesh_heads=2)
    assert validate_mesh_args(args) == (2, 2, 2) and args.mesh_heads == 2
    assert validate_mesh_args(_args(mesh_shape="2x4x1", mesh_heads=2)) == (2, 4, 1)
    args = _args(mesh_shape=(4, 1, 2))
    assert validate_mesh_args(args) == (4, 1, 2) and args.mesh_heads == 4
    # GQA with 4 K/V heads and A = 8 > 4: K/V heads are repeated, so A only has to divide
    # the 32 query heads
    assert validate_mesh_args(_args(mesh_shape="8x1x1", num_query_groups=4)) == (8, 1, 1)


def test_validate_mesh_heads_alone_lets_the_planner_pick_rows_and_cols(caplog):
    expected = dict(num_heads=32, head_dim=128, seq_length=4096, num_kv_heads=32)
    with caplog.at_level(logging.INFO, logger="megatron_mesh.megatron.arguments"):
        shape = validate_mesh_args(_args(context_parallel_size=16, mesh_heads=2))
    assert shape[0] == 2 and shape[1] * shape[2] == 8
    assert f"{shape[0]}x{shape[1]}x{shape[2]} grid (heads x rows x cols) of 16 CP ranks" in (
        caplog.text)
    # --mesh-heads 1 is the planner's best 2D mesh
    flat = validate_mesh_args(_args(context_parallel_size=16, mesh_heads=1))
    assert flat == (1, *plan(16, **expected).best_mesh.mesh_shape)


def test_validate_automatic_shape_is_logged_and_follows_gqa(caplog):
    with caplog.at_level(logging.INFO, logger="megatron_mesh.megatron.arguments"):
        mha = validate_mesh_args(_args(context_parallel_size=16))
    expected = dict(num_heads=32, head_dim=128, seq_length=_args().seq_length)
    assert mha == plan(16, **expected, num_kv_heads=32).best_grid.grid_shape == (16, 1, 1)
    assert "16x1x1 grid (heads x rows x cols)" in caplog.text and "planner" in caplog.text
    gqa = validate_mesh_args(_args(context_parallel_size=16, num_query_groups=4))
    assert gqa == plan(16, **expected, num_kv_heads=4).best_grid.grid_shape == (4, 4, 1)
    assert gqa[1] > mha[1]  # GQA: taller tiles (more rows)
    # with TP 4 a rank holds 8 query heads: the planner only offers A dividing them
    tp4 = validate_mesh_args(_args(context_parallel_size=16, tensor_model_parallel_size=4,
                                   num_attention_heads=8, num_query_groups=4))
    assert 8 % tp4[0] == 0 and tp4[0] <= 2
    # Megatron-LM ignores --num-query-groups unless --group-query-attention is set
    off = validate_mesh_args(
        _args(context_parallel_size=16, num_query_groups=4, group_query_attention=False)
    )
    assert off == mha


def test_validate_cp1_mesh_is_a_noop_that_says_so(caplog):
    with caplog.at_level(logging.WARNING):
        assert validate_mesh_args(_args(context_parallel_size=1, seq_length=31)) is None
    assert "1x1" in caplog.text and "plain attention" in caplog.text


def test_validate_other_algorithms_return_none():
    for algo in ("p2p", "all_gather", "a2a", "a2a+p2p"):
        assert validate_mesh_args(_args(context_parallel_algo=algo)) is None


@pytest.mark.parametrize(
    "overrides, words",
    [
        (dict(seq_length=4100), ["4100", "16"]),
        (dict(seq_length=4100, context_parallel_algo="p2p"), ["4100", "16"]),
        (dict(mesh_shape=(3, 2)), ["3x2", "8x1, 4x2, 2x4, 1x8"]),
        (dict(mesh_shape="2x2", context_parallel_size=1), ["2x2", "1x1"]),
        (dict(context_parallel_algo="ring"), ["'ring'", "p2p, all_gather, a2a, a2a+p2p, mesh"]),
        (dict(context_parallel_size=0), ["0", "positive"]),
        (dict(num_query_groups=5), ["5", "32"]),
        (dict(mesh_shape="two"), ["'two'", "RxC"]),
        (dict(mesh_shape="2x2x1"), ["2x2x1", "4 ranks", "8", "2x4x1, 2x2x2, 2x1x4"]),
        (dict(mesh_shape="3x1x1"), ["3x1x1", "8x1, 4x2", "8x1x1"]),
        (dict(mesh_heads=3), ["--mesh-heads 3", "32 query heads", "valid: 1, 2, 4, 8"]),
        (dict(mesh_heads=16, context_parallel_size=16, num_attention_heads=16,
              tensor_model_parallel_size=2),
         ["--mesh-heads 16", "8 query heads", "tensor parallelism 2", "valid: 1, 2, 4, 8"]),
        (dict(mesh_shape="2x2x2", mesh_heads=4), ["--mesh-heads 4", "2x2x2", "4x2x2"]),
        (dict(mesh_shape="2x2", mesh_heads=4), ["4x2x2", "16 ranks", "4x2x1, 4x1x2"]),
        (dict(mesh_shape="2x2", mesh_heads=0), ["--mesh-heads 0", "positive"]),
        (dict(tensor_model_parallel_size=3), ["tensor-parallel size 3", "32"]),
        (dict(attention_dropout=0.1), ["--attention-dropout 0.1", "--attention-dropout 0"]),
    ],
)
def test_validate_rejects_bad_configuration(overrides, words):
    with pytest.raises(ValueError) as info:
        validate_mesh_args(_args(**overrides))
    for word in words:
        assert word in str(info.value), str(info.value)


def _plain(spec):
    """A submodule spec as comparable data: megatron-core 0.19 builds some as
    functools.partial, which compares by identity."""
    if isinstance(spec, functools.partial):
        return spec.func, spec.args, spec.keywords
    return spec


def test_layer_spec_puts_mesh_core_attention_in_place():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_mesh.megatron import MeshDotProductAttention, get_gpt_layer_spec

    spec = get_gpt_layer_spec(normalization="RMSNorm")
    core = spec.submodules.self_attention.submodules.core_attention
    assert isinstance(core, ModuleSpec) and core.module is MeshDotProductAttention
    assert core.params == {"context_parallel_algo": "mesh"}
    # everything else is megatron-core's local spec (RMSNorm passed through)
    local = get_gpt_layer_local_spec(normalization="RMSNorm")
    assert _plain(spec.submodules.input_layernorm) == _plain(local.submodules.input_layernorm)
    assert _plain(spec.submodules.mlp) == _plain(local.submodules.mlp)


@pytest.mark.parametrize("algo", ["p2p", "all_gather", "a2a", "a2a+p2p"])
def test_the_spec_chooses_the_core_attention_class(algo):
    """One decision, in the spec: the mesh's class for 'mesh', Transformer Engine's attention
    (with cp_comm_type) for the others where it is installed; no class swaps itself."""
    from megatron_mesh.megatron import MeshDotProductAttention, get_gpt_layer_spec
    from megatron_mesh.megatron.core_attention import transformer_engine_attention

    assert "__new__" not in vars(MeshDotProductAttention)
    core = get_gpt_layer_spec(algo).submodules.self_attention.submodules.core_attention
    te_attention = transformer_engine_attention()
    if te_attention is None:  # plain attention at CP = 1, a named error at CP > 1
        assert core.module is MeshDotProductAttention
        assert core.params == {"context_parallel_algo": algo}
    else:
        assert core.module is te_attention and core.params == {"cp_comm_type": algo}


def test_layer_spec_rejects_bad_requests():
    import importlib.util

    from megatron_mesh.megatron import get_gpt_layer_spec

    with pytest.raises(ValueError, match="'ring'.*mesh"):
        get_gpt_layer_spec("ring")
    # multi-latent attention is taken (tests/distributed/test_megatron_mla.py): its spec holds the mesh
    mla = get_gpt_layer_spec(multi_latent_attention=True)
    assert mla.submodules.self_attention.submodules.core_attention.module.__name__ == \
        "MeshDotProductAttention"
    if importlib.util.find_spec("transformer_engine") is None:
        with pytest.raises(ValueError, match="Transformer Engine.*use_te=False"):
            get_gpt_layer_spec(use_te=True)


def test_mesh_schedule_flags_reach_the_core_attention_spec():
    from megatron_mesh.megatron.spec import get_gpt_layer_spec

    parser = add_mesh_args(argparse.ArgumentParser())
    assert parser.parse_args([]).mesh_schedule == "streamed"
    args = parser.parse_args(["--context-parallel-algo", "mesh", "--mesh-schedule", "gathered",
                              "--mesh-grad-reduce-dtype", "input"])
    spec = get_gpt_layer_spec(args.context_parallel_algo, schedule=args.mesh_schedule,
                              grad_reduce_dtype=args.mesh_grad_reduce_dtype)
    core = spec.submodules.self_attention.submodules.core_attention
    assert core.params["schedule"] == "gathered"
    assert core.params["grad_reduce_dtype"] == "input"
    with pytest.raises(SystemExit):
        parser.parse_args(["--mesh-schedule", "ring"])
