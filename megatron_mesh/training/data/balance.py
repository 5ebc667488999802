"""--mesh-balance-data-parallel: the documents of a global batch regrouped over DP x micro-batches.

Without it, DP replica d's micro-batch m holds the samples from k * GBS + (m * DP + d) * mbs
(`data.SampleIndices`), so one replica may get the long documents and do far more attention
work (a document of L tokens costs L (L + 1) / 2 causal pairs) while the others wait for it
at the gradient reduction. With it, every rank reads the whole global batch, cuts it into
its documents (a document ends after an EOD token and at the end of its sample, as
`packing.document_lengths` cuts them: the same documents as without it) and deals the
documents, heaviest first, into the DP x M bins (bin m * DP + d: micro-batch m of replica
d): each to the bin with the least work among those with room (at most 1.25 x the mean
tokens per bin; the least filled bin when none has room). A bin's documents, in their
order in the global batch, form one packed sequence that `placement.DocumentPacker` lays
over the CP ranks. Sample boundaries do not matter under --reset-attention-mask: attention
never crosses a document, each token keeps its label, loss mask and position id (reset
per document with --reset-position-ids), and with --calculate-per-token-loss the loss and
gradients are sums over the global batch's tokens divided by its token count, whatever
the grouping. The deal is a pure function of the document lengths (python ints), the same
on every rank and pipeline stage.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

import torch
from megatron.core import parallel_state
from torch.utils.data import DataLoader, Sampler

from megatron_mesh.masks.document_placement import document_work
from megatron_mesh.training.data.packing import document_lengths
from megatron_mesh.training.job.device import has_cuda
from megatron_mesh.training.job.distributed import print_rank0

if TYPE_CHECKING:
    from megatron_mesh.training.config.training_config import TrainingConfig
    from megatron_mesh.training.data.document_ranks import DocumentPacker

ROOM = 1.25  # a bin takes documents up to this many times the mean tokens per bin


@dataclass(frozen=True)
class Deal:
    """Documents of a global batch dealt into bins: `bins[b]` are document indices (in
    global-batch order) of bin b = m * DP + d."""

    lengths: tuple[int, ...]
    bins: tuple[tuple[int, ...], ...]

    def work(self, b: int) -> int:
        return sum(document_work(self.lengths[i]) for i in self.bins[b])


def deal_documents(lengths: list[int], bins: int) -> Deal:
    """Heaviest documents first, each to the least-worked bin with room (module docstring)."""
    room = ROOM * sum(lengths) / bins
    tokens, work = [0] * bins, [0] * bins
    members: list[list[int]] = [[] for _ in range(bins)]
    heap = [(0, 0, b) for b in range(bins)]  # (work, tokens, bin), lazily refreshed
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    for i in order:
        n = lengths[i]
        skipped, chosen = [], None
        while heap:
            entry = heapq.heappop(heap)
            w, t, b = entry
            if (w, t) != (work[b], tokens[b]):
                continue  # stale
            if t + n <= room or t == 0:
                chosen = b
                break
            skipped.append(entry)
        if chosen is None:  # no bin has room: the least filled one
            chosen = min(range(bins), key=lambda b: (tokens[b], work[b], b))
        for entry in skipped:
            heapq.heappush(heap, entry)
        members[chosen].append(i)
        tokens[chosen] += n
        work[chosen] += document_work(n)
        heapq.heappush(heap, (work[chosen], tokens[chosen], chosen))
    return Deal(tuple(lengths), tuple(tuple(sorted(m)) for m in members))


class GlobalBatchIndices(Sampler[int]):
    """Every sample index of each global batch from `first` on (the whole batch, on every
    rank); ends before a global batch that does not fit in `total` samples."""

    def __init__(self, first: int, total: int, gbs: int) -> None:
        self.first, self.total, self.gbs = first, total, gbs

    def __iter__(self) -> Iterator[int]:
        start = self.first
        while start + self.gbs <= self.total:
            yield from range(start, start + self.gbs)
            start += self.gbs


def replica_works(lengths_per_sample: list[list[int]], args: TrainingConfig) -> list[int]:
    """Attention work of each DP replica without regrouping (sample j of the global batch
    belongs to replica (j // mbs) % DP)."""
    works = [0] * args.derived.data_parallel_size
    for j, lengths in enumerate(lengths_per_sample):
        works[(j // args.training.micro_batch_size) % args.derived.data_parallel_size] += sum(
            document_work(n) for n in lengths)
    return works


def _ratio(works: list[int]) -> float:
    mean = sum(works) / len(works)
    return max(works) / mean if mean else 1.0


def balanced_micro_batches(dataset, args: TrainingConfig, consumed_samples: int,
                           collate: Callable, pack: DocumentPacker, eod: int,
                           dev: torch.device) -> Iterator[dict]:
    """This rank's micro-batches with the global batch's documents dealt over DP x M
    (`collate`: the samples' fields stacked into [GBS, s] tensors)."""
    dp, dp_rank = args.derived.data_parallel_size, parallel_state.get_data_parallel_rank()
    m_count = args.derived.num_microbatches
    sampler = GlobalBatchIndices(consumed_samples, len(dataset), args.training.global_batch_size)
    loader = DataLoader(dataset, batch_size=args.training.global_batch_size, sampler=sampler,
                        num_workers=args.data.num_workers, collate_fn=collate,
                        pin_memory=has_cuda())
    logged = False
    for batch in loader:  # the whole global batch stays on the CPU; micro-batches move
        per_sample = [document_lengths(s.unsqueeze(0), eod) for s in batch["tokens"]]
        lengths = [n for sample in per_sample for n in sample]
        deal = deal_documents(lengths, dp * m_count)
        if not logged:
            after = [sum(deal.work(m * dp + d) for m in range(m_count)) for d in range(dp)]
            print_rank0(f" DP x CP balance, first global batch: attention work of the busiest "
                        f"DP replica / mean {_ratio(replica_works(per_sample, args)):.3f} as "
                        f"read, {_ratio(after):.3f} with documents regrouped")
            logged = True
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + n)
        flat = {k: v.reshape(-1) for k, v in batch.items()}
        for m in range(m_count):
            docs = deal.bins[m * dp + dp_rank]
            pieces = {k: [v[starts[i]:starts[i + 1]] for i in docs] for k, v in flat.items()}
            fields = {k: (torch.cat(p) if p else v[:0]).to(dev) for (k, p), v in
                      zip(pieces.items(), flat.values())}
            yield pack.pack_flat(fields, [lengths[i] for i in docs])
