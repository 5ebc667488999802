"""The driver's packing of placed documents (training/data/document_ranks.py) and the deal of a global
batch's documents over DP x micro-batches (training/data/balance.py), on plain values."""
from __future__ import annotations

import torch

from megatron_mesh.masks.document_placement import document_work
from megatron_mesh.training.data.balance import deal_documents
from megatron_mesh.training.data.document_ranks import BALANCED, DocumentPacker


def _works(deal) -> list[int]:
    return [deal.work(b) for b in range(len(deal.bins))]


def test_deal_holds_every_document_once_and_evens_the_work() -> None:
    lengths = [60, 3, 5, 40, 7, 2, 33, 9, 11, 1, 50, 4, 6, 8, 20, 30]
    deal = deal_documents(lengths, 4)
    assert sorted(i for b in deal.bins for i in b) == list(range(len(lengths)))
    assert all(list(b) == sorted(b) for b in deal.bins)  # batch order inside a bin
    assert deal == deal_documents(list(lengths), 4)  # a function of the lengths
    works = _works(deal)
    as_read = [sum(document_work(n) for n in lengths[i:i + 4]) for i in range(0, 16, 4)]
    assert max(works) < max(as_read)
    heaviest = max(document_work(n) for n in lengths)  # the 60-token document, alone
    assert max(works) == heaviest, works
    room = 1.25 * sum(lengths) / 4
    assert all(sum(lengths[i] for i in b) <= room or len(b) == 1 for b in deal.bins)


def test_deal_with_more_bins_than_documents_leaves_bins_empty() -> None:
    deal = deal_documents([10, 20], 4)
    assert sorted(len(b) for b in deal.bins) == [0, 0, 1, 1]


def test_packer_places_documents_and_pads_an_empty_micro_batch() -> None:
    packer = DocumentPacker(BALANCED, 2, 1, 1, None)
    tokens = torch.arange(1, 11)
    out = packer.pack_flat({"tokens": tokens, "loss_mask": torch.ones(10)}, [3, 7])
    placement = out["packed_seq_params"].placement
    assert placement.lengths == (3, 7, 2)  # a padding document to a multiple of 2 x CP
    assert out["tokens"].shape == (1, 6)
    padded = torch.cat([tokens, torch.zeros(2, dtype=tokens.dtype)])
    assert torch.equal(out["tokens"][0], padded[placement.token_indices(1)])
    mask = torch.cat([torch.ones(10), torch.zeros(2)])[placement.token_indices(1)]
    assert torch.equal(out["loss_mask"][0], mask)
    empty = packer.pack_flat({"tokens": tokens[:0], "loss_mask": torch.ones(0)}, [])
    assert empty["packed_seq_params"].placement.lengths == (4,)
    assert not empty["loss_mask"].any()


def test_cp_ranks_per_node_from_torchrun(monkeypatch) -> None:
    from types import SimpleNamespace

    from megatron_mesh.training.data.document_ranks import BALANCED, document_packer

    def cp_ranks_per_node(tp: int, cp: int) -> int | None:  # what the packer is given
        args = SimpleNamespace(tensor_model_parallel_size=tp, context_parallel_size=cp,
                               mesh_document_placement=BALANCED, sequence_parallel=False)
        return document_packer(args, 0).gpus_per_node

    monkeypatch.delenv("SLURM_NTASKS_PER_NODE", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert cp_ranks_per_node(tp=2, cp=8) == 4  # ranks TP fastest: 4 CP ranks per node
    assert cp_ranks_per_node(tp=2, cp=4) is None  # the CP group fits one node
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "9")
    assert cp_ranks_per_node(tp=3, cp=8) is None  # 3 CP ranks a node do not divide CP 8
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert cp_ranks_per_node(tp=1, cp=8) is None  # unknown
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "4")
    assert cp_ranks_per_node(tp=1, cp=8) == 4  # Slurm's count, as the grid reads it
