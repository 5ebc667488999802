"""Price every method and mesh shape for one configuration and pick the best mesh."""
from __future__ import annotations

from dataclasses import dataclass

from megatron_mesh import layer_plan
from megatron_mesh.layer_plan import (
    DEFAULT_GRAD_DTYPE,
    DEFAULT_SCHEDULE,
    DTYPE_BYTES,
    AttentionShape,
    MeshPlan,
    grid_shapes,
    mesh_shapes,
    shapes_text,
)
from megatron_mesh.masks.mask import Mask, as_attention_mask
from megatron_mesh.masks.slices import SliceMask
from megatron_mesh.masks.window import Window, window_of
from megatron_mesh.planner.cost import Estimate, NotApplicable, Unavailable, price
from megatron_mesh.planner.gpu_profile import GpuProfile, load_profile
from megatron_mesh.planner.hardware import (
    DEFAULT_ATTENTION_TFLOPS,
    DEFAULT_GPUS_PER_NODE,
    DEFAULT_INTER_NODE_BW,
    DEFAULT_INTRA_NODE_BW,
    Cluster,
)
from megatron_mesh.planner.methods import (
    a2a_p2p_transfers,
    a2a_sizes,
    a2a_transfers,
    all_gather_transfers,
    mesh_transfers,
    ring_transfers,
)
from megatron_mesh.planner.methods.ring import check_takes_window
from megatron_mesh.planner.methods.sparse import mask_estimate
from megatron_mesh.planner.pricing.tiles import (
    a2a_calls,
    a2a_p2p_calls,
    all_gather_calls,
    mesh_calls,
    ring_calls,
)
from megatron_mesh.planner.pricing.workload import Workload
from megatron_mesh.planner.ranks_on_nodes import Placement, mesh_placement


@dataclass(frozen=True)
class Plan:
    """Every priced method for one workload on one cluster, and the chosen mesh."""

    workload: Workload
    cluster: Cluster
    overlap: bool
    ring: Estimate | None  # None under a sliding window (Transformer Engine's ring refuses)
    baselines: tuple[Estimate, ...]
    meshes: tuple[Estimate, ...]
    unavailable: tuple[Unavailable, ...]
    best_mesh: Estimate
    placement: Placement
    grids: tuple[Estimate, ...] = ()  # heads x rows x cols with heads > 1
    best_grid: Estimate | None = None  # the fastest of meshes and grids: the choice
    grid_placement: Placement | None = None

    @property
    def estimates(self) -> tuple[Estimate, ...]:
        """Table order: ring, the other baselines, mesh shapes from P x 1 to 1 x P, then
        heads x rows x cols grids by heads."""
        ring = () if self.ring is None else (self.ring,)
        return (*ring, *self.baselines, *self.meshes, *self.grids)

    @property
    def reference(self) -> Estimate:
        """What speedups are measured against: ring, or all_gather where ring does not run
        (sliding windows)."""
        if self.ring is not None:
            return self.ring
        found = self.method("all_gather")
        assert found is not None
        return found

    @property
    def mesh_plan(self) -> MeshPlan:
        """The plan of the fastest mesh: its shape, the schedule it runs and its gradient
        dtype (`Workload.mesh_plan`)."""
        assert self.best_mesh.mesh_shape is not None
        return self.workload.mesh_plan(*self.best_mesh.mesh_shape)

    @property
    def best(self) -> Estimate:
        """The fastest method overall (ties as for meshes, without the rows rule)."""
        return min(self.estimates, key=time_key)

    def speedup(self, estimate: Estimate) -> float:
        """Predicted time of the reference (ring; all_gather under a window) over
        `estimate`'s time."""
        return self.reference.total_s / estimate.total_s

    def method(self, name: str) -> Estimate | None:
        """The baseline called `name` ("ring", "all_gather", "a2a", "a2a+p2p"), if priced."""
        return next((e for e in (self.ring, *self.baselines) if e is not None and e.method == name),
                    None)

    def mesh(self, rows: int, cols: int) -> Estimate:
        """The estimate of the rows x cols mesh."""
        for e in self.meshes:
            if e.mesh_shape == (rows, cols):
                return e
        raise ValueError(
            f"mesh shape {rows}x{cols} is not a grid of {self.cluster.gpus} GPUs; valid: "
            + shapes_text(self.cluster.gpus)
        )


def time_key(estimate: Estimate) -> tuple[float, float, int, int]:
    """Least time, then least communication time, inter-node bytes, bytes."""
    return (
        estimate.total_s,
        estimate.total_comm_s,
        estimate.inter_node_bytes,
        estimate.total_bytes,
    )


def mesh_key(estimate: Estimate) -> tuple[float, float, int, int, int]:
    """`time_key`, then more rows (GQA-friendly, as `traffic.best_mesh_shape`)."""
    assert estimate.mesh_shape is not None
    return (*time_key(estimate), -estimate.mesh_shape[0])


def grid_key(estimate: Estimate) -> tuple[float, float, int, int, int, int]:
    """`time_key`, then fewer heads (fewer collectives), then more rows."""
    assert estimate.mesh_shape is not None
    return (*time_key(estimate), estimate.heads, -estimate.mesh_shape[0])


def heads_sizes(workload: Workload, cp_size: int) -> list[int]:
    """Every all-to-all size A > 1 of a heads x rows x cols grid: A divides P and the query
    heads (K/V heads are repeated where A exceeds them)."""
    return [a for a in layer_plan.heads_sizes(cp_size, workload.num_heads) if a > 1]


def search(workload: Workload, cluster: Cluster, overlap: bool = True) -> Plan:
    """Price ring, all_gather, a2a, a2a+p2p (best A), every mesh shape and every
    heads x rows x cols grid; the choice is the fastest mesh or grid. A method that cannot
    run the workload (ring and a2a+p2p under a sliding window or slices) is listed as
    unavailable, with the reason."""
    p = cluster.gpus
    workload.check_cp_size(p)
    backend = None if cluster.gpu is None else cluster.gpu.calls_backend

    def priced(method: str, label: str, transfers, calls, shape=None, heads=1) -> Estimate:
        """`calls`: (function, its arguments) of the method's kernel calls, counted only
        where a GPU profile prices them."""
        counted = None if cluster.gpu is None else calls[0](*calls[1:])
        return price(method, label, transfers, workload, cluster, overlap, shape, heads,
                     calls=counted)

    unavailable = []
    try:
        ring = priced("ring", "ring (p2p)", ring_transfers(workload, cluster),
                      (ring_calls, workload, p))
    except NotApplicable as exc:
        ring = None
        unavailable.append(Unavailable("ring", str(exc)))
    baselines = [priced("all_gather", "all_gather", all_gather_transfers(workload, cluster),
                        (all_gather_calls, workload, p))]
    try:
        baselines.append(priced("a2a", "a2a (Ulysses)", a2a_transfers(workload, cluster),
                                (a2a_calls, workload, p)))
    except NotApplicable as exc:
        unavailable.append(Unavailable("a2a", str(exc)))
    try:
        check_takes_window(workload, "a2a+p2p")
    except NotApplicable as exc:
        unavailable.append(Unavailable("a2a+p2p", str(exc)))
    hierarchical = [] if workload.sparse else [
        priced("a2a+p2p", f"a2a+p2p ({a}x{p // a})", a2a_p2p_transfers(workload, cluster, a),
               (a2a_p2p_calls, workload, p, a))
        for a in a2a_sizes(workload, p)
    ]
    if hierarchical:
        baselines.append(min(hierarchical, key=time_key))
    elif not workload.sparse:
        unavailable.append(Unavailable(
            "a2a+p2p",
            f"needs an all-to-all size 1 < A < {p} dividing {p}, num_heads "
            f"({workload.num_heads}) and num_kv_heads ({workload.num_kv_heads})",
        ))
    mask = workload.mask_on(p) if workload.generic else None

    def mesh(a: int, r: int, c: int) -> Estimate:
        """The heads x rows x cols grid: from the mask's slices where no closed form stands
        in for them (`Workload.generic`)."""
        if mask is not None:
            return mask_estimate(workload, cluster, mask, r, c, a, overlap)
        label = f"mesh {r}x{c}" if a == 1 else f"mesh {a}x{r}x{c}"
        return priced("mesh", label, mesh_transfers(workload, cluster, r, c, a),
                      (mesh_calls, workload, p, r, c, a, None, backend), (r, c), a)

    meshes = tuple(mesh(1, r, c) for r, c in mesh_shapes(p))
    best_mesh = min(meshes, key=mesh_key)
    sizes = heads_sizes(workload, p)
    grids = tuple(mesh(a, r, c) for a, r, c in grid_shapes(p) if a in sizes)
    best_grid = min(meshes + grids, key=grid_key)
    sparse = workload.sparse
    return Plan(
        workload=workload,
        cluster=cluster,
        overlap=overlap,
        ring=ring,
        baselines=tuple(baselines),
        meshes=meshes,
        unavailable=tuple(unavailable),
        best_mesh=best_mesh,
        placement=mesh_placement(*best_mesh.mesh_shape, cluster, sparse=sparse),
        grids=grids,
        best_grid=best_grid,
        grid_placement=mesh_placement(*best_grid.mesh_shape, cluster, best_grid.heads, sparse),
    )


def resolve_head_dim(num_heads: int, head_dim: int | None, hidden_size: int | None) -> int:
    """`head_dim`, or hidden_size / num_heads when it is omitted."""
    if head_dim is not None:
        return head_dim
    if hidden_size is None:
        raise ValueError("give head_dim, or hidden_size to derive it as hidden_size / num_heads")
    if num_heads < 1 or hidden_size % num_heads:
        raise ValueError(
            f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}; "
            "give head_dim explicitly"
        )
    return hidden_size // num_heads


def plan(
    gpus: int,
    *,
    seq_length: int,
    num_heads: int,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    hidden_size: int | None = None,
    batch: int = 1,
    dtype: str = "bf16",
    causal: bool = True,
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE,
    intra_node_bw: float = DEFAULT_INTRA_NODE_BW,
    inter_node_bw: float = DEFAULT_INTER_NODE_BW,
    attention_tflops: float = DEFAULT_ATTENTION_TFLOPS,
    overlap: bool = True,
    mesh_grad_reduce_dtype: str = DEFAULT_GRAD_DTYPE,
    mesh_schedule: str = DEFAULT_SCHEDULE,
    doc_lengths: tuple[int, ...] | None = None,
    window: Window | tuple[int, int] | None = None,
    gpu: GpuProfile | str | None = None,
    mask: Mask | SliceMask | None = None,
) -> Plan:
    """Plan one attention layer's context parallelism over `gpus` GPUs (see `search`);
    `doc_lengths`: packed documents filling the sequence (`Workload`); `window`: a sliding
    window (left, right), checked here once (`window.window_of`), inside each document with
    `doc_lengths`; `mask`: any other mask over the sequence (`Workload.from_shape`; it says
    whether it is causal, `causal` is not read with it); `gpu`: a GPU profile (or its name,
    `gpu_profile.GPU_PROFILES`) pricing attention by kernel calls instead of the flat
    `attention_tflops`."""
    if isinstance(gpu, str):
        gpu = load_profile(gpu)
    layer = Mask(causal) if mask is None else as_attention_mask(mask)
    if window is not None:  # checked once, for the mask's causality
        sides = (window.left, window.right) if isinstance(window, Window) else window
        layer = layer & Mask(layer.causal, window=window_of(sides, layer.causal))
    shape = AttentionShape(seq_length, batch, num_heads,
                           num_heads if num_kv_heads is None else num_kv_heads,
                           resolve_head_dim(num_heads, head_dim, hidden_size),
                           DTYPE_BYTES.get(dtype, 0))
    workload = Workload.from_shape(shape, layer, doc_lengths, dtype, mesh_schedule,
                                   mesh_grad_reduce_dtype)
    cluster = Cluster(gpus, gpus_per_node, intra_node_bw, inter_node_bw, attention_tflops, gpu)
    return search(workload, cluster, overlap)
