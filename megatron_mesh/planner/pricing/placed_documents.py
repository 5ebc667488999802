"""Packed documents placed whole on ranks (`megatron_mesh.place_documents`), priced beside
Transformer Engine's THD layout.

THD cuts every document into 2P pieces over all ranks: compute falls to the in-document
pairs, the bytes stay those of one sequence of the packed length (`search.plan` with
`doc_lengths`). The placement keeps a document whole on one rank, or zigzags a long one
over a few consecutive ranks; `mesh_attention(placement=...)` runs it through the sparse
exchange, so each rank receives of each peer only the rows of documents both hold.

Rows, in closed form from the placement's runs (`masked.placement_counts`, `_block_pairs`;
equal to `cost_models.sparse.placement_traffic`, which builds every block's rows,
tests/unit/test_planner_placed.py). On the mesh
placement (`placed.mesh_placement`: after a heads all-to-all mesh rank m holds CP ranks
mA .. mA+A-1's runs), a query run (d, p, n) of rank o and the key runs (d, k, m) of the
ranks Y of a column (causal: the key at position t is seen by queries at positions >= t):

    query rows of the run that Y's keys reach:  [max(p, min k), p + n) over k < p + n
    key rows of a key run (d, k, m) that X's queries reach:  [k, min(k + m, max(p + n)))
                                                             over p + n > k

(non-causal: the whole run when the other side holds any of the document); equal to the
generic counts from the mask's slices (`masked.mask_counts`), which price it
(`masked.mask_estimate`). Compute: the
busiest mesh rank's (query, key) pairs over its blocks (x in its row, y in its column), in
closed form per pair of runs. The floor: the busiest CP rank's in-document pairs
(`DocumentPlacement.works` for causal documents alone; under a window or slices, or not
causal, from the mask's slices, `rank_pairs`) at the GPU's rate (with a GPU profile: in one kernel call),
what no schedule can beat.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

from megatron_mesh.layer_plan import BACKWARD_FLOPS_RATIO, grid_shapes
from megatron_mesh.masks.document_placement import DocumentPlacement
from megatron_mesh.masks.document_placer import place_documents
from megatron_mesh.masks.mask import Mask, documents_mask
from megatron_mesh.planner.cost import Estimate
from megatron_mesh.planner.hardware import Cluster
from megatron_mesh.planner.methods.sparse import mask_estimate
from megatron_mesh.planner.pricing.masked import (  # noqa: F401 - the closed forms, named here too
    _block_pairs,
    _doc_runs,
    block_pair_counts,
    mesh_totals,
    pair_flops,
    placement_counts,
)
from megatron_mesh.planner.pricing.tiles import ring_calls
from megatron_mesh.planner.pricing.workload import Workload
from megatron_mesh.planner.search import Plan, grid_key, heads_sizes


def lognormal_lengths(seq_length: int, median: int, longest: int, seed: int = 0,
                      shortest: int = 1) -> tuple[int, ...]:
    """Document lengths drawn from a log-normal of the given median (sigma 1), rounded and
    clipped to [shortest, longest], until they fill `seq_length` (the last one cut to fit);
    deterministic from `seed`."""
    if not 1 <= shortest <= median <= longest:
        raise ValueError(f"log-normal lengths need 1 <= shortest ({shortest}) <= median "
                         f"({median}) <= longest ({longest})")
    rnd = random.Random(seed)
    out: list[int] = []
    left = seq_length
    while left > 0:
        n = min(longest, max(shortest, round(rnd.lognormvariate(math.log(median), 1.0))))
        out.append(min(n, left))
        left -= out[-1]
    return tuple(out)


def mesh_pairs(placement: DocumentPlacement, rows: int, cols: int, heads: int = 1,
               causal: bool = True) -> list[int]:
    """(query, key) pairs each mesh rank computes: its blocks (x, y), x in its row, y in
    its column, of the mesh placement (each pair of the layer once over the mesh)."""
    return mesh_totals(_block_pairs(placement, heads, causal), rows, cols)


def own_block_pairs(placement: DocumentPlacement, heads: int = 1, causal: bool = True
                    ) -> list[int]:
    """(query, key) pairs of each mesh rank's own block (x = y = the rank): what it
    computes while the sparse exchange's inbound rows travel."""
    block = _block_pairs(placement, heads, causal)
    return [block[m, m] for m in range(placement.cp_size // heads)]


@dataclass(frozen=True)
class PlacedPlan:
    """The placement of a plan's documents and its price on every mesh shape and grid."""

    placement: DocumentPlacement
    estimates: tuple[Estimate, ...]  # by mesh shape, then grids, as the THD table
    floor_s: dict[str, float]  # busiest CP rank's in-document FLOPs at the GPU's rate

    @property
    def best(self) -> Estimate:
        return min(self.estimates, key=grid_key)

    @property
    def floor_total_s(self) -> float:
        return self.floor_s["forward"] + self.floor_s["backward"]


def placed_mask(workload: Workload, placement: DocumentPlacement) -> Mask:
    """The workload's mask with its documents placed: the placement's, and its window and
    slices (over the same packed positions)."""
    return Mask(workload.causal, placement=placement, window=workload.window,
                slices=workload.slices)


def rank_pairs(mask: Mask) -> list[int]:
    """(query, key) pairs of each CP rank's queries under a placed `mask` (its blocks on
    the P x 1 mesh, `masked.block_pair_counts`)."""
    p = mask.placement.cp_size
    block = block_pair_counts(mask, mask.placement.total, p, 1)
    return [sum(n for (x, _), n in block.items() if x == rank) for rank in range(p)]


def placed_estimate(workload: Workload, cluster: Cluster, placement: DocumentPlacement,
                    rows: int, cols: int, heads: int = 1) -> Estimate:
    """The placement on a heads x rows x cols grid: its mask priced like any mask's
    (`masked.mask_estimate`: the sparse exchange of its rows, the inbound ones under the
    least own block, plus the busiest mesh rank's compute; the closed forms here count
    them where the documents alone limit it)."""
    return mask_estimate(workload, cluster, placed_mask(workload, placement), rows, cols,
                         heads)


def price_placement(plan: Plan, placement: DocumentPlacement | None = None) -> PlacedPlan:
    """The placement of `plan`'s documents (`place_documents` with the cluster's ranks per
    node, unless given) priced on the grids the THD plan prices."""
    w, c = plan.workload, plan.cluster
    if w.doc_lengths is None:
        raise ValueError("the placement needs packed documents (doc_lengths)")
    if placement is None:
        cu = [0]
        for n in w.doc_lengths:
            cu.append(cu[-1] + n)
        placement = place_documents(cu, c.gpus, c.gpus_per_node)
    sizes = heads_sizes(w, c.gpus)
    grids = [(1, r, cc) for r, cc in ((e.mesh_shape) for e in plan.meshes)]
    grids += [(a, r, cc) for a, r, cc in grid_shapes(c.gpus) if a in sizes]
    estimates = tuple(placed_estimate(w, c, placement, r, cc, a) for a, r, cc in grids)
    mask = placed_mask(w, placement)
    causal_documents = mask == documents_mask(placement)  # `works` counts those alone
    fwd = max(placement.works() if causal_documents else rank_pairs(mask)) * pair_flops(w)
    one = ring_calls(w, c.gpus).one_call()  # the floor: one call of the rank's rows
    floor = {"forward": c.attention_seconds("forward", fwd, one),
             "backward": c.attention_seconds("backward", BACKWARD_FLOPS_RATIO * fwd, one)}
    return PlacedPlan(placement, estimates, floor)
