"""The driver's configuration: the validated flags as one frozen, typed object.

The parser (`arguments.build_parser`) is the one declaration of the flags: `config_class`
turns each of its actions into a field typed from the action (its `type`, bool for switches,
a tuple for `nargs`), adds the values `validate_args` derives (`DERIVED`), and makes the
class frozen. `freeze` fills it from the validated namespace; nothing changes it after that.
Runtime state (the rank, process groups, the mesh grid) lives with the code that creates it.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING, Any

# values validate_args derives from the flags (not flags themselves), with their types
DERIVED: dict[str, Any] = {
    "world_size": int,
    "data_parallel_size": int,
    "num_microbatches": int,
    "mesh_shape_chosen_by_planner": bool,
    "k_channels": int,  # the core attention's Q / K head dim (MLA: qk + rope, else kv_channels)
    "v_channels": int,  # its V head dim (MLA: v_head_dim, else kv_channels)
    "lr_warmup_steps": int,  # the LR schedule in samples (schedule_length.py)
    "lr_decay_steps": int,
    "wd_incr_steps": int,
}


def _field_type(action: argparse.Action) -> Any:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction,
                           argparse.BooleanOptionalAction)):
        return bool
    base = action.type if isinstance(action.type, type) else (
        str if action.type is None else Any)
    if action.nargs in ("+", "*"):
        return tuple[base, ...] | None
    return base | None if action.default is None else base


class TrainingConfig:
    """The validated flags, frozen: the base of the class `config_class` builds from the parser
    (its fields are the flags plus `DERIVED`). Modules name this type for their arguments
    without importing the parser, which imports them."""

    __slots__ = ()

    if TYPE_CHECKING:
        def __getattr__(self, name: str) -> Any: ...  # the fields come from the parser


def config_class(parser: argparse.ArgumentParser) -> type[TrainingConfig]:
    """The frozen dataclass of `parser`'s flags plus `DERIVED`, a `TrainingConfig`."""
    fields = [(a.dest, _field_type(a)) for a in parser._actions
              if a.dest not in ("help", argparse.SUPPRESS)]
    fields += [(name, kind) for name, kind in DERIVED.items()
               if name not in {f for f, _ in fields}]
    return dataclasses.make_dataclass("TrainingConfig", fields, bases=(TrainingConfig,),
                                      frozen=True, namespace={"__doc__": __doc__.splitlines()[0]})


def freeze(args: argparse.Namespace, cls: type[TrainingConfig]) -> TrainingConfig:
    """The validated namespace as a frozen `cls` (from `config_class`; lists become tuples).

    A value the class does not declare is a programming error and raises TypeError, so no
    attribute set along the way is lost silently.
    """
    names = {f.name for f in dataclasses.fields(cls)}
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in vars(args).items()}
    unknown = sorted(set(values) - names)
    if unknown:
        raise TypeError(f"TrainingConfig has no fields {unknown}; add them to DERIVED")
    return cls(**{name: values.get(name) for name in names})


def as_dict(config: Any) -> dict[str, Any]:
    """The config's fields and values (for logs, wandb and checkpoints)."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
