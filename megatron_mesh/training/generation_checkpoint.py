"""The weights generation loads: a checkpoint of the pretraining driver, saved on any grid
(the mesh, CP, DP, TP or PP layout it was trained with does not matter: dist_checkpointing
reshards), checked against the model flags from its files alone, before any collective."""
from __future__ import annotations

import os

import torch
from megatron.core import dist_checkpointing

from megatron_mesh.training.checkpoint import SHAPE_FLAGS, checkpoint_dir, latest_iteration
from megatron_mesh.training.checksums import CheckpointError, verify_manifest

# the driver's saved "model_shape" that the weights alone do not pin (RoPE's share of the
# head dims, the normalization...): a generation flag differing from them is refused, not
# run on the wrong model; the position table's length may differ (longer generation)
SHAPE_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
              "ffn_hidden_size", *(k for k in SHAPE_FLAGS if k != "max_position_embeddings"))
EMBEDDING = "embedding.word_embeddings.weight"


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


def check_model_shape(path: str, shape: dict, vocab: int) -> None:
    """CheckpointError naming the first model flag whose value differs from the
    checkpoint's (and the padded vocabulary, from the embedding's saved shape)."""
    common = dist_checkpointing.load_common_state_dict(path)
    saved = common.get("model_shape") or {}
    for key in SHAPE_KEYS:
        if key in saved and saved[key] != shape[key]:
            raise CheckpointError(f"checkpoint {path} holds a model with --{key.replace('_', '-')} "
                                  f"{saved[key]}, the flags say {shape[key]}: give the model "
                                  "flags it was trained with")
    meta = dist_checkpointing.load_tensors_metadata(path)
    emb = meta.get(EMBEDDING)
    if emb is not None and tuple(emb.global_shape) != (vocab, shape["hidden_size"]):
        raise CheckpointError(f"checkpoint {path} has a {emb.global_shape[0]}-token padded "
                              f"vocabulary, the flags make {vocab}: give the --vocab-size / "
                              "tokenizer it was trained with")


def load_weights(path: str, model: torch.nn.Module) -> None:
    """Collective: verify the checksums, then load the model's weights (not the optimizer)."""
    verify_manifest(path, "give another --ckpt-step")
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, path)
    model.load_state_dict(loaded["model"])
