"""The driver's config: one frozen dataclass per argument group, every field typed from its
flag, the parsed values instances of those types, flat names read through, as_dict flat;
a whole config pickles and back."""
from __future__ import annotations

import dataclasses
import pickle
import types
import typing
from pathlib import Path
from typing import Any, Literal

import pytest

from megatron_mesh.training.config.arguments import build_parser, parse_args
from megatron_mesh.training.config.training_config import (
    GROUP_NAMES,
    Derived,
    TrainingConfig,
    as_dict,
    config_class,
    flag_type,
    freeze,
)

ROOT = Path(__file__).resolve().parents[2]
CONFIG = config_class(build_parser())
TINY = str(ROOT / "configs" / "tiny-cpu.yaml")
MESH = ["--context-parallel-size", "4", "--context-parallel-algo", "mesh"]
PARSED = {  # flag sets whose every value is checked against its field's type
    "defaults": ["--vocab-size", "128"],
    "tiny mesh": ["--config", TINY, *MESH],
    "tuples and choices": ["--config", TINY, *MESH, "--mesh-shape", "2x2", "--window-size",
                           "16", "0", "--train-samples", "64", "--rampup-batch-size", "2", "2",
                           "16", "--recompute-granularity", "full", "--data-cache-path", "/x",
                           "--profile-ranks", "0", "1"],
    "gpt-oss": ["--config", str(ROOT / "configs" / "gpt-oss-tiny-cpu.yaml"), *MESH],
}


@pytest.fixture(autouse=True)
def _world(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")


def _is_union(kind: Any) -> bool:
    return typing.get_origin(kind) in (typing.Union, types.UnionType)


def _conforms(value: Any, kind: Any) -> bool:
    """Whether `value` is an instance of the field type `kind` (strict: an int is no float,
    a bool no int)."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if _is_union(kind):
        return any(_conforms(value, k) for k in args)
    if origin is Literal:
        return value in args
    if origin is tuple:
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_conforms(v, args[0]) for v in value)
        return len(value) == len(args) and all(map(_conforms, value, args))
    if kind is type(None):
        return value is None
    if kind in (int, float):
        return type(value) is kind
    return isinstance(value, kind)


def _parts(kind: Any) -> list[Any]:
    """`kind` and every type inside it (a union's members, a tuple's items)."""
    return [kind, *(p for arg in typing.get_args(kind) for p in _parts(arg))]


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def test_every_argument_group_is_one_frozen_group_of_the_config() -> None:
    parser = build_parser()
    groups = {GROUP_NAMES[g.title]: [a.dest for a in g._group_actions if a.dest != "help"]
              for g in parser._action_groups if g.title in GROUP_NAMES}
    assert list(CONFIG.GROUPS) == [*(n for n, dests in groups.items() if dests), "derived"]
    for name, cls in CONFIG.GROUPS.items():
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, name
        expected = groups.get(name) or [f.name for f in dataclasses.fields(Derived)]
        assert [f.name for f in dataclasses.fields(cls)] == expected, name
    assert [f.name for f in dataclasses.fields(CONFIG)] == list(CONFIG.GROUPS)


def test_every_field_has_a_concrete_type() -> None:
    """No `Any`, no bare `object`: each flag's type resolved from its action."""
    for name, cls in CONFIG.GROUPS.items():
        for field, kind in _field_types(cls).items():
            assert not {Any, object} & set(_parts(kind)), f"{name}.{field}: {kind}"


def test_field_types_follow_the_actions() -> None:
    hints = {name: _field_types(cls) for name, cls in CONFIG.GROUPS.items()}
    assert hints["model"]["hidden_size"] is int
    assert hints["model"]["ffn_hidden_size"] == int | None
    assert hints["model"]["swiglu"] is bool
    assert hints["model"]["window_size"] == tuple[int, int] | None
    assert hints["model"]["normalization"] == Literal["LayerNorm", "RMSNorm"]
    assert hints["optimization"]["lr"] is float
    assert hints["training"]["rampup_batch_size"] == tuple[int, int, int] | None
    assert hints["mesh"]["mesh_shape"] == tuple[int, ...] | None  # the conversion's return
    assert hints["data"]["data_path"] == tuple[str, ...] | None
    assert hints["derived"]["world_size"] is int


@pytest.mark.parametrize("name", sorted(PARSED))
def test_parsed_values_are_instances_of_their_declared_types(name: str) -> None:
    config = parse_args(PARSED[name])
    assert list(type(config).GROUPS) == list(CONFIG.GROUPS)
    for group, cls in type(config).GROUPS.items():
        values = getattr(config, group)
        assert type(values) is cls
        for field, kind in _field_types(cls).items():
            value = getattr(values, field)
            assert _conforms(value, kind), f"{group}.{field} = {value!r} is no {kind}"


@pytest.mark.parametrize("name", sorted(PARSED))
def test_a_config_pickles_and_back(name: str) -> None:
    """A whole config survives pickle (a spawned worker's arguments): its class and its
    groups' classes are found again by name where the parser's module binds them."""
    config = parse_args(PARSED[name])
    back = pickle.loads(pickle.dumps(config))
    assert back == config and type(back) is type(config)
    for group in type(config).GROUPS:
        assert type(getattr(back, group)) is type(getattr(config, group))
    assert as_dict(back) == as_dict(config) and back.hidden_size == config.hidden_size


def test_flat_names_read_the_groups_and_nothing_is_set() -> None:
    config = parse_args(PARSED["tiny mesh"])
    assert isinstance(config, TrainingConfig)
    assert config.hidden_size == config.model.hidden_size == 64
    assert config.train_iters == config.training.train_iters == 20
    assert config.world_size == config.derived.world_size == 4
    for flat, group in CONFIG.FLAT.items():
        assert getattr(config, flat) == getattr(getattr(config, group), flat)
    with pytest.raises(AttributeError, match="no_such_flag"):
        config.no_such_flag  # noqa: B018
    assert getattr(config, "no_such_flag", None) is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.model.hidden_size = 32
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.hidden_size = 32
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.derived.world_size = 8


def test_as_dict_writes_the_flat_names_in_the_parsers_order() -> None:
    """Logs, wandb and the checkpoints read these keys: every flag, then the derived values."""
    config = parse_args(PARSED["tiny mesh"])
    flags = [a.dest for a in build_parser()._actions if a.dest != "help"]
    written = as_dict(config)
    assert list(written) == flags + [f.name for f in dataclasses.fields(Derived)]
    assert written["hidden_size"] == 64 and written["num_microbatches"] == 2


def test_a_yaml_int_for_a_float_flag_is_a_float(tmp_path: Path) -> None:
    config = tmp_path / "ints.yaml"
    config.write_text(Path(TINY).read_text() + "clip-grad: 1\nmin-lr: 0\n")
    parsed = parse_args(["--config", str(config), *MESH])
    assert type(parsed.optimization.clip_grad) is float and parsed.clip_grad == 1.0
    assert type(parsed.optimization.min_lr) is float


def test_a_value_no_group_declares_is_refused() -> None:
    parser = build_parser()
    args = parser.parse_args([])
    args.not_a_flag = 1
    with pytest.raises(TypeError, match="not_a_flag"):
        freeze(args, CONFIG)


def test_building_the_config_leaves_the_help_as_it_was() -> None:
    parser = build_parser()
    before = parser.format_help()
    config_class(parser)
    assert parser.format_help() == before


def test_a_new_group_or_an_untyped_conversion_is_refused() -> None:
    parser = build_parser()
    parser.add_argument_group("unnamed").add_argument("--new-flag", type=int, default=1)
    with pytest.raises(TypeError, match="GROUP_NAMES"):
        config_class(parser)
    action = build_parser().add_argument("--odd", type=lambda text: text)
    with pytest.raises(TypeError, match="annotate the return type"):
        flag_type(action)
