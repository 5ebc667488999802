"""Generate from a checkpoint of the pretraining driver, with mesh context parallelism.

    torchrun --nproc-per-node 4 -m megatron_mesh.generate --config configs/tiny-cpu.yaml \\
        --load ckpt --prompt-ids-file prompts.json --max-new-tokens 32 \\
        --context-parallel-size 4 --cp-comm-type mesh --mesh-shape 2x2 --output out.jsonl

Greedy unless --temperature / --top-k / --top-p; docs/inference.md describes the design.
The model flags left out are the checkpoint's. Bad input (flags, prompts, a model flag that
differs from the checkpoint's) exits 2 with one line, before any collective.
"""
from __future__ import annotations

import sys
import warnings
from typing import Sequence

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed")

PROG = "generate"


def _fail(message: str) -> int:
    sys.stderr.write(f"{PROG}: error: {message}\n")  # one write: ranks share one output
    sys.stderr.flush()
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        from megatron_mesh.training.generation_args import generate_parser

        generate_parser().print_help()
        print("\nmodel flags: those of python -m megatron_mesh.pretrain_gpt --help")
        return 0
    from megatron_mesh.pretrain_gpt import _log_to_stdout

    _log_to_stdout()
    from megatron_mesh.training.arguments import ConfigError
    from megatron_mesh.training.checksums import CheckpointError

    try:
        return _run(argv)
    except (ConfigError, CheckpointError) as e:
        return _fail(str(e))


def _run(argv: list[str]) -> int:
    """Everything checked first (flags, prompts, the checkpoint's model), then the job."""
    import os

    import torch.distributed as dist

    from megatron_mesh.layer_plan import shape_text
    from megatron_mesh.megatron.cpu import megatron_on_cpu
    from megatron_mesh.training import distributed
    from megatron_mesh.training.data import build_tokenizer
    from megatron_mesh.training.generation_args import load_prompts, parse_generate
    from megatron_mesh.training.generation_checkpoint import (
        check_vocabulary,
        unrecorded_warning,
    )
    from megatron_mesh.training.model import padded_vocab_size

    gen, args = parse_generate(argv)
    tokenizer = build_tokenizer(args)
    prompts = load_prompts(gen, tokenizer, tokenizer.vocab_size, args.max_position_embeddings)
    path = gen.checkpoint
    check_vocabulary(path, padded_vocab_size(tokenizer.vocab_size, args), args.hidden_size)
    if gen.unrecorded and os.environ.get("RANK", "0") == "0":
        print(unrecorded_warning(path, list(gen.unrecorded), args), flush=True)
    with megatron_on_cpu():
        distributed.init_distributed(args)
        try:
            from megatron_mesh.training.generation import (
                build_generation_model,
                generate,
                write_output,
            )
            from megatron_mesh.training.generation_checkpoint import check_weights, load_weights

            distributed.init_model_parallel(args)
            distributed.set_seed(args.seed)
            model = build_generation_model(args, tokenizer.vocab_size)
            check_weights(path, model)  # the same verdict on every rank, before the load
            load_weights(path, model)
            distributed.print_rank0(f" loaded weights of {path}; generating for "
                                    f"{len(prompts)} prompts on CP {args.context_parallel_size}"
                                    + (f" (mesh {shape_text(*args.mesh_shape)})"
                                       if args.context_parallel_size > 1 else ""))
            records = generate(args, gen, model, prompts, tokenizer.eod, tokenizer.vocab_size,
                               _detokenizer(tokenizer))
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


if __name__ == "__main__":
    sys.exit(main())
