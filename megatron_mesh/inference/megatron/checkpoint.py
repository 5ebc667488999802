"""The weights generation loads: a checkpoint of the pretraining driver, saved on any grid
(the mesh, CP, DP, TP or PP layout it was trained with does not matter: dist_checkpointing
reshards), checked against the model flags from its files alone, before any collective.

The checkpoint's model description (`model_description.MODEL_FLAGS`, saved by training)
gives every model flag the command line leaves out; a flag given with another value is
refused, naming both. A description saved by an older version lacks some flags: those run
with the flags' values, named in a warning, and the weights' names and shapes are checked
against the flags' model before loading (`check_weights`), so a flag that adds or drops
weights (sinks, QK norms, experts, a position table) is refused there.
"""
from __future__ import annotations

import os
from typing import Any

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from megatron_mesh.training.checkpoints.checksums import CheckpointError, verify_manifest
from megatron_mesh.training.checkpoints.model_description import (
    MODEL_FLAGS,
    checked_description,
    completed,
    differences,
    flag_name,
    unrecorded,
    value_text,
)
from megatron_mesh.training.checkpoints.store import (
    checkpoint_dir,
    latest_iteration,
    read_common_state,
)
from megatron_mesh.training.config.arguments import build_parser

EMBEDDING = "embedding.word_embeddings.weight"
OLDER = "give another --ckpt-step"  # what to load instead of a checkpoint that cannot be used
# a weight's name -> the flag that makes it (named when a checkpoint and the flags differ)
WEIGHT_FLAGS = (("softmax_offset", "--softmax-type learnable"),
                ("q_layernorm", "--qk-layernorm"), ("k_layernorm", "--qk-layernorm"),
                ("mlp.router", "--num-experts"), ("mlp.experts", "--num-experts"),
                ("position_embeddings", "--position-embedding-type / --max-position-embeddings"),
                ("output_layer", "--untie-embeddings-and-output-weights"),
                ("bias", "--disable-bias-linear"))


def checkpoint_path(root: str, step: int | None) -> str:
    """The folder of checkpoint `step` (None: the newest) under root; CheckpointError when
    there is none."""
    iteration = step if step is not None else latest_iteration(root)
    if iteration is None:
        raise CheckpointError(f"--load {root}: no checkpoint there (no "
                              "latest_checkpointed_iteration.txt); train one with pretrain_gpt "
                              "--save DIR first")
    path = checkpoint_dir(root, iteration)
    if not os.path.isfile(os.path.join(path, "metadata.json")):
        raise CheckpointError(f"--load {root}: {path} is not a complete checkpoint")
    return path


def saved_model(path: str) -> dict[str, Any]:
    """The checkpoint's model description ({flag dest: value}; empty from a very old one),
    with what an older description implies (`model_description.completed`). Its files are
    checked against the checksums first; CheckpointError on a file that differs or is
    unreadable, or a description no command line could give."""
    return completed(checked_description(read_common_state(path, OLDER), path,
                                         build_parser()))


def model_defaults(saved: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's values of the model flags: the defaults of generation's flags."""
    return {k: saved[k] for k in MODEL_FLAGS if k in saved}


def check_model_flags(path: str, saved: dict[str, Any], args: Any) -> list[str]:
    """CheckpointError naming every model flag whose value differs from the checkpoint's,
    both values; returns the model flags the checkpoint does not record (older versions)."""
    differ = differences(saved, args)
    if differ:
        raise CheckpointError(f"checkpoint {path} holds a model with {'; '.join(differ)}: give "
                              "the model flags it was trained with, or leave them out to take "
                              "the checkpoint's")
    return unrecorded(saved)


def unrecorded_warning(path: str, missing: list[str], args: Any) -> str:
    """One line naming the model flags a checkpoint does not record and the values used."""
    used = ", ".join(f"{flag_name(k)} {value_text(getattr(args, k))}" for k in missing)
    return (f" warning: checkpoint {path} (saved by an older version) does not record "
            f"{len(missing)} model flags; generating with the flags' {used}: give the values it "
            "was trained with")


def _tensors_metadata(path: str) -> dict[str, Any]:
    try:
        return dist_checkpointing.load_tensors_metadata(path)
    except Exception as e:  # a damaged .metadata: pickle or torch errors of many kinds
        raise CheckpointError(f"checkpoint {path}: file .metadata cannot be read "
                              f"({type(e).__name__}); {OLDER}") from None


def check_vocabulary(path: str, vocab: int, hidden: int) -> None:
    """CheckpointError when the embedding's saved shape differs from the flags' model's
    [padded vocabulary, hidden size], naming which."""
    emb = _tensors_metadata(path).get(EMBEDDING)
    if emb is None:
        return
    shape = list(emb.global_shape)
    if shape[0] != vocab:
        raise CheckpointError(f"checkpoint {path} has a {shape[0]}-token padded vocabulary, the "
                              f"flags make {vocab}: give the --vocab-size / tokenizer it was "
                              "trained with")
    if shape != [vocab, hidden]:
        raise CheckpointError(f"checkpoint {path} holds {EMBEDDING} of shape {shape}, the flags' "
                              f"model (--hidden-size {hidden}) [{vocab}, {hidden}]: give the "
                              "model flags it was trained with")


def check_tensor_files(path: str) -> None:
    """CheckpointError when a tensor file the checkpoint's .metadata indexes is missing or
    shorter than the bytes it places there (files of another checkpoint, a cut copy):
    on this rank alone, before the collective load."""
    try:
        storage = FileSystemReader(path).read_metadata().storage_data
    except Exception as e:
        raise CheckpointError(f"checkpoint {path}: file .metadata cannot be read "
                              f"({type(e).__name__}); {OLDER}") from None
    ends: dict[str, tuple[int, str]] = {}
    for index, info in storage.items():
        end = info.offset + info.length
        if end > ends.get(info.relative_path, (-1, ""))[0]:
            ends[info.relative_path] = (end, index.fqn)
    for name, (end, key) in sorted(ends.items()):
        try:
            size = os.path.getsize(os.path.join(path, name))
        except OSError:
            raise CheckpointError(f"checkpoint {path}: file {name}, which its .metadata "
                                  f"indexes, is missing; {OLDER}") from None
        if size < end:
            raise CheckpointError(f"checkpoint {path}: file {name} has {size} bytes, its "
                                  f".metadata places {key} up to byte {end}: the tensor files "
                                  f"are not this checkpoint's; {OLDER}")


def _flag_of(key: str) -> str:
    hit = [flag for part, flag in WEIGHT_FLAGS if part in key]
    return f" (made by {hit[0]})" if hit else ""


def check_weights(path: str, model: torch.nn.Module) -> None:
    """CheckpointError naming the first weight the flags' model and the checkpoint do not
    share (missing on either side, or another global shape). Reads the checkpoint's metadata
    and the model's sharded state dict on this rank alone: every rank decides the same,
    before the collective load."""
    meta = _tensors_metadata(path)
    sharded = model.sharded_state_dict()
    apply_factories(sharded)
    mine = {t.key: tuple(t.global_shape) for t in nested_values(sharded)
            if isinstance(t, ShardedTensor)}
    theirs = {k: tuple(v.global_shape) for k, v in meta.items() if not k.startswith("optimizer.")}
    hint = "give the model flags it was trained with"
    for key in sorted(mine):
        if key not in theirs:
            raise CheckpointError(f"checkpoint {path} has no weight {key}, which the flags' model "
                                  f"has{_flag_of(key)}: {hint}")
        if mine[key] != theirs[key]:
            raise CheckpointError(f"checkpoint {path} holds {key} of shape {list(theirs[key])}, "
                                  f"the flags' model {list(mine[key])}{_flag_of(key)}: {hint}")
    extra = sorted(set(theirs) - set(mine))
    if extra:
        raise CheckpointError(f"checkpoint {path} holds weights the flags' model has no place for "
                              f"({extra[0]}{_flag_of(extra[0])}); they would not be loaded: {hint}")


def load_weights(path: str, model: torch.nn.Module) -> None:
    """Collective: verify the checksums, then load the model's weights (not the optimizer).
    CheckpointError, the same on every rank, when the tensor files do not hold what the
    checkpoint's .metadata says (files of another model in a checkpoint without checksums)."""
    verify_manifest(path, OLDER)
    try:
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, path)
    except CheckpointException as e:  # every rank's failure to read, gathered on each
        raise CheckpointError(f"checkpoint {path}: its tensor files do not hold what its "
                              f".metadata says ({_load_failure(e)}); {OLDER}") from None
    model.load_state_dict(loaded["model"])


def _load_failure(e: CheckpointException) -> str:
    """The first failing rank's reason in a failed load: its exception's last line."""
    cause: BaseException = e
    if e.failures:
        first = e.failures[min(e.failures)]
        cause = first[0] if isinstance(first, tuple) else first
    lines = [line for line in str(cause).strip().splitlines() if line.strip()]
    reason = lines[-1].strip().split(". ")[0][:300] if lines else ""
    return f"{type(cause).__name__}: {reason}"
