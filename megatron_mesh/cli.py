"""`megatron-mesh` command line: `megatron-mesh plan ...` prints the planner's table."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence

from megatron_mesh.layer_plan import (
    BACKEND_NAMES,
    DEFAULT_BACKEND,
    DEFAULT_GRAD_DTYPE,
    DEFAULT_SCHEDULE,
    DTYPE_BYTES,
    GRAD_DTYPE_NAMES,
    SCHEDULE_NAMES,
)
from megatron_mesh.masks.mask import Mask
from megatron_mesh.masks.window import Window, window_of
from megatron_mesh.planner import hardware
from megatron_mesh.planner.gpu_profile import GPU_PROFILES, load_profile
from megatron_mesh.planner.hardware import Cluster
from megatron_mesh.planner.inference import DEFAULT_HBM_BW, format_inference, inference_report
from megatron_mesh.planner.pricing.layers import LayerMix, ModelPlan, model_plan
from megatron_mesh.planner.pricing.length_histogram import LengthHistogram
from megatron_mesh.planner.pricing.placed_documents import lognormal_lengths, price_placement
from megatron_mesh.planner.pricing.workload import Workload
from megatron_mesh.planner.reports.flags import TensorParallel, driver_flags
from megatron_mesh.planner.reports.model_report import format_model, model_to_dict
from megatron_mesh.planner.reports.plot import INSTALL_HINT, draw, gpu_counts
from megatron_mesh.planner.reports.report import format_placed, format_table, placed_to_dict, plan_to_dict
from megatron_mesh.planner.search import Plan, resolve_head_dim, search

# Bounds past which a value is a typo, not a machine: 2**31 tokens per sequence, 100 PFLOP/s or
# 100 TB/s per GPU (two orders of magnitude past any GPU made).
MAX_SEQ_LENGTH = 2**31
MAX_TFLOPS = 100_000.0
MAX_GB_PER_S = 100_000.0


def _int_in(low: int, high: int | None = None):
    """argparse type: an integer in [low, high]."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            what = "a positive integer" if low == 1 else f"an integer >= {low}"
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"{text!r} is absurd: at most {high}")
        return value
    return parse


def _positive_float(high: float):
    """argparse type: a finite number in (0, high]."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not value > 0 or not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
        if value > high:
            raise argparse.ArgumentTypeError(f"{text!r} is absurd: at most {high:g}")
        return value
    return parse


_positive_int = _int_in(1)


def _add_plan_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan", allow_abbrev=False,  # a flag's prefix is an error, as in Megatron-LM
        help="predict attention time and traffic per GPU of ring, all_gather, a2a, "
        "a2a+p2p and every mesh shape, and pick the mesh shape",
        description="Predict one attention layer's traffic and time per GPU (forward + "
        "backward) for each context-parallel method and mesh shape.",
    )
    p.add_argument("--gpus", type=_int_in(2), required=True,
                   help="GPUs sharing one sequence, TP x CP: the context-parallel size P = "
                   "--gpus / --tensor-model-parallel-size (= --gpus without TP) must be >= 2")
    p.add_argument("--gpus-per-node", type=_positive_int, default=hardware.DEFAULT_GPUS_PER_NODE,
                   help="GPUs per node; with TP, CP ranks per node = --gpus-per-node / TP "
                   "(default %(default)s)")
    p.add_argument("--tensor-model-parallel-size", dest="tp", type=_positive_int, default=1,
                   metavar="TP",
                   help="tensor parallelism TP: each TP rank holds --num-heads / TP query and "
                   "--num-kv-heads / TP K/V heads, TP consecutive GPUs of a node form one CP "
                   "rank, so CP = --gpus / TP and CP ranks per node = --gpus-per-node / TP; "
                   "TP must divide all four (default 1)")
    p.add_argument("--intra-node-bw", type=_positive_float(MAX_GB_PER_S),
                   default=hardware.DEFAULT_INTRA_NODE_BW,
                   help="achieved GB/s per GPU inside a node (default %(default)s)")
    p.add_argument("--inter-node-bw", type=_positive_float(MAX_GB_PER_S),
                   default=hardware.DEFAULT_INTER_NODE_BW,
                   help="achieved GB/s per GPU between nodes, i.e. node NIC bandwidth / GPUs "
                   "per node (default %(default)s)")
    p.add_argument("--attention-tflops", type=_positive_float(MAX_TFLOPS), default=None,
                   help="achieved attention TFLOP/s per GPU, a flat rate for every kernel call "
                   f"(default {hardware.DEFAULT_ATTENTION_TFLOPS:g} without --gpu)")
    p.add_argument("--gpu", choices=GPU_PROFILES,
                   help="price attention by the GPU's measured kernel calls (a fixed cost per "
                   "call, a lower rate for small calls) instead of a flat TFLOP/s: h200 "
                   "measured; h100 the H200's profile scaled by the data-sheet matrix rate "
                   "(not measured); not with --attention-tflops")
    p.add_argument("--seq-length", type=_int_in(1, MAX_SEQ_LENGTH), required=True,
                   help="whole sequence length S")
    p.add_argument("--hidden-size", type=_positive_int,
                   help="model hidden size (gives head dim = hidden / heads)")
    p.add_argument("--num-heads", type=_positive_int, required=True,
                   help="the model's query heads (per TP rank: / TP)")
    p.add_argument("--num-kv-heads", type=_positive_int,
                   help="the model's key/value heads (GQA; default: --num-heads; per TP rank: "
                   "/ TP)")
    p.add_argument("--head-dim", type=_positive_int,
                   help="head dimension (default: hidden size / heads)")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True,
                   help="causal mask (default: on)")
    p.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16",
                   help="input dtype (default %(default)s)")
    p.add_argument("--batch", type=_positive_int, default=1, help="micro-batch (default 1)")
    docs = p.add_mutually_exclusive_group()
    docs.add_argument("--doc-length", type=_positive_int, metavar="L",
                      help="packed documents of L tokens each (--seq-length must be a multiple "
                      "of L): prices Transformer Engine's THD layout (compute counts only "
                      "in-document attention, bytes of the whole sequence) beside the "
                      "document placement (documents whole on ranks, the driver's default)")
    docs.add_argument("--doc-lengths", metavar="L1,L2,...",
                      help="packed documents of these lengths (summing to --seq-length)")
    docs.add_argument("--doc-length-dist",
                      metavar="lognormal:MEDIAN:MAX[:SEED] | histogram:FILE[:SEED]",
                      help="packed documents drawn from a log-normal of median MEDIAN (sigma "
                      "1), clipped to [1, MAX], or from a corpus's length histogram (the "
                      "FILE python -m megatron_mesh.preprocess writes), filling --seq-length "
                      "(the last one cut to fit); deterministic from SEED (default 0)")
    p.add_argument("--window-size", metavar="L[,R]",
                   help="sliding window: query i sees keys i-L .. i+R (-1: unbounded; R "
                   "defaults to 0 and must be 0 or -1 when causal); prices the windowed layer "
                   "(only the pairs it keeps; ring and a2a+p2p do not take windows in "
                   "Transformer Engine) and the whole model; with --doc-length(s) / "
                   "--doc-length-dist the window runs inside each document (in the THD layout "
                   "and placed); write --window-size=-1,R when L is -1")
    p.add_argument("--window-attn-skip-freq", type=_positive_int, metavar="N",
                   help="Megatron-Core's window_attn_skip_freq: layer n (1-indexed) is global "
                   "(full attention) when n %% N == 0, windowed otherwise; prices both kinds "
                   "and the model (needs --window-size)")
    p.add_argument("--num-layers", type=_positive_int,
                   help="layers of the model for --window-size (default: "
                   "--window-attn-skip-freq, or 1)")
    p.add_argument("--mesh-grad-reduce-dtype", choices=GRAD_DTYPE_NAMES,
                   default=DEFAULT_GRAD_DTYPE,
                   help="dtypes of the mesh's gradient exchange: mixed (dQ fp32, dK, dV in the "
                   "input dtype, as Transformer Engine's ring), fp32 or input (default "
                   "%(default)s)")
    p.add_argument("--mesh-schedule", choices=SCHEDULE_NAMES, default=DEFAULT_SCHEDULE,
                   help="mesh schedule: which ring's traffic overlaps compute (streamed_kv: "
                   "column, streamed_q: row, streamed: the one it picks for the shape, "
                   "gathered: none; default %(default)s)")
    p.add_argument("--mesh-kernel", choices=BACKEND_NAMES, default=DEFAULT_BACKEND,
                   help="with --gpu: the tile kernel whose calls are priced (auto: the "
                   "profile's; torch or cudnn by its own fit; te and flex by their own calls "
                   "at the profile's kernel time a call, MODEL: no fit of theirs; default "
                   "%(default)s)")
    p.add_argument("--no-overlap", dest="overlap", action="store_false",
                   help="price every transfer as exposed (compute + comm)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--inference", action="store_true",
                   help="price inference instead: the prefill (forward only) of every method "
                   "and grid, and one decode step per method (--batch sequences, one new token "
                   "each, over a context of --seq-length cached tokens); docs/inference.md")
    p.add_argument("--hbm-bw", type=_positive_float(MAX_GB_PER_S), default=DEFAULT_HBM_BW,
                   help="with --inference: achieved GB/s of a GPU reading its KV cache "
                   "(default %(default)s)")
    p.add_argument("--plot", metavar="FILE.png",
                   help="draw predicted speedup over ring against GPU count (TP x CP, CP 2 .. "
                   "--gpus / TP): the planner's choice, the best 2D mesh and the other methods")
    p.set_defaults(command_parser=p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-mesh", description="Tools for 2D mesh context-parallel attention."
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_plan_parser(subparsers)
    return parser


def _plan(args: argparse.Namespace, cp_size: int, window: Window | None = None) -> Plan:
    """The plan of one layer over `cp_size` CP ranks, each TP rank's heads (`args.tensor`)."""
    tp: TensorParallel = args.tensor
    shape = tp.attention_shape(args.seq_length, args.batch, args.head_dim, args.dtype)
    workload = Workload.from_shape(shape, Mask(args.causal, window=window), args.documents,
                                   args.dtype, args.mesh_schedule, args.mesh_grad_reduce_dtype)
    gpu = None if args.gpu is None else load_profile(args.gpu).for_kernel(args.mesh_kernel)
    cluster = Cluster(cp_size, tp.cp_per_node, args.intra_node_bw, args.inter_node_bw,
                      args.attention_tflops or hardware.DEFAULT_ATTENTION_TFLOPS, gpu)
    return search(workload, cluster, args.overlap)


def _documents(args: argparse.Namespace) -> tuple[int, ...] | None:
    """--doc-length / --doc-lengths as document lengths filling --seq-length (None: one
    sequence); exits 2 naming the bad value."""
    parser: argparse.ArgumentParser = args.command_parser
    if args.doc_length is not None:
        if args.seq_length % args.doc_length:
            parser.error(f"--doc-length {args.doc_length} does not divide --seq-length "
                         f"{args.seq_length}; give a divisor or --doc-lengths")
        return (args.doc_length,) * (args.seq_length // args.doc_length)
    if args.doc_length_dist is not None:
        return _length_dist(parser, args.doc_length_dist, args.seq_length)
    if args.doc_lengths is None:
        return None
    try:
        lengths = tuple(int(n) for n in args.doc_lengths.split(","))
    except ValueError:
        parser.error(f"--doc-lengths {args.doc_lengths!r}: give comma-separated token counts")
    if any(n < 1 for n in lengths) or sum(lengths) != args.seq_length:
        parser.error(f"--doc-lengths {args.doc_lengths}: positive lengths summing to "
                     f"--seq-length {args.seq_length} (they sum to {sum(lengths)})")
    return lengths


def _length_dist(parser: argparse.ArgumentParser, text: str, seq_length: int
                 ) -> tuple[int, ...]:
    """--doc-length-dist lognormal:MEDIAN:MAX[:SEED] or histogram:FILE[:SEED] as lengths;
    exits 2 naming the value."""
    if text.startswith("histogram:"):
        return _histogram_lengths(parser, text.removeprefix("histogram:"), seq_length)
    fields = text.split(":")
    usage = (f"--doc-length-dist {text!r}: give lognormal:MEDIAN:MAX[:SEED] with integers "
             "1 <= MEDIAN <= MAX and SEED >= 0")
    if fields[0] != "lognormal" or len(fields) not in (3, 4):
        parser.error(usage)
    try:
        median, longest, *seed = (int(f) for f in fields[1:])
    except ValueError:
        parser.error(usage)
    if not 1 <= median <= longest or (seed and seed[0] < 0):
        parser.error(usage)
    return lognormal_lengths(seq_length, median, longest, seed[0] if seed else 0)


def _histogram_lengths(parser: argparse.ArgumentParser, text: str, seq_length: int
                       ) -> tuple[int, ...]:
    """histogram:FILE[:SEED]: lengths drawn from the file's histogram (a path may hold ':',
    so a last ':N' is the seed only when FILE:N is not a file)."""
    path, seed = text, 0
    head, _, tail = text.rpartition(":")
    if head and tail.isdigit() and not os.path.exists(text):
        path, seed = head, int(tail)
    try:
        return LengthHistogram.read(path).draw(seq_length, seed)
    except ValueError as e:
        parser.error(f"--doc-length-dist histogram:{text}: {e}")


def _window(args: argparse.Namespace) -> tuple[Window | None, LayerMix | None]:
    """--window-size, --window-attn-skip-freq and --num-layers as the checked window and
    the model's layers (None, None without a window); exits 2 naming the bad value."""
    parser: argparse.ArgumentParser = args.command_parser
    if args.window_size is None:
        for flag in ("window_attn_skip_freq", "num_layers"):
            if getattr(args, flag) is not None:
                parser.error(f"--{flag.replace('_', '-')} needs --window-size")
        return None, None
    text = args.window_size
    try:
        sides = tuple(int(n) for n in text.split(","))
    except ValueError:
        sides = ()
    if len(sides) not in (1, 2):
        parser.error(f"--window-size {text!r}: give L or L,R, integers >= -1 (-1: unbounded)")
    left, right = sides if len(sides) == 2 else (sides[0], 0)
    try:
        window = window_of((left, right), args.causal)
    except ValueError as exc:
        parser.error(f"--window-size {text}: {exc}")
    if window is None:
        parser.error(f"--window-size {text} limits nothing (unbounded on both sides"
                     + (", causal" if args.causal else "") + "); leave it out for full attention")
    layers = args.num_layers or args.window_attn_skip_freq or 1
    return window, LayerMix(layers, args.window_attn_skip_freq)


def _fills_nodes(gpus: int, gpus_per_node: int) -> bool:
    """One partial node, or whole nodes."""
    return gpus <= gpus_per_node or gpus % gpus_per_node == 0


def _check_plot_path(parser: argparse.ArgumentParser, path: str) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        parser.error(f"--plot needs matplotlib: {INSTALL_HINT}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        parser.error(f"--plot {path}: folder {folder} does not exist; create it or name another")
    if not os.access(folder, os.W_OK):
        parser.error(f"--plot {path}: folder {folder} is not writable")


def _tensor_parallel(args: argparse.Namespace) -> TensorParallel:
    """--tensor-model-parallel-size with the GPUs and heads it divides, and the head dim
    (of the model's heads); exits 2 naming a value that does not divide."""
    parser: argparse.ArgumentParser = args.command_parser
    if args.head_dim is None and args.hidden_size is None:
        parser.error("give --head-dim or --hidden-size (head dim = hidden size / heads)")
    try:
        args.head_dim = resolve_head_dim(args.num_heads, args.head_dim, args.hidden_size)
    except ValueError as exc:
        parser.error(str(exc))
    kv = args.num_heads if args.num_kv_heads is None else args.num_kv_heads
    tp = TensorParallel(args.tp, args.gpus, args.gpus_per_node, args.num_heads, kv)
    problems = tp.problems()
    if problems:
        parser.error(problems[0])
    return tp


def _run_plan(args: argparse.Namespace) -> int:
    parser: argparse.ArgumentParser = args.command_parser
    args.tensor = tp = _tensor_parallel(args)
    if not _fills_nodes(args.gpus, args.gpus_per_node):
        fits = [n * args.gpus_per_node for n in (args.gpus // args.gpus_per_node,
                                                 args.gpus // args.gpus_per_node + 1)]
        parser.error(f"--gpus-per-node {args.gpus_per_node} does not divide --gpus {args.gpus}: "
                     f"give whole nodes (e.g. --gpus {fits[0]} or {fits[1]}) or another "
                     "--gpus-per-node")
    if args.gpu is not None and args.attention_tflops is not None:
        parser.error(f"--gpu {args.gpu} prices attention by its profile of kernel calls; "
                     f"--attention-tflops {args.attention_tflops:g} is a flat rate: give one")
    if args.gpu is None and args.mesh_kernel != DEFAULT_BACKEND:
        parser.error(f"--mesh-kernel {args.mesh_kernel} names the kernel whose calls a GPU "
                     "profile prices: give --gpu (h100 or h200) with it")
    if args.inference and args.window_attn_skip_freq is not None:
        parser.error(f"--window-attn-skip-freq {args.window_attn_skip_freq}: --inference prices "
                     "one layer (prefill and a decode step), not a mix of windowed and global "
                     "layers; drop it or run without --inference")
    if args.plot:
        if args.inference:
            parser.error("--plot draws training's speedups; it does not take --inference "
                         "(the inference table is printed)")
        _check_plot_path(parser, args.plot)
    args.documents = _documents(args)
    window, layers = _window(args)
    try:
        result = _plan(args, tp.cp_size, window)
        if args.inference:
            print(json.dumps(inference_report(result, args.hbm_bw), indent=2) if args.json
                  else format_inference(result, args.hbm_bw))
            return 0
        if layers is not None:
            full = _plan(args, tp.cp_size) if layers.full else None
            mixed = model_plan(result, full, layers)
        placed = None if args.documents is None else price_placement(result)
    except ValueError as exc:
        parser.error(str(exc))
    choice = mixed.best_grid if layers is not None else result.best_grid.grid_shape
    if placed is not None:
        choice = placed.best.grid_shape
    flags = driver_flags(tp.cp_size, choice, tp.size, args.mesh_schedule,
                         args.mesh_grad_reduce_dtype, placed_documents=placed is not None,
                         window=None if window is None else (window.left, window.right),
                         window_attn_skip_freq=args.window_attn_skip_freq)
    if args.json:
        data = model_to_dict(mixed) if layers is not None else plan_to_dict(result)
        data["tensor_model_parallel_size"] = tp.size
        data["driver_flags"] = flags
        if placed is not None:
            data["placed"] = placed_to_dict(result, placed)
        print(json.dumps(data, indent=2))
    else:
        if tp.size > 1:
            print(tp.describe())
        if layers is not None:
            _print_model(mixed, tp.size)
        else:
            print(format_table(result, tp.size))
        if placed is not None:
            print(format_placed(result, placed))
        print(f"driver flags of the choice (mesh {'x'.join(map(str, choice))}):\n  "
              + " ".join(flags))
    if args.plot:
        plans = [_plan(args, n, window) for n in gpu_counts(tp.cp_size, args.seq_length)
                 if _fills_nodes(n, tp.cp_per_node)]
        draw(plans, args.plot, tp.size)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def _print_model(mixed: ModelPlan, tensor_parallel: int = 1) -> None:
    """The windowed layer's table, the global layer's (when the model has any) and the
    whole model's verdict."""
    print(f"windowed layers ({mixed.layers.windowed} of {mixed.layers.num_layers}):")
    print(format_table(mixed.windowed, tensor_parallel))
    if mixed.full is not None:
        print(f"\nglobal layers ({mixed.layers.full} of {mixed.layers.num_layers}): "
              "full attention")
        print(format_table(mixed.full, tensor_parallel))
    print()
    print(format_model(mixed))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "plan":
        return _run_plan(args)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
