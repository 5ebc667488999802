"""The generate command (`python -m megatron_mesh.generate`): every check first (flags,
prompts, the checkpoint's model), each failing one printed once as one line with exit 2,
then the job on the CP group.
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Sequence

from megatron_mesh.training.job.console import error, flag_error, log_to_stdout, missing_extra

if TYPE_CHECKING:
    from megatron_mesh.inference.megatron.arguments import GenerateConfig
    from megatron_mesh.training.config.training_config import TrainingConfig

PROG = "generate"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        from megatron_mesh.inference.megatron.arguments import generate_parser
        from megatron_mesh.training.checkpoints.checksums import CheckpointError
        from megatron_mesh.training.config.arguments import ConfigError
    except ModuleNotFoundError as e:  # --help too: the model flags are megatron-core's
        if not missing_extra(PROG, e):
            raise
        return 2
    if "-h" in argv or "--help" in argv:
        generate_parser().print_help()
        print("\nmodel flags: those of python -m megatron_mesh.pretrain_gpt --help")
        return 0
    log_to_stdout()

    try:
        checked = _check(argv)
    except (ConfigError, CheckpointError) as e:  # the same on every rank: printed once
        flag_error(PROG, str(e))
        return 2
    try:
        return _run(*checked)
    except (ConfigError, CheckpointError) as e:
        error(PROG, str(e))
        return 2


def _check(argv: list[str]) -> tuple[GenerateConfig, TrainingConfig, Any, list[list[int]]]:
    """(generation flags, model flags, tokenizer, prompts), each checked from the command
    line and the checkpoint's files alone, before any collective: ConfigError or
    CheckpointError, the same on every rank."""
    import os

    from megatron_mesh.inference.megatron.arguments import load_prompts, parse_generate
    from megatron_mesh.inference.megatron.checkpoint import (
        check_tensor_files,
        check_vocabulary,
        unrecorded_warning,
    )
    from megatron_mesh.training.data.datasets import build_tokenizer
    from megatron_mesh.training.model.gpt import padded_vocab_size

    gen, args = parse_generate(argv)
    tokenizer = build_tokenizer(args)
    prompts = load_prompts(gen, tokenizer, tokenizer.vocab_size, args.max_position_embeddings)
    path = gen.checkpoint
    check_vocabulary(path, padded_vocab_size(tokenizer.vocab_size, args), args.hidden_size)
    check_tensor_files(path)
    if gen.unrecorded and os.environ.get("RANK", "0") == "0":
        print(unrecorded_warning(path, list(gen.unrecorded), args), flush=True)
    return gen, args, tokenizer, prompts


def _run(gen: GenerateConfig, args: TrainingConfig, tokenizer: Any,
         prompts: list[list[int]]) -> int:
    """The job: the process groups, the model, its weights checked and loaded, generation."""
    import torch.distributed as dist

    from megatron_mesh.inference.megatron.checkpoint import check_weights, load_weights
    from megatron_mesh.inference.megatron.generation import (
        build_generation_model,
        continuation_lines,
        generate,
        write_output,
    )
    from megatron_mesh.layer_plan import shape_text
    from megatron_mesh.megatron.cpu import megatron_on_cpu
    from megatron_mesh.training.checkpoints.checksums import CheckpointError
    from megatron_mesh.training.job import distributed

    path = gen.checkpoint
    with megatron_on_cpu():
        distributed.init_distributed(args)
        try:
            distributed.init_model_parallel(args)
            distributed.set_seed(args.seed)
            model = build_generation_model(args, tokenizer.vocab_size)
            try:  # the same verdict on every rank: printed once
                check_weights(path, model)  # before the load, from the files alone
                load_weights(path, model)
            except CheckpointError as e:
                flag_error(PROG, str(e))
                return 2
            distributed.print_rank0(f" loaded weights of {path}; generating for "
                                    f"{len(prompts)} prompts on CP {args.context_parallel_size}"
                                    + (f" (mesh {shape_text(*args.mesh_shape)})"
                                       if args.context_parallel_size > 1 else ""))
            detokenize = _detokenizer(tokenizer)
            records = generate(args, gen, model, prompts, tokenizer.eod, tokenizer.vocab_size,
                               detokenize)
            if gen.output is None:  # the continuations on stdout, once
                distributed.print_rank0("\n".join(continuation_lines(records, detokenize)))
            write_output(gen.output, records)
            dist.barrier()
        finally:
            distributed.destroy()
    return 0


def _detokenizer(tokenizer):
    """The tokenizer's ids -> text, or None when it has none."""
    fn = getattr(tokenizer, "detokenize", None)
    if fn is None:
        return None

    def text(ids: list[int]) -> str | None:
        try:
            return fn(ids)
        except Exception:  # a tokenizer without text for these ids: the ids stand alone
            return None
    return text

