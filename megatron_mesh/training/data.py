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

from megatron_mesh.megatron.compat import get_batch_on_this_cp_rank, null_tokenizer_library
from megatron_mesh.training.device import device
from megatron_mesh.training.packing import pack_documents
from megatron_mesh.training.pipeline import batch_keys

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
    """megatron-core's tokenizer for --tokenizer-type (NullTokenizer: ids are tokens)."""
    metadata = {"library": _LIBRARIES[args.tokenizer_type] or null_tokenizer_library()}
    if args.tokenizer_type == "NullTokenizer":
        return MegatronTokenizer.from_pretrained(metadata_path=metadata, vocab_size=args.vocab_size)
    if args.tokenizer_type == "GPT2BPETokenizer":
        return MegatronTokenizer.from_pretrained(
            tokenizer_path="GPT2BPETokenizer", metadata_path=metadata,
            vocab_file=args.vocab_file, merges_file=args.merge_file)
    return MegatronTokenizer.from_pretrained(tokenizer_path=args.tokenizer_model,
                                             metadata_path=metadata)


def build_train_dataset(args: TrainingConfig, tokenizer: MegatronTokenizerBase) -> GPTDataset:
    """The training split: GPTDataset over --data-path, or MockGPTDataset without one."""
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=None if args.mock_data else get_blend_from_list(args.data_path),
        split=None if args.mock_data else args.split,
        path_to_cache=args.data_cache_path,
        tokenizer=tokenizer,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=False,  # attention is causal by type; no [s, s] mask tensor
    )
    num_samples = args.train_iters * args.global_batch_size
    cls = MockGPTDataset if args.mock_data else GPTDataset
    train, _, _ = BlendedMegatronDatasetBuilder(
        cls, [num_samples, None, None], lambda: True, config).build()
    if train is None or len(train) < num_samples:
        raise RuntimeError(f"training data holds {0 if train is None else len(train)} samples of "
                           f"{args.seq_length} tokens; {num_samples} are needed")
    return train


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
