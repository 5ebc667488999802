"""Command-line arguments for choosing the context-parallel algorithm and the mesh shape.

`add_mesh_args` works as Megatron-LM's `extra_args_provider`; `validate_mesh_args` checks
the parsed arguments before anything distributed starts. The algorithm comes from
`--context-parallel-algo` or from Megatron's own `--cp-comm-type` (one value, or one per
layer); `resolve_context_parallel_algo` reconciles the two, once.
"""
from __future__ import annotations

import argparse
import ast
import logging
from typing import Any

from megatron_mesh.layer_plan import (
    BACKEND_NAMES,
    DEFAULT_BACKEND,
    DEFAULT_GRAD_DTYPE,
    DEFAULT_SCHEDULE,
    GRAD_DTYPE_NAMES,
    SCHEDULE_NAMES,
    check_positive_int,
)
from megatron_mesh.masks.zigzag import check_zigzag_divisible
from megatron_mesh.megatron.shape import (
    AUTO,
    MESH_GPU_PROFILES,
    describe_mesh_shape,
    launch_pricing,
    launched_mesh_shape,
    parse_mesh_shape,
)

logger = logging.getLogger(__name__)

MESH = "mesh"
ALGORITHMS = ("p2p", "all_gather", "a2a", "a2a+p2p", MESH)
"""Megatron's four context-parallel algorithms (Transformer Engine) and the mesh."""

MEGATRON_DEFAULT_CP_COMM_TYPE = ["p2p"]
"""Megatron-LM's default --cp-comm-type: not an explicit choice."""

__all__ = [
    "ALGORITHMS",
    "MESH",
    "add_mesh_args",
    "attention_head_dims",
    "check_algorithm",
    "is_mesh",
    "mesh_active",
    "mesh_spec_options",
    "no_rope_pattern",
    "parse_mesh_shape",
    "resolve_context_parallel_algo",
    "te_cp_comm_type",
    "validate_mesh_args",
]


def is_mesh(algo: str | None) -> bool:
    """Whether `algo` is the mesh; every other algorithm of ALGORITHMS runs in Transformer
    Engine (None: Megatron's per-layer mix, never the mesh)."""
    return algo == MESH


def te_cp_comm_type(algo: str) -> str:
    """The cp_comm_type megatron-core's config gets for `algo`: its own name, or for the
    mesh 'p2p' (megatron-core checks the value; the mesh's core attention ignores it)."""
    return "p2p" if is_mesh(algo) else algo


def check_algorithm(algo: str) -> str:
    """`algo` if it is one of ALGORITHMS, else ValueError naming it and the valid ones."""
    if algo not in ALGORITHMS:
        raise ValueError(
            f"unknown context-parallel algorithm {algo!r}; valid: {', '.join(ALGORITHMS)}"
        )
    return algo


def mesh_active(args: Any) -> bool:
    """Whether the mesh runs: algorithm 'mesh' with a context-parallel size above 1 (at
    CP = 1 every algorithm is plain attention). `args` is a namespace or TrainingConfig with
    the algorithm resolved (`resolve_context_parallel_algo`)."""
    cp_size = getattr(args, "context_parallel_size", None) or 1
    return is_mesh(getattr(args, "context_parallel_algo", None)) and cp_size > 1


def _mesh_shape_type(text: str) -> tuple[int, ...]:
    try:
        return parse_mesh_shape(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _positive_int(text: str) -> int:
    try:
        return check_positive_int("value", int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer") from None


def _pattern_value(node: ast.AST) -> int | list[int]:
    """The value of a pattern expression made of int lists, ints, + and * only."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.List):
        items = [_pattern_value(e) for e in node.elts]
        if all(type(i) is int for i in items):
            return items
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _pattern_value(node.left), _pattern_value(node.right)
        if isinstance(node.op, ast.Add) and type(left) is type(right):
            return left + right
        if isinstance(node.op, ast.Mult) and (type(left), type(right)) != (list, list):
            return left * right
    raise ValueError("not a pattern")


def no_rope_pattern(text: str | int | list | None) -> int | list[int] | None:
    """--no-rope-freq as megatron-core's `no_rope_freq` takes it: an int N (every N-th layer
    without RoPE) or a list of 0 / 1 per layer (1: no RoPE), written as a list expression
    of ints, + and * (\"([0]*3+[1])*2\"; nothing is evaluated beyond those)."""
    if text is None or isinstance(text, (int, list)):
        return text
    try:
        value = _pattern_value(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError, RecursionError):
        value = None
    if type(value) is int and value >= 1:
        return value
    if isinstance(value, list) and value and set(value) <= {0, 1}:
        return value
    raise argparse.ArgumentTypeError(
        f"{text!r}: give an int N >= 1 (every N-th layer without RoPE) or a list of 0 / 1 per "
        "layer, 1 meaning no RoPE (e.g. '([0]*3+[1])*2')")


def mesh_spec_options(args: Any) -> dict[str, Any]:
    """What the mesh core attention spec takes from the flags (`use_mesh_core_attention`,
    `get_gpt_layer_spec` keywords): tile kernel, schedule, gradient dtypes, chunked
    attention."""
    return {"backend": getattr(args, "mesh_kernel", None) or DEFAULT_BACKEND,
            "schedule": getattr(args, "mesh_schedule", None),
            "grad_reduce_dtype": getattr(args, "mesh_grad_reduce_dtype", None),
            "attention_chunk_size": getattr(args, "attention_chunk_size", None)}


def add_mask_args(parser: argparse.ArgumentParser) -> None:
    """--attention-chunk-size, --mesh-mask-builder and (unless the parser has Megatron-LM's)
    --no-rope-freq."""
    group = parser.add_argument_group("mesh attention masks")
    group.add_argument(
        "--attention-chunk-size",
        dest="attention_chunk_size",
        type=_positive_int,
        default=None,
        metavar="N",
        help="Chunked attention (Llama 4): the layers that apply RoPE attend causally within "
        "chunks of N tokens (query i sees key j iff j <= i and i // N == j // N); the layers "
        "--no-rope-freq leaves without RoPE attend causally over the whole sequence. Needs "
        "--context-parallel-algo mesh.",
    )
    group.add_argument(
        "--mesh-mask-builder",
        dest="mesh_mask_builder",
        default=None,
        metavar="MODULE:FUNCTION",
        help="A mask per micro-batch: FUNCTION(tokens, position_ids) of MODULE (importable, or "
        "a path to a .py file) gets the whole micro-batch's int64 [b, s] tensors and returns "
        "a megatron_mesh.SliceMask or its list of slices (q_start, q_end, k_start, k_end, "
        "'full' | 'causal'), one for all b samples, used by every layer "
        "(examples/mask_builders.py). Needs --context-parallel-algo mesh.",
    )
    if "--no-rope-freq" not in parser._option_string_actions:  # Megatron-LM defines it
        group.add_argument(
            "--no-rope-freq",
            dest="no_rope_freq",
            type=no_rope_pattern,
            default=None,
            metavar="N|PATTERN",
            help="Layers without RoPE (megatron-core's no_rope_freq, Llama 4's NoPE layers): "
            "an int N, every N-th layer; or a list of 0 / 1 per layer, 1 without RoPE (e.g. "
            "'([0]*3+[1])*2'). With --attention-chunk-size these are the global layers.",
        )


def check_mask_args(args: Any, packed_documents: bool = False) -> None:
    """ValueError naming the flag: --attention-chunk-size and --mesh-mask-builder need the
    mesh, exclude each other and a sliding window; `packed_documents`: the caller packs
    --reset-attention-mask's documents (the driver; a builder then masks each sample, not
    with --mesh-balance-data-parallel); the builder must load; --no-rope-freq must fit
    --num-layers and not come with --multi-latent-attention."""
    chunk = getattr(args, "attention_chunk_size", None)
    builder = getattr(args, "mesh_mask_builder", None)
    layers = getattr(args, "num_layers", None)
    no_rope = getattr(args, "no_rope_freq", None)
    if no_rope and getattr(args, "multi_latent_attention", False):
        raise ValueError(f"--no-rope-freq {no_rope} with --multi-latent-attention: "
                         "megatron-core's MLA layers apply their RoPE in every layer (only "
                         "its self-attention reads no_rope_freq); drop one of them")
    if layers and no_rope:
        if isinstance(no_rope, int) and layers % no_rope:
            raise ValueError(f"--no-rope-freq {no_rope} must divide --num-layers {layers}")
        if isinstance(no_rope, (list, tuple)) and len(no_rope) != layers:
            raise ValueError(f"--no-rope-freq gives {len(no_rope)} layers, --num-layers is "
                             f"{layers}: give one 0 / 1 per layer")
    if chunk is None and builder is None:
        return
    flag = (f"--attention-chunk-size {chunk}" if builder is None
            else f"--mesh-mask-builder {builder}")
    if chunk is not None and builder is not None:
        raise ValueError(f"--attention-chunk-size {chunk} and --mesh-mask-builder {builder} "
                         "are exclusive: a builder's mask applies to every layer (it may build "
                         "chunks itself: megatron_mesh.chunked_mask)")
    if not is_mesh(getattr(args, "context_parallel_algo", None)):
        raise ValueError(f"{flag} runs in the mesh's core attention: add "
                         "--context-parallel-algo mesh (any --context-parallel-size)")
    if getattr(args, "window_size", None):
        raise ValueError(f"{flag} with --window-size: give one mask")
    if getattr(args, "reset_attention_mask", False) and not packed_documents:
        raise ValueError(f"{flag} with --reset-attention-mask: Megatron-LM's document mask "
                         "is a dense [s, s] mask the mesh does not read; train packed "
                         "documents with python -m megatron_mesh.pretrain_gpt")
    if builder is not None and getattr(args, "mesh_balance_data_parallel", False):
        raise ValueError(f"{flag} with --mesh-balance-data-parallel: the balance moves "
                         "documents between samples, and a builder masks a sample's "
                         "positions; drop --mesh-balance-data-parallel")
    if builder is not None:
        from megatron_mesh.megatron.mask_builder import load_mask_builder

        load_mask_builder(builder)


def add_mesh_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add --context-parallel-algo, --mesh-shape, --mesh-heads, --mesh-schedule,
    --mesh-grad-reduce-dtype, --mesh-kernel, --mesh-gpu-profile and the mask flags (`add_mask_args`) to
    `parser` (idempotent); returns it."""
    if "--context-parallel-algo" in parser._option_string_actions:
        return parser
    group = parser.add_argument_group("mesh context parallelism")
    group.add_argument(
        "--context-parallel-algo",
        dest="context_parallel_algo",
        choices=ALGORITHMS,
        default=None,
        help="Context-parallel attention algorithm (default: --cp-comm-type, else p2p). p2p, "
        "all_gather, a2a and a2a+p2p are Megatron's (they need Transformer Engine); mesh is "
        "the 2D mesh attention.",
    )
    if "--cp-comm-type" not in parser._option_string_actions:  # Megatron-LM defines it
        group.add_argument(
            "--cp-comm-type",
            dest="cp_comm_type",
            nargs="+",
            default=None,
            metavar="ALGO",
            help="Megatron's name for the algorithm (same values as --context-parallel-algo); "
            "--cp-comm-type mesh equals --context-parallel-algo mesh.",
        )
    group.add_argument(
        "--mesh-shape",
        dest="mesh_shape",
        type=_mesh_shape_type,
        default=None,
        metavar="[A]xRxC",
        help="Grid of the context-parallel ranks for --context-parallel-algo mesh: RxC (the "
        "2D mesh) or AxRxC (an all-to-all over A consecutive CP ranks, each then holding 1/A "
        "of the heads, and an R x C mesh over the ranks of one head slice); A * R * C = "
        "--context-parallel-size. When omitted, the grid the planner (megatron-mesh plan) "
        "predicts fastest.",
    )
    group.add_argument(
        "--mesh-heads",
        dest="mesh_heads",
        type=int,
        default=None,
        metavar="A",
        help="All-to-all (head-parallel) size A of the mesh grid: must divide the CP size and "
        "the attention heads per TP rank (K/V heads are repeated where A exceeds them); with "
        "--mesh-shape RxC the grid is AxRxC; alone, the planner picks R x C for it. When "
        "omitted with --mesh-shape RxC, 1; with neither flag, the planner's choice.",
    )
    group.add_argument(
        "--mesh-schedule",
        dest="mesh_schedule",
        choices=SCHEDULE_NAMES,
        default=DEFAULT_SCHEDULE,
        help="How a mesh rank moves its tile: streamed_kv (K/V around the column ring, "
        "overlapped with compute, two K/V buffers), streamed_q (Q and partial outputs around "
        "the row ring, two Q buffers), streamed (whichever of the two holds less memory for "
        "the shape) or gathered (all at once). Same bytes, but for streamed_q's fp32 partial "
        "outputs.",
    )
    group.add_argument(
        "--mesh-grad-reduce-dtype",
        dest="mesh_grad_reduce_dtype",
        choices=GRAD_DTYPE_NAMES,
        default=DEFAULT_GRAD_DTYPE,
        help="dtypes in which the mesh's gradient partials travel: mixed (dK, dV in the input "
        "dtype, as Transformer Engine's ring sends them, dQ in fp32), fp32 (all), or input "
        "(all in bf16 / fp16 with such inputs).",
    )
    group.add_argument(
        "--mesh-kernel",
        dest="mesh_kernel",
        choices=BACKEND_NAMES,
        default=DEFAULT_BACKEND,
        help="The kernel each mesh tile's calls run on: auto (on CUDA Transformer Engine's "
        "fused attention where its backend query takes the tile, else torch's cuDNN, flash or "
        "memory-efficient op; torch's ops on the CPU), torch, cudnn, te, or flex "
        "(FlexAttention: the blocks on hand in one call with a block mask, compiled on CUDA; "
        "the gathered schedule's whole tile in one call). A named kernel that cannot run the "
        "tile raises.",
    )
    group.add_argument(
        "--mesh-gpu-profile",
        dest="mesh_gpu_profile",
        choices=MESH_GPU_PROFILES,
        default=AUTO,
        help="How the planner prices attention when it picks the grid (no --mesh-shape): "
        "by a GPU profile's measured kernel calls (h200; h100 is the H200's scaled, not "
        "measured), at a flat TFLOP/s (flat), or auto: the profile the CUDA device's name "
        "names (H200, H100), else flat. The log line of the grid says which.",
    )
    add_mask_args(parser)
    return parser


def _attention_dtype(args: Any) -> str:
    """The dtype attention runs in under Megatron's flags: 'bf16' (--bf16), 'fp16' (--fp16)
    or 'fp32' (neither), what the planner prices the automatic shape in."""
    if getattr(args, "bf16", False):
        return "bf16"
    return "fp16" if getattr(args, "fp16", False) else "fp32"


def _head_counts(args: Any) -> tuple[int | None, int | None]:
    """(num_attention_heads, num_query_groups) as Megatron-LM means them."""
    heads = getattr(args, "num_attention_heads", None)
    groups = getattr(args, "num_query_groups", None)
    if getattr(args, "group_query_attention", True) is False:
        groups = None  # Megatron-LM ignores --num-query-groups without --group-query-attention
    return heads, groups


def attention_head_dims(args: Any) -> tuple[int | None, int | None]:
    """(Q / K head dim, V head dim) of the core attention, from Megatron-LM's arguments:
    with --multi-latent-attention, --qk-head-dim + --qk-pos-emb-head-dim and --v-head-dim
    (what megatron-core's MLA passes its core attention as k_channels and v_channels);
    otherwise --kv-channels (default hidden size / heads) for both. None where unknown."""
    if getattr(args, "multi_latent_attention", False):
        qk, rope = getattr(args, "qk_head_dim", None), getattr(args, "qk_pos_emb_head_dim", None)
        return (qk + rope if qk and rope else None), getattr(args, "v_head_dim", None)
    kv_channels = getattr(args, "kv_channels", None)
    if not kv_channels:
        heads = getattr(args, "num_attention_heads", None)
        hidden = getattr(args, "hidden_size", None)
        kv_channels = hidden // heads if heads and hidden else None
    return kv_channels, kv_channels


def _comm_types(args: Any) -> list[str] | None:
    """--cp-comm-type as a list (None, one value, or one per layer)."""
    value = getattr(args, "cp_comm_type", None)
    if value is None:
        return None
    return [value] if isinstance(value, str) else list(value)


def resolve_context_parallel_algo(args: Any) -> str | None:
    """The run's algorithm from --context-parallel-algo and --cp-comm-type; ValueError when
    they contradict or when mesh is mixed with other per-layer values.

    Writes it to args.context_parallel_algo, and a Megatron algorithm chosen by
    --context-parallel-algo to args.cp_comm_type (what Megatron reads). None only for
    Megatron's own per-layer mix of --cp-comm-type values (no mesh among them).
    """
    chosen = getattr(args, "context_parallel_algo", None)
    comm = _comm_types(args)
    for algo in [chosen, *(comm or [])]:
        if algo is not None:
            check_algorithm(algo)
    if comm and MESH in comm and set(comm) != {MESH}:
        raise ValueError(
            f"--cp-comm-type {' '.join(comm)}: mesh cannot be mixed with other per-layer "
            "algorithms; give --cp-comm-type mesh (every layer) or leave mesh out"
        )
    explicit_comm = comm is not None and comm != MEGATRON_DEFAULT_CP_COMM_TYPE
    if chosen is not None and explicit_comm and set(comm) != {chosen}:
        raise ValueError(
            f"--context-parallel-algo {chosen} contradicts --cp-comm-type {' '.join(comm)}; "
            "give one of the two flags"
        )
    if chosen is None:
        chosen = "p2p" if not comm else comm[0] if len(set(comm)) == 1 else None
    elif not is_mesh(chosen) and comm is not None:
        args.cp_comm_type = [chosen]
    args.context_parallel_algo = chosen
    return chosen


def check_mesh_kernel(args: Any) -> str:
    """ValueError naming --mesh-kernel where the kernel it names cannot run on this
    machine's device (CUDA where there is one, else the CPU) for the run's dtype and head
    dims (`kernels.choose`, the one decision, asked here before any group exists instead of
    at the first layer); 'auto' always runs. Returns the kernel whose calls the planner
    prices: the one named, or the one 'auto' runs on this CUDA device (te, cudnn or torch:
    `choice.backend_of`); 'auto' without one (the GPU profile's own kernel)."""
    backend = getattr(args, "mesh_kernel", None) or DEFAULT_BACKEND
    import torch

    if backend == DEFAULT_BACKEND and not torch.cuda.is_available():
        return backend
    from megatron_mesh.kernels import DeviceFacts, choose
    from megatron_mesh.kernels.choice import backend_of

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(_attention_dtype(args),
                                                               torch.float32)
    qk, v = attention_head_dims(args)
    try:
        chosen = choose(backend, DeviceFacts.of(device, want_te=backend in ("te", "auto")),
                        dtype, qk, None if v == qk else v)
    except ValueError as e:
        raise ValueError(f"--mesh-kernel {backend}: {e}") from None
    return backend_of(chosen) if backend == DEFAULT_BACKEND else backend


def validate_mesh_args(args: Any, packed_documents: bool = False
                       ) -> tuple[int, int, int] | None:
    """Check the algorithm, CP size, sequence length, mesh shape and heads (and, for the
    mesh, attention dropout and head counts after TP); ValueError naming the bad value if
    bad.

    Returns the (A, R, C) grid (what --mesh-shape / --mesh-heads leave open chosen by the
    planner; logged either way) for the mesh with CP > 1, else None; sets args.mesh_heads
    to its A and args.mesh_shape_chosen_by_planner to whether the planner chose it.
    Resolves the algorithm first (`resolve_context_parallel_algo`); `packed_documents`:
    the caller packs documents (`check_mask_args`). Touches no process group.
    """
    named = ("--context-parallel-algo mesh" if getattr(args, "context_parallel_algo", None)
             else "--cp-comm-type mesh")  # the flag the user gave, for the errors below
    algo = resolve_context_parallel_algo(args)
    check_mask_args(args, packed_documents)
    cp_size = getattr(args, "context_parallel_size", None)
    cp_size = 1 if cp_size is None else cp_size
    check_positive_int("context-parallel size", cp_size)
    seq_length = getattr(args, "seq_length", None)
    if seq_length is not None:
        check_zigzag_divisible(seq_length, cp_size, "--seq-length", "--context-parallel-size")
    mesh_shape = getattr(args, "mesh_shape", None)
    mesh_heads = getattr(args, "mesh_heads", None)
    if not is_mesh(algo):
        for flag, value in (("--mesh-shape", mesh_shape), ("--mesh-heads", mesh_heads)):
            if value is not None:
                logger.warning("%s %s is ignored: --context-parallel-algo is %s", flag, value,
                               algo)
        return None
    dropout = getattr(args, "attention_dropout", 0.0) or 0.0
    if dropout > 0:
        raise ValueError(
            f"{named} does not implement attention dropout "
            f"(--attention-dropout {dropout}); pass --attention-dropout 0"
        )
    kernel = check_mesh_kernel(args)
    heads, groups = _head_counts(args)
    tp_size = getattr(args, "tensor_model_parallel_size", None) or 1
    # how the planner prices attention, decided here once (the device read only for auto)
    pricing = (launch_pricing(getattr(args, "mesh_gpu_profile", None) or AUTO, kernel)
               if mesh_shape is None and cp_size > 1 else None)
    shape, automatic, per_node = launched_mesh_shape(
        cp_size, mesh_shape, tp_size, mesh_heads=mesh_heads, num_attention_heads=heads,
        num_query_groups=groups, head_dim=attention_head_dims(args)[0], seq_length=seq_length,
        schedule=getattr(args, "mesh_schedule", DEFAULT_SCHEDULE),
        grad_reduce_dtype=getattr(args, "mesh_grad_reduce_dtype", DEFAULT_GRAD_DTYPE),
        gpu=None if pricing is None else pricing.gpu,
        batch=getattr(args, "micro_batch_size", None) or 1, dtype=_attention_dtype(args))
    if cp_size == 1:
        logger.warning(
            "context-parallel size is 1: the mesh is a 1x1 grid and runs as plain attention"
        )
        return None
    args.mesh_heads = shape[0]
    args.mesh_shape_chosen_by_planner = automatic
    logger.info(describe_mesh_shape(shape, cp_size, automatic, per_node, pricing))
    return shape
