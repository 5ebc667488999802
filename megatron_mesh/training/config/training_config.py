"""The driver's configuration: the validated flags as frozen, typed groups composed into one.

The parser (`arguments.build_parser`) is the one declaration of the flags: their names,
defaults, choices and help. Each of its argument groups becomes one frozen dataclass
(`config_class`), named in `GROUP_NAMES`, with one field per flag typed from the flag's
action: bool for a switch, a `Literal` of the choices, the action's type (a conversion
function's return annotation), a tuple for `nargs`, and `| None` where the default is None.
The classes are generated rather than written out so that a new flag needs no second
declaration: it is a field of its group's class as soon as the parser has it, and a new
group fails at import until it is named here. The parser's module binds the class it
builds at module level and names it so (`config_class`'s `home`): a config pickles by
reference, to a spawned process too. `Derived` holds what `validate_args` derives from the
flags. `freeze` fills them from the validated namespace; nothing changes them after.

`TrainingConfig` composes the groups: ``cfg.model.hidden_size``, ``cfg.training.train_iters``,
``cfg.derived.world_size``. Code shared with Megatron-LM's flat argument namespace reads the
same names flat (``cfg.hidden_size``): `TrainingConfig.__getattr__` is that read-only
compatibility layer, and `as_dict` writes the flat names (logs, wandb, checkpoints).
Runtime state (the rank, process groups, the mesh grid) lives with the code that creates it.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import operator
import types
import typing
from typing import TYPE_CHECKING, Any, ClassVar, Literal

GROUP_NAMES: dict[str, str] = {
    "options": "command_line",
    "model": "model",
    "training": "training",
    "optimizer and learning rate": "optimization",
    "parallelism": "parallel",
    "mesh context parallelism": "mesh",
    "mesh attention masks": "masks",
    "packed documents (--reset-attention-mask)": "packing",
    "mixture of experts": "moe",
    "data": "data",
    "checkpointing": "checkpoint",
    "evaluation": "evaluation",
    "logging": "logging",
    "stopping safely": "stopping",
    "Megatron-LM flags accepted without effect (named at start-up when given)": "no_effect",
}
"""The parser's argument group titles and the config's attribute for each group."""


@dataclasses.dataclass(frozen=True)
class Derived:
    """The values `validate_args` derives from the flags (not flags themselves)."""

    world_size: int
    data_parallel_size: int
    num_microbatches: int
    mesh_shape_chosen_by_planner: bool | None  # None: no mesh (CP = 1 or another algorithm)
    k_channels: int  # the core attention's Q / K head dim (MLA: qk + rope, else kv_channels)
    v_channels: int  # its V head dim (MLA: v_head_dim, else kv_channels)
    lr_warmup_steps: int  # the LR schedule in samples (schedule_length.py)
    lr_decay_steps: int
    wd_incr_steps: int


DERIVED_GROUP = "derived"
_SWITCHES = (argparse._StoreTrueAction, argparse._StoreFalseAction,
             argparse.BooleanOptionalAction)


def flag_type(action: argparse.Action) -> Any:
    """The type of the values `action` stores: see the module docstring. TypeError for a
    conversion function without a return annotation (its values' type is unknown)."""
    if isinstance(action, _SWITCHES):
        kind: Any = bool
    elif action.choices is not None:
        kind = Literal[tuple(action.choices)]
    elif action.type is None:
        kind = str
    elif isinstance(action.type, type):
        kind = action.type
    else:
        kind = typing.get_type_hints(action.type).get("return")
        if kind is None:
            raise TypeError(f"{action.option_strings[0]}: annotate the return type of its "
                            f"type function {action.type.__name__} (the config field's type)")
        kind = _frozen(kind)
    if action.nargs in ("+", "*"):
        kind = tuple[kind, ...]
    elif isinstance(action.nargs, int) and not isinstance(action, _SWITCHES):
        kind = tuple[(kind,) * action.nargs]
    return kind | None if action.default is None else kind


def _frozen(kind: Any) -> Any:
    """`kind` as `freeze` stores it: a list[X] (a conversion function's) becomes
    tuple[X, ...], inside a union too."""
    if typing.get_origin(kind) is list:
        return tuple[(*typing.get_args(kind), ...)]
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        members = tuple(_frozen(k) for k in typing.get_args(kind))
        return functools.reduce(operator.or_, members)
    return kind


class TrainingConfig:
    """The validated flags, frozen: the base of the class `config_class` builds, whose fields
    are one frozen dataclass per argument group (`GROUP_NAMES`) and `derived`. Modules name
    this type for their arguments without importing the parser, which imports them.

    A flag also reads flat (``cfg.hidden_size`` is ``cfg.model.hidden_size``), as in
    Megatron-LM's namespace, which much shared code takes too; nothing can be set."""

    __slots__ = ()
    GROUPS: ClassVar[dict[str, type]]  # attribute -> its group's class, derived last
    FLAT: ClassVar[dict[str, str]]  # flat name -> its group's attribute, in the parser's order

    if TYPE_CHECKING:
        derived: Derived

    def __getattr__(self, name: str) -> Any:
        group = type(self).FLAT.get(name) if not name.startswith("__") else None
        if group is None:
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        return getattr(getattr(self, group), name)


def _class_name(attribute: str) -> str:
    return "".join(word.capitalize() for word in attribute.split("_")) + "Flags"


def config_class(parser: argparse.ArgumentParser, home: tuple[str, str] | None = None
                 ) -> type[TrainingConfig]:
    """The frozen `TrainingConfig` class of `parser`'s flags: a frozen dataclass per argument
    group and `Derived`. `home`: (module, name) where the caller binds the class at module
    level, so that it and its group classes (its attributes, e.g. ``NAME.ModelFlags``)
    pickle by reference (a spawned process rebuilds them when it imports the module).
    TypeError for a group missing from `GROUP_NAMES`, a flag whose type cannot be resolved,
    or a flag named like a group."""
    groups: dict[str, type] = {}
    flat: dict[str, str] = {}
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.dest not in ("help", argparse.SUPPRESS)]
        if not actions:
            continue
        if group.title not in GROUP_NAMES:
            raise TypeError(f"argument group {group.title!r} has no config attribute: name it "
                            "in training/config/training_config.py's GROUP_NAMES")
        attribute = GROUP_NAMES[group.title]
        fields = [(a.dest, flag_type(a)) for a in actions]
        groups[attribute] = _homed(dataclasses.make_dataclass(
            _class_name(attribute), fields, frozen=True,
            namespace={"__doc__": f"The flags of the parser's {group.title!r} group."}),
            home, _class_name(attribute))
        flat.update((dest, attribute) for dest, _ in fields)
    groups[DERIVED_GROUP] = Derived
    flat.update((f.name, DERIVED_GROUP) for f in dataclasses.fields(Derived))
    order = {a.dest: i for i, a in enumerate(parser._actions)}
    flat = dict(sorted(flat.items(), key=lambda item: order.get(item[0], len(order))))
    clashes = sorted(set(flat) & set(groups))
    if clashes:
        raise TypeError(f"flags {clashes} are named like a config group; rename the group")
    classes = {cls.__name__: cls for key, cls in groups.items() if key != DERIVED_GROUP}
    return _homed(dataclasses.make_dataclass(
        "TrainingConfig", list(groups.items()), bases=(TrainingConfig,), frozen=True,
        namespace={"__doc__": __doc__.splitlines()[0], "GROUPS": groups, "FLAT": flat,
                   **classes}), home)


def _homed(cls: type, home: tuple[str, str] | None, attribute: str | None = None) -> type:
    """`cls` named where pickle finds it again: module home[0], attribute home[1] (and
    its `attribute` there, for a group's class); as made where `home` is None."""
    if home is not None:
        module, name = home
        cls.__module__ = module
        cls.__qualname__ = name if attribute is None else f"{name}.{attribute}"
    return cls


def _as_declared(value: Any, kind: Any) -> Any:
    """`value` as the field type `kind` holds it: a list as a tuple, an int (from YAML) as a
    float where the field is a float."""
    if isinstance(value, list):
        return tuple(value)
    union = typing.get_origin(kind) in (typing.Union, types.UnionType)
    kinds = typing.get_args(kind) if union else (kind,)
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def freeze(args: argparse.Namespace, cls: type[TrainingConfig]) -> TrainingConfig:
    """The validated namespace as a frozen `cls` (from `config_class`).

    A value the class does not declare is a programming error and raises TypeError, so no
    attribute set along the way is lost silently.
    """
    values = vars(args)
    unknown = sorted(set(values) - set(cls.FLAT))
    if unknown:
        raise TypeError(f"TrainingConfig has no fields {unknown}; add them to Derived")
    return cls(**{
        name: group(**{f.name: _as_declared(values.get(f.name), f.type)
                       for f in dataclasses.fields(group)})
        for name, group in cls.GROUPS.items()})


def as_dict(config: TrainingConfig) -> dict[str, Any]:
    """The config's flat names and values, in the parser's order, then the derived ones (for
    logs, wandb and checkpoints)."""
    return {name: getattr(getattr(config, group), name)
            for name, group in type(config).FLAT.items()}
