"""Training data: tokenizer, megatron-core GPT datasets, and this rank's micro-batches.

Sample order is a pure function of the sample index, so the data position of a run is just
the number of samples consumed; a resumed run starts its iterator there. --num-workers N
reads the samples in N torch DataLoader worker processes, in the same order: the batches do
not depend on N.
"""
from __future__ import annotations

import argparse
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

import torch
from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.utils import get_blend_from_list
from megatron.core.tokenizers import MegatronTokenizer, MegatronTokenizerBase
from torch.utils.data import DataLoader, Sampler

from megatron_mesh.masks.slices import SliceMask
from megatron_mesh.megatron.compat import (
    get_batch_on_this_cp_rank,
    null_tokenizer_library,
    null_tokenizer_options,
)
from megatron_mesh.megatron.mask_builder import (
    agreed_mask,
    agreement_group,
    load_mask_builder,
    masked_seq_params,
    with_packed_mask,
)
from megatron_mesh.megatron.placed_documents import PlacedSeqParams
from megatron_mesh.training.config.input_checks import split_weights
from megatron_mesh.training.data.document_ranks import document_packer
from megatron_mesh.training.data.gpt2_bpe import gpt2_bpe_tokenizer
from megatron_mesh.training.data.packing import document_lengths, padded_lengths
from megatron_mesh.training.job.device import device, has_cuda
from megatron_mesh.training.model.pipeline import batch_keys

if TYPE_CHECKING:
    from megatron_mesh.training.config.training_config import TrainingConfig

_LIBRARIES = {
    "NullTokenizer": None,  # megatron-core's name for it changed: compat
    "HuggingFaceTokenizer": "huggingface",
    "GPT2BPETokenizer": "megatron",
    "SentencePieceTokenizer": "sentencepiece",
    "TikTokenizer": "tiktoken",
}


def build_tokenizer(args: TrainingConfig | argparse.Namespace) -> MegatronTokenizerBase:
    """megatron-core's tokenizer for --tokenizer-type (NullTokenizer: ids are tokens, ids
    0 .. V - 1 of --vocab-size V and the end-of-document id V; GPT2BPETokenizer: from
    --vocab-file and --merge-file alone, `gpt2_bpe`). Reads the flags by their flat names:
    the checks of the parsed flags and the dataset tool call it on a namespace."""
    metadata = {"library": _LIBRARIES[args.tokenizer_type] or null_tokenizer_library()}
    if args.tokenizer_type == "NullTokenizer":
        return MegatronTokenizer.from_pretrained(metadata_path=metadata,
                                                 **null_tokenizer_options(args.vocab_size))
    if args.tokenizer_type == "GPT2BPETokenizer":  # from the local files, no hub
        return gpt2_bpe_tokenizer(args.vocab_file, args.merge_file)
    return MegatronTokenizer.from_pretrained(tokenizer_path=args.tokenizer_model,
                                             metadata_path=metadata)


def _dataset_config(args: TrainingConfig, tokenizer: MegatronTokenizerBase) -> GPTDatasetConfig:
    """The GPT dataset config of all three splits: --data-path cut by --split, or the
    per-split paths, or (neither) mock data."""
    per_split = [args.data.train_data_path, args.data.valid_data_path, args.data.test_data_path]
    use_split_paths = not args.data.mock_data and not args.data.data_path
    return GPTDatasetConfig(
        random_seed=args.training.seed,
        sequence_length=args.training.seq_length,
        blend=None if args.data.mock_data or use_split_paths else get_blend_from_list(args.data.data_path),
        blend_per_split=[get_blend_from_list(p) if p else None for p in per_split]
        if use_split_paths else None,
        split=None if args.data.mock_data or use_split_paths else args.data.split,
        path_to_cache=args.data.data_cache_path,
        tokenizer=tokenizer,
        reset_position_ids=args.data.reset_position_ids,
        reset_attention_mask=args.data.reset_attention_mask,
        eod_mask_loss=args.data.eod_mask_loss,
        create_attention_mask=False,  # attention is causal by type; no [s, s] mask tensor
    )


def evaluations_in_run(args: TrainingConfig) -> int:
    """Validation passes a run makes: one per --eval-interval iterations and one at the end
    (each --eval-iters global batches); the validation set holds that many batches."""
    return (0 if args.training.skip_train else args.training.train_iters // args.evaluation.eval_interval) + 1


def _split_weights(args: TrainingConfig) -> list[float]:
    """(train, valid, test) share of the data: --split's, or 1 where a per-split path or
    mock data gives that split."""
    if args.data.mock_data:
        return [1.0, 1.0, 1.0]
    if not args.data.data_path:
        paths = (args.data.train_data_path, args.data.valid_data_path, args.data.test_data_path)
        return [1.0 if p else 0.0 for p in paths]
    return split_weights(args.data.split)


def build_datasets(args: TrainingConfig, tokenizer: MegatronTokenizerBase
                   ) -> tuple[GPTDataset | None, GPTDataset | None, GPTDataset | None]:
    """(train, valid, test) GPTDatasets (MockGPTDataset without data paths): the training
    set with --train-iters global batches (none with --skip-train), the validation set with
    `evaluations_in_run` x --eval-iters batches and the test set with --eval-iters batches;
    None for a split that --split / the paths leave empty or --eval-iters 0 does not use."""
    gbs = args.training.global_batch_size
    weights = _split_weights(args)
    wanted = [None if args.training.skip_train else args.training.train_iters * gbs,
              evaluations_in_run(args) * args.evaluation.eval_iters * gbs,
              args.evaluation.eval_iters * gbs]
    sizes = [n if n and w > 0 else None for n, w in zip(wanted, weights)]
    cls = MockGPTDataset if args.data.mock_data else GPTDataset
    datasets = BlendedMegatronDatasetBuilder(
        cls, sizes, lambda: True, _dataset_config(args, tokenizer)).build()
    for name, dataset, size in zip(("training", "validation", "test"), datasets, sizes):
        if size is not None and (dataset is None or len(dataset) < size):
            raise RuntimeError(f"{name} data holds {0 if dataset is None else len(dataset)} "
                               f"samples of {args.training.seq_length} tokens; {size} are needed")
    return tuple(datasets)


class SampleIndices(Sampler[int]):
    """The sample indices one data-parallel rank reads, in reading order: from global
    batch k = `first` / GBS on, micro-batch m of global batch k holds the ``mbs`` samples
    from k * GBS + (m * DP + d) * mbs (d: the data-parallel rank). Ends before the first
    micro-batch that does not fit in `total` samples, so no reader runs past the dataset.
    """

    def __init__(self, first: int, total: int, dp_rank: int, args: TrainingConfig) -> None:
        self.first, self.total, self.dp_rank = first, total, dp_rank
        self.mbs, self.dp = args.micro_batch_size, args.data_parallel_size  # flat names
        self.num_microbatches, self.gbs = args.num_microbatches, args.global_batch_size

    def __iter__(self) -> Iterator[int]:
        start = self.first + self.dp_rank * self.mbs
        while True:
            for m in range(self.num_microbatches):
                first = start + m * self.dp * self.mbs
                if first + self.mbs > self.total:
                    return
                yield from range(first, first + self.mbs)
            start += self.gbs


@dataclass(frozen=True)
class StackFields:
    """collate_fn: the samples' `keys` fields stacked into [mbs, s] tensors (runs in the
    loader's worker processes)."""

    keys: tuple[str, ...]

    def __call__(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        return {k: torch.stack([torch.as_tensor(s[k]) for s in samples]) for k in self.keys}


def sample_loader(dataset: GPTDataset, args: TrainingConfig, consumed_samples: int,
                  keys: tuple[str, ...]) -> DataLoader:
    """This rank's micro-batches of `keys` ([mbs, s] tensors, on the CPU) from
    ``consumed_samples`` on, read by --num-workers worker processes (0: in this process);
    pinned for the copy to the GPU where there is one."""
    sampler = SampleIndices(consumed_samples, len(dataset),
                            parallel_state.get_data_parallel_rank(), args)
    return DataLoader(dataset, batch_size=args.training.micro_batch_size, sampler=sampler,
                      num_workers=args.data.num_workers, collate_fn=StackFields(keys),
                      pin_memory=has_cuda())


def _with_documents_mask(packed: dict, mask: SliceMask, lengths: list[int],
                         cp_size: int, sample_len: int) -> None:
    """Give the packed micro-batch's params `mask` (over one sample's positions) laid on
    its documents, where the packer put them (placed back to back, or padded THD)."""
    params = packed["packed_seq_params"]
    total = packed["tokens"].shape[-1] * cp_size
    if isinstance(params, PlacedSeqParams):
        starts = params.placement.cu_seqlens
    else:
        starts = [0, *itertools.accumulate(padded_lengths(lengths, cp_size))]
    with_packed_mask(params, mask, sample_len, lengths, starts, total)


def micro_batches(dataset: GPTDataset, args: TrainingConfig,
                  consumed_samples: int) -> Iterator[dict[str, torch.Tensor]]:
    """This rank's micro-batches from ``consumed_samples`` on, already split for CP.

    The samples are those of `SampleIndices`, read by `sample_loader` (--num-workers
    processes or this one; the same batches either way). All TP and CP ranks of a replica
    read the same samples; get_batch_on_this_cp_rank then keeps this CP rank's two zigzag
    chunks (--reset-attention-mask: `placement.DocumentPacker` its share of the packed
    documents, placed as --mesh-document-placement says). With --mesh-mask-builder each
    micro-batch also brings the mask the builder makes of its whole sequence, on every rank
    (`mask_builder.MaskedSeqParams`; with packed documents laid on each document,
    `mask_builder.with_packed_mask`); the data- and context-parallel ranks agree on every
    build before going on, so a builder that fails on one replica's samples stops every
    rank with its message (`mask_builder.agreed_mask`).
    Each pipeline stage gets only the fields it reads (`pipeline.batch_keys`); a middle
    stage reads no samples (with --reset-attention-mask their token ids, for the
    documents).
    """
    keys = batch_keys(args.data.reset_attention_mask, args.masks.mesh_mask_builder is not None)
    if not keys:
        while True:
            yield get_batch_on_this_cp_rank({})
    dev = device()
    cp_rank = parallel_state.get_context_parallel_rank()
    eod = dataset.config.tokenizer.eod
    pack = document_packer(args, cp_rank)  # --mesh-document-placement's layout
    if args.packing.mesh_balance_data_parallel:  # documents regrouped over DP x micro-batches
        from megatron_mesh.training.data.balance import balanced_micro_batches

        yield from balanced_micro_batches(dataset, args, consumed_samples, StackFields(keys),
                                          pack, eod, dev)
        return
    spec = args.mesh_mask_builder
    builder = None if spec is None else load_mask_builder(spec)
    agreeing = None if spec is None else agreement_group()
    for cpu_batch in sample_loader(dataset, args, consumed_samples, keys):
        batch = {k: v.to(dev) for k, v in cpu_batch.items()}
        if args.data.reset_attention_mask:  # documents read on the host: no wait for the device
            lengths = document_lengths(cpu_batch["tokens"], eod)
            packed = pack(batch, eod, lengths)
            if builder is not None:  # laid on the documents, on the host
                mask = agreed_mask(builder, spec, cpu_batch["tokens"],
                                   cpu_batch["position_ids"], agreeing)
                _with_documents_mask(packed, mask, lengths, args.context_parallel_size,
                                     cpu_batch["tokens"].shape[-1])
            yield packed
            continue
        mine = get_batch_on_this_cp_rank(batch)
        if builder is not None:  # from the whole sequence, on the host: the same on every rank
            mine["packed_seq_params"] = masked_seq_params(agreed_mask(
                builder, spec, cpu_batch["tokens"], cpu_batch["position_ids"], agreeing))
        yield mine
