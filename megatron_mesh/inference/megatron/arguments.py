"""The generate command's own flags, its prompts, and every check made before any collective.

The model flags are the pretraining driver's (`arguments.parse_args`, `--config` too); the
generation flags below are read first and removed. A model flag left out takes the
checkpoint's value (its saved model description), one given with another value is refused.
A bad value is a `ConfigError` or `CheckpointError` naming it and what is valid (the command
prints it on one line and exits 2).
"""
from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Sequence

from megatron_mesh.inference.decode import EXCHANGES
from megatron_mesh.inference.megatron.checkpoint import (
    check_model_flags,
    checkpoint_path,
    model_defaults,
    saved_model,
)
from megatron_mesh.training.config.arguments import ConfigError, build_parser, load_config, parse_args
from megatron_mesh.training.config.training_config import TrainingConfig


@dataclass(frozen=True)
class GenerateConfig:
    """What to generate: prompt files, how many new tokens, how to choose them, where to write."""

    prompt_ids_file: str | None
    prompts_file: str | None
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    output: str | None
    decode_exchange: str = "all_gather"
    pack_prompts: bool = False
    checkpoint: str = ""  # the checkpoint folder (iter_N) under --load
    unrecorded: tuple[str, ...] = ()  # model flags its description lacks (older versions)


def generate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m megatron_mesh.generate", add_help=False,
        description="Generate from a checkpoint of the pretraining driver, with the mesh's "
                    "context parallelism; the model flags are pretrain_gpt's (--config too), "
                    "with --load DIR.")
    p.add_argument("--load", help="a checkpoint folder of the pretraining driver (its --save)")
    p.add_argument("--prompt-ids-file", help="a JSON list of token-id lists")
    p.add_argument("--prompts-file", help="text, one prompt per line (the model's tokenizer)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=None,
                   help="sample at this temperature (0: greedy, the default without "
                        "--temperature / --top-k / --top-p)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: all)")
    p.add_argument("--output", help="JSON lines: prompt ids, generated ids, text (without "
                                    "it: each prompt and its continuation on stdout)")
    p.add_argument("--decode-exchange", default="all_gather",
                   help="how a decode step merges the CP ranks' partial attention: all_gather "
                        "(one ring collective of (out, lse)) or all_reduce (a max and a sum, "
                        "trees; fewer hops on many GPUs); docs/inference.md")
    p.add_argument("--pack-prompts", action="store_true",
                   help="pack the prompts into one sequence placed over the CP ranks by "
                        "document (place_documents) instead of padding each to the longest")
    return p


def parse_generate(argv: Sequence[str]) -> tuple[GenerateConfig, TrainingConfig]:
    """(generation flags, model flags: the checkpoint's where not given); ConfigError or
    CheckpointError on a bad value or a model flag that differs from the checkpoint's."""
    gen, rest = generate_parser().parse_known_args(list(argv))
    if gen.load is None:
        raise ConfigError("--load DIR is required: a checkpoint of the pretraining driver")
    if not os.path.isdir(gen.load):
        raise ConfigError(f"--load {gen.load}: no such folder; give a --save folder of "
                          "python -m megatron_mesh.pretrain_gpt")
    rest += ["--load", gen.load]
    if gen.prompt_ids_file is None and gen.prompts_file is None:
        raise ConfigError("give --prompt-ids-file FILE (a JSON list of token-id lists) and/or "
                          "--prompts-file FILE (one prompt per line)")
    if gen.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be a positive integer, got {gen.max_new_tokens}")
    sampling = gen.temperature is not None or gen.top_k or gen.top_p != 1.0
    temperature = (1.0 if gen.temperature is None else gen.temperature) if sampling else 0.0
    if not math.isfinite(temperature) or temperature < 0:
        raise ConfigError(f"--temperature must be a finite number >= 0 (0: greedy), got "
                          f"{gen.temperature}")
    if gen.top_k < 0:
        raise ConfigError(f"--top-k must be >= 0 (0: all tokens), got {gen.top_k}")
    if not 0.0 < gen.top_p <= 1.0:
        raise ConfigError(f"--top-p must be in (0, 1], got {gen.top_p}")
    if gen.decode_exchange not in EXCHANGES:
        raise ConfigError(f"--decode-exchange {gen.decode_exchange!r}: valid values are "
                          f"{', '.join(EXCHANGES)}")
    for flag, path in (("--prompt-ids-file", gen.prompt_ids_file),
                       ("--prompts-file", gen.prompts_file)):
        if path is not None and not os.path.isfile(path):
            raise ConfigError(f"{flag} {path}: no such file")
    path = checkpoint_path(gen.load, _ckpt_step(rest))
    saved = saved_model(path)
    args = parse_args(rest, defaults=model_defaults(saved))
    unrecorded = check_model_flags(path, saved, args)
    _check_layout(args)
    if gen.pack_prompts and args.attention_chunk_size is not None:
        raise ConfigError(f"--pack-prompts with a model trained with --attention-chunk-size "
                          f"{args.attention_chunk_size}: packed prompts decode causally inside "
                          "each document only; drop --pack-prompts")
    return GenerateConfig(gen.prompt_ids_file, gen.prompts_file, gen.max_new_tokens,
                          temperature, gen.top_k, gen.top_p, gen.output,
                          gen.decode_exchange, gen.pack_prompts, path, tuple(unrecorded)), args


def _ckpt_step(rest: list[str]) -> int | None:
    """--ckpt-step from the model flags (or their --config), read before they are checked:
    the checkpoint it names gives their defaults."""
    parser = build_parser()
    pre, _ = parser.parse_known_args(rest)
    if pre.ckpt_step is None and pre.config:
        return load_config(pre.config, parser).get("ckpt_step")
    return pre.ckpt_step


def _check_layout(args: TrainingConfig) -> None:
    """Generation runs context parallelism alone, through the mesh."""
    if args.tensor_model_parallel_size != 1 or args.pipeline_model_parallel_size != 1:
        raise ConfigError(f"generate runs with --tensor-model-parallel-size 1 and "
                          f"--pipeline-model-parallel-size 1, got TP "
                          f"{args.tensor_model_parallel_size}, PP "
                          f"{args.pipeline_model_parallel_size} (any checkpoint layout loads)")
    if args.data_parallel_size != 1:
        raise ConfigError(f"world size {args.world_size} must equal --context-parallel-size "
                          f"{args.context_parallel_size}: launch with torchrun --nproc-per-node "
                          f"{args.context_parallel_size}")
    if args.mesh_mask_builder is not None:
        raise ConfigError(f"generate does not run a model trained with --mesh-mask-builder "
                          f"{args.mesh_mask_builder}: the builder masks a whole micro-batch "
                          "of equal samples, so the rows of tokens already in the KV cache "
                          "could change as the sequence grows (and prompts of other lengths "
                          "put tokens elsewhere); generate with InferenceSession("
                          "attention_mask=...) and a mask fixed for the whole sequence")
    if args.context_parallel_size > 1 and args.context_parallel_algo != "mesh":
        raise ConfigError(f"generate runs context parallelism through the mesh: use "
                          f"--cp-comm-type mesh, got {args.context_parallel_algo}")


def load_prompts(gen: GenerateConfig, tokenizer: Any, vocab: int,
                 max_positions: int) -> list[list[int]]:
    """The prompts' token ids (the ids file's first, then the text file's lines), each
    checked: not empty, ids in 0 .. vocab - 1, prompt plus new tokens within max_positions."""
    prompts: list[tuple[str, list[int]]] = []
    if gen.prompt_ids_file is not None:
        prompts += _id_prompts(gen.prompt_ids_file)
    if gen.prompts_file is not None:
        try:
            with open(gen.prompts_file, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except UnicodeDecodeError as e:
            raise ConfigError(f"--prompts-file {gen.prompts_file}: not UTF-8 text (byte "
                              f"{e.start}: {e.reason}); save it as UTF-8") from None
        except OSError as e:
            raise ConfigError(f"--prompts-file {gen.prompts_file}: cannot be read ({e})") from None
        if not lines:
            raise ConfigError(f"--prompts-file {gen.prompts_file}: no prompt in it")
        for i, line in enumerate(lines):
            where = f"--prompts-file {gen.prompts_file} line {i + 1}"
            if not line.strip():
                raise ConfigError(f"{where}: the prompt is empty")
            try:
                ids = [int(t) for t in tokenizer.tokenize(line)]
            except (ValueError, TypeError) as e:
                raise ConfigError(f"{where}: the tokenizer cannot read it ({e})") from None
            prompts.append((where, ids))
    for where, ids in prompts:
        if not ids:
            raise ConfigError(f"{where}: the prompt is empty")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ConfigError(f"{where}: token id {bad[0]} is outside the vocabulary "
                              f"(valid ids 0 .. {vocab - 1})")
        if len(ids) + gen.max_new_tokens > max_positions:
            raise ConfigError(f"{where}: {len(ids)} prompt tokens + --max-new-tokens "
                              f"{gen.max_new_tokens} exceed --max-position-embeddings "
                              f"{max_positions} (the cache holds at most that many positions)")
    return [ids for _, ids in prompts]


def _id_prompts(path: str) -> list[tuple[str, list[int]]]:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--prompt-ids-file {path}: not JSON ({e})") from None
    if not isinstance(data, list) or not data or not all(isinstance(p, list) for p in data):
        raise ConfigError(f"--prompt-ids-file {path}: expected a non-empty JSON list of "
                          "token-id lists, e.g. [[1, 2, 3], [4, 5]]")
    out = []
    for i, ids in enumerate(data):
        where = f"--prompt-ids-file {path} prompt {i}"
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ConfigError(f"{where}: token ids must be integers, got {ids[:8]}")
        out.append((where, ids))
    return out
