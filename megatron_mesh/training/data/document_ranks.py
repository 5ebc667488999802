"""--reset-attention-mask's packed documents over the CP ranks: which layout, and packing.

`--mesh-document-placement balanced` (the default with --context-parallel-algo mesh): each
micro-batch's documents are placed by `place_documents` (whole documents on one rank, long
ones zigzag over consecutive ranks, T / P tokens per rank, no padding per document), and
tokens, labels, loss mask and position ids are permuted by the same
`placement.token_indices(cp_rank)`; every layer gets a `PlacedSeqParams` (loss and RoPE
unchanged: RoPE rotates each row at its position in its document, `megatron/placed_documents.py`).
Only the rows of documents that span ranks travel in attention.

`--mesh-document-placement te`: Transformer Engine's THD layout (`packing.py`: every
document padded to 2P and cut into 2P pieces over all ranks): what Transformer Engine's CP
algorithms take, and what Megatron-LM data paths that partition with TE produce.

At CP = 1 both are the documents in order (`packing.py` with P = 1). The choice is made
once (`resolve_placement_args`) and held by the run's `DocumentPacker`. Both pad (te each
document, balanced the total, to a multiple of 2P, or 2P x TP under sequence parallelism);
with a mixture of experts the packed micro-batch carries the padding mask megatron-core's
routers take, so that the load-balancing loss counts the documents' tokens only.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable

import torch

from megatron_mesh.masks.document_placer import place_documents
from megatron_mesh.megatron.arguments import is_mesh
from megatron_mesh.megatron.placed_documents import placed_seq_params
from megatron_mesh.megatron.shape import cp_ranks_per_node
from megatron_mesh.training.data.packing import document_lengths, pack_documents
from megatron_mesh.training.model.moe import balancing_per_micro_batch

PLACEMENTS = ("balanced", "te")
BALANCED, TE = PLACEMENTS


def add_placement_args(parser: argparse.ArgumentParser) -> None:
    """--mesh-document-placement and --mesh-balance-data-parallel."""
    g = parser.add_argument_group("packed documents (--reset-attention-mask)")
    g.add_argument("--mesh-document-placement", default=None, choices=PLACEMENTS,
                   help="how a micro-batch's documents lie on the CP ranks: balanced = "
                        "place_documents (whole documents per rank, long ones zigzag over "
                        "consecutive ranks; only split documents' rows travel), te = "
                        "Transformer Engine's THD layout (every document cut over all "
                        "ranks). Default: balanced with --context-parallel-algo mesh (or CP = 1), "
                        "te with Transformer Engine's CP algorithms (they take only that)")
    g.add_argument("--mesh-balance-data-parallel", default=None,
                   action=argparse.BooleanOptionalAction,
                   help="regroup the documents of each global batch into the micro-batches "
                        "of all DP replicas by their attention work (L^2), so each replica's "
                        "work is balanced too; needs --calculate-per-token-loss (the loss and "
                        "gradients are then those of the ungrouped batch). Not with a mixture "
                        "of experts' load-balancing loss or sinkhorn routing (computed per "
                        "micro-batch). Default: on with --mesh-document-placement balanced, "
                        "DP > 1 and --calculate-per-token-loss (off where refused)")


def resolve_placement_args(args: argparse.Namespace, fail: Callable[[str], None]) -> None:
    """Decide args.mesh_document_placement and args.mesh_balance_data_parallel once
    (`fail(message)` raises the driver's ConfigError)."""
    cp = args.context_parallel_size
    mesh = is_mesh(args.context_parallel_algo)
    asked = args.mesh_document_placement
    if asked is not None and not args.reset_attention_mask:
        fail(f"--mesh-document-placement {asked} needs --reset-attention-mask: it lays out "
             "packed documents, and without --reset-attention-mask attention is causal over "
             "whole sequences (no documents to place); add --reset-attention-mask, or drop "
             "--mesh-document-placement")
    if asked == BALANCED and cp > 1 and not mesh:
        fail(f"--mesh-document-placement balanced with --context-parallel-algo "
             f"{args.context_parallel_algo}: Transformer Engine's CP attention takes only its "
             "THD layout; use --mesh-document-placement te, or --context-parallel-algo mesh")
    if asked is None:  # at CP = 1 both are the documents in order
        asked = BALANCED if mesh or cp == 1 else TE
    args.mesh_document_placement = asked
    balance = args.mesh_balance_data_parallel
    placed = args.reset_attention_mask and asked == BALANCED
    if balance and not placed:
        fail("--mesh-balance-data-parallel needs --reset-attention-mask with "
             "--mesh-document-placement balanced (it regroups whole documents)")
    if balance and not args.calculate_per_token_loss:
        fail("--mesh-balance-data-parallel needs --calculate-per-token-loss: regrouping "
             "documents keeps the sum of token losses, not the mean of micro-batch means")
    moe = balancing_per_micro_batch(args)
    if balance and moe:
        fail(f"--mesh-balance-data-parallel with --num-experts: {moe}, so regrouping the "
             "documents would change the loss and its gradients; use "
             "--no-mesh-balance-data-parallel")
    ramp = getattr(args, "rampup_batch_size", None)
    if balance and ramp:
        fail("--mesh-balance-data-parallel with --rampup-batch-size: the balance deals "
             "documents over the full global batch, while a ramp step runs fewer "
             "micro-batches (and a resume mid-ramp would regroup differently); use "
             "--no-mesh-balance-data-parallel")
    builder = getattr(args, "mesh_mask_builder", None)  # it masks each sample's positions
    if balance is None:  # off by default during a batch-size ramp, for MoE and a mask builder
        balance = bool(placed and args.calculate_per_token_loss
                       and args.data_parallel_size > 1 and not ramp and not moe
                       and builder is None)
    args.mesh_balance_data_parallel = balance


def uses_placement(args) -> bool:
    """Whether micro-batches carry a placement (balanced documents at CP > 1)."""
    return (args.reset_attention_mask and args.context_parallel_size > 1
            and args.mesh_document_placement == BALANCED)


def placement_label(args) -> str:
    """The banner's line on packed documents ('' without --reset-attention-mask)."""
    if not args.reset_attention_mask:
        return ""
    if args.context_parallel_size == 1:
        layout = "documents in order (CP = 1)"
    elif uses_placement(args):
        layout = "balanced (place_documents: whole documents per CP rank, long ones zigzag)"
    else:
        layout = "te (Transformer Engine's THD layout: every document over all CP ranks)"
    dp = "on" if args.mesh_balance_data_parallel else "off"
    return (f"packed documents: placement {layout} | DP x CP balance of the global batch "
            f"{dp}")


@dataclass(frozen=True)
class DocumentPacker:
    """One CP rank's packing of micro-batches of documents (decided once per run). With
    `padding_mask` (a mixture of experts) each packed micro-batch also holds 'padding_mask',
    bool [1, T / P], True where the packing added a padding token: megatron-core's routers
    leave those out of the load-balancing loss, which would otherwise count them (how many
    there are depends on CP, TP and the placement)."""

    placement: str  # BALANCED or TE
    cp_size: int
    cp_rank: int
    multiple: int  # the packed total is a multiple of multiple x 2P (TP under SP)
    gpus_per_node: int | None
    padding_mask: bool = False

    def __call__(self, batch: dict[str, torch.Tensor], eod: int,
                 lengths: list[int] | None = None) -> dict:
        """This rank's share of a micro-batch of [b, s] tensors (documents end after EOD;
        `lengths`: the documents when the caller read them, on the host, before the batch
        went to the device: reading them from device tokens waits for the device)."""
        if lengths is None:
            lengths = document_lengths(batch["tokens"], eod)
        batch = self._with_real(batch)
        if self.placement == TE or self.cp_size == 1:
            return self._padding(pack_documents(batch, eod, self.cp_size, self.cp_rank,
                                                self.multiple, lengths=lengths))
        flat = {k: v.reshape(-1) for k, v in batch.items()}
        return self.place(flat, lengths)

    def pack_flat(self, flat: dict[str, torch.Tensor], lengths: list[int]) -> dict:
        """This rank's share of one packed sequence: fields [n], documents of `lengths` in
        order (no documents: one padding document)."""
        flat = self._with_real(flat)
        if not lengths:
            unit = 2 * self.cp_size * self.multiple
            flat = {k: v.new_zeros(unit) for k, v in flat.items()}
            lengths = [unit]
        if self.placement == TE or self.cp_size == 1:
            batch = {k: v.unsqueeze(0) for k, v in flat.items()}
            return self._padding(pack_documents(batch, -1, self.cp_size, self.cp_rank,
                                                self.multiple, lengths=lengths))
        return self.place(flat, lengths)

    def place(self, flat: dict[str, torch.Tensor], lengths: list[int]) -> dict:
        """Fields of one packed sequence ([n] each, documents of `lengths` in order) placed
        over the CP ranks: this rank's [1, T / P] of each, plus 'packed_seq_params'. The
        total is rounded up to multiple x 2P by one padding document (zeros: token 0,
        position 0, loss mask 0)."""
        extra = -sum(lengths) % (2 * self.cp_size * self.multiple)
        if extra:
            lengths = [*lengths, extra]
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        placement = place_documents(cu, self.cp_size, self.gpus_per_node)
        device = flat["tokens"].device if "tokens" in flat else next(iter(flat.values())).device
        index = placement.token_indices(self.cp_rank).to(device)
        out = {}
        for key, value in flat.items():
            if extra:
                value = torch.cat([value, value.new_zeros(extra)])
            out[key] = value.index_select(0, index).unsqueeze(0)
        out["packed_seq_params"] = placed_seq_params(placement, self.cp_rank, device)
        return self._padding(out)

    def _with_real(self, fields: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`fields` plus, with `padding_mask`, a field of True per token: packed with the
        others, it is False exactly where the packing adds padding."""
        if not self.padding_mask:
            return fields
        like = fields["tokens"] if "tokens" in fields else next(iter(fields.values()))
        return {**fields, _REAL: torch.ones_like(like, dtype=torch.bool)}

    def _padding(self, packed: dict) -> dict:
        if _REAL in packed:
            packed["padding_mask"] = ~packed.pop(_REAL)
        return packed


_REAL = "_real_token"  # the packers' own field, turned into 'padding_mask'


def document_packer(args, cp_rank: int) -> DocumentPacker:
    """The run's packer: its placement, CP rank, SP multiple, CP ranks per node, and a
    padding mask for the routers of a mixture of experts."""
    tp, cp = args.tensor_model_parallel_size, args.context_parallel_size
    per_node = cp_ranks_per_node(tp)  # the launcher's, as the grid reads it
    if per_node is not None and not (per_node < cp and cp % per_node == 0):
        per_node = None  # the CP group fits one node, or nodes do not split it evenly
    return DocumentPacker(args.mesh_document_placement, cp, cp_rank,
                          tp if args.sequence_parallel else 1, per_node,
                          padding_mask=getattr(args, "num_experts", None) is not None)
