"""Training data: tokenizer, megatron-core GPT datasets, and this rank's micro-batches.

Sample order is a pure function of the sample index, so the data position of a run is just
the number of samples consumed; a resumed run starts its iterator there.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

import torch
from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.utils import get_blend_from_list
from megatron.core.tokenizers import MegatronTokenizer, MegatronTokenizerBase

from megatron_mesh.megatron.compat import (
    get_batch_on_this_cp_rank,
    null_tokenizer_library,
    null_tokenizer_options,
)
from megatron_mesh.training.device import device
from megatron_mesh.training.packing import pack_documents
from megatron_mesh.training.pipeline import batch_keys
from megatron_mesh.training.validation import split_weights

if TYPE_CHECKING:
    from megatron_mesh.training.arguments import TrainingConfig

_LIBRARIES = {
    "NullTokenizer": None,  # megatron-core's name for it changed: compat
    "HuggingFaceTokenizer": "huggingface",
    "GPT2BPETokenizer": "megatron",
    "SentencePieceTokenizer": "sentencepiece",
    "TikTokenizer": "tiktoken",
}


def build_tokenizer(args: TrainingConfig) -> MegatronTokenizerBase:
    """megatron-core's tokenizer for --tokenizer-type (NullTokenizer: ids are tokens, ids
    0 .. V - 1 of --vocab-size V and the end-of-document id V)."""
    metadata = {"library": _LIBRARIES[args.tokenizer_type] or null_tokenizer_library()}
    if args.tokenizer_type == "NullTokenizer":
        return MegatronTokenizer.from_pretrained(metadata_path=metadata,
                                                 **null_tokenizer_options(args.vocab_size))
    if args.tokenizer_type == "GPT2BPETokenizer":
        return MegatronTokenizer.from_pretrained(
            tokenizer_path="GPT2BPETokenizer", metadata_path=metadata,
            vocab_file=args.vocab_file, merges_file=args.merge_file)
    return MegatronTokenizer.from_pretrained(tokenizer_path=args.tokenizer_model,
                                             metadata_path=metadata)


def _dataset_config(args: TrainingConfig, tokenizer: MegatronTokenizerBase) -> GPTDatasetConfig:
    """The GPT dataset config of all three splits: --data-path cut by --split, or the
    per-split paths, or (neither) mock data."""
    per_split = [args.train_data_path, args.valid_data_path, args.test_data_path]
    use_split_paths = not args.mock_data and not args.data_path
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=None if args.mock_data or use_split_paths else get_blend_from_list(args.data_path),
        blend_per_split=[get_blend_from_list(p) if p else None for p in per_split]
        if use_split_paths else None,
        split=None if args.mock_data or use_split_paths else args.split,
        path_to_cache=args.data_cache_path,
        tokenizer=tokenizer,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=False,  # attention is causal by type; no [s, s] mask tensor
    )


def evaluations_in_run(args: TrainingConfig) -> int:
    """Validation passes a run makes: one per --eval-interval iterations and one at the end
    (each --eval-iters global batches); the validation set holds that many batches."""
    return (0 if args.skip_train else args.train_iters // args.eval_interval) + 1


def _split_weights(args: TrainingConfig) -> list[float]:
    """(train, valid, test) share of the data: --split's, or 1 where a per-split path or
    mock data gives that split."""
    if args.mock_data:
        return [1.0, 1.0, 1.0]
    if not args.data_path:
        paths = (args.train_data_path, args.valid_data_path, args.test_data_path)
        return [1.0 if p else 0.0 for p in paths]
    return split_weights(args.split)


def build_datasets(args: TrainingConfig, tokenizer: MegatronTokenizerBase
                   ) -> tuple[GPTDataset | None, GPTDataset | None, GPTDataset | None]:
    """(train, valid, test) GPTDatasets (MockGPTDataset without data paths): the training
    set with --train-iters global batches (none with --skip-train), the validation set with
    `evaluations_in_run` x --eval-iters batches and the test set with --eval-iters batches;
    None for a split that --split / the paths leave empty or --eval-iters 0 does not use."""
    gbs = args.global_batch_size
    weights = _split_weights(args)
    wanted = [None if args.skip_train else args.train_iters * gbs,
              evaluations_in_run(args) * args.eval_iters * gbs,
              args.eval_iters * gbs]
    sizes = [n if n and w > 0 else None for n, w in zip(wanted, weights)]
    cls = MockGPTDataset if args.mock_data else GPTDataset
    datasets = BlendedMegatronDatasetBuilder(
        cls, sizes, lambda: True, _dataset_config(args, tokenizer)).build()
    for name, dataset, size in zip(("training", "validation", "test"), datasets, sizes):
        if size is not None and (dataset is None or len(dataset) < size):
            raise RuntimeError(f"{name} data holds {0 if dataset is None else len(dataset)} "
                               f"samples of {args.seq_length} tokens; {size} are needed")
    return tuple(datasets)


def micro_batches(dataset: GPTDataset, args: TrainingConfig,
                  consumed_samples: int) -> Iterator[dict[str, torch.Tensor]]:
    """This rank's micro-batches from ``consumed_samples`` on, already split for CP.

    Global batch k holds samples [k * GBS, (k + 1) * GBS); micro-batch m of data-parallel
    rank d takes the ``micro_batch_size`` samples from k * GBS + (m * DP + d) * mbs. All TP
    and CP ranks of a replica read the same samples; get_batch_on_this_cp_rank then keeps
    this CP rank's two zigzag chunks. Each pipeline stage gets only the fields it reads
    (`pipeline.batch_keys`); a middle stage reads no samples.
    """
    keys = batch_keys()
    mbs, dp = args.micro_batch_size, args.data_parallel_size
    dp_rank = parallel_state.get_data_parallel_rank()
    start = consumed_samples + dp_rank * mbs
    dev = device()
    cp_size, cp_rank = args.context_parallel_size, parallel_state.get_context_parallel_rank()
    sp_split = args.tensor_model_parallel_size if args.sequence_parallel else 1
    eod = dataset.config.tokenizer.eod
    while True:
        for m in range(args.num_microbatches):
            first = start + m * dp * mbs
            samples = [dataset[i] for i in range(first, first + mbs)] if keys else []
            batch = {k: torch.stack([torch.as_tensor(s[k]) for s in samples]).to(dev)
                     for k in keys}
            if args.reset_attention_mask:
                yield pack_documents(batch, eod, cp_size, cp_rank, sp_split)
            else:
                yield get_batch_on_this_cp_rank(batch)
        start += args.global_batch_size
