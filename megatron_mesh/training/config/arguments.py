"""Command line of the pretraining driver: Megatron-LM's flag names, YAML configs, checks.

Precedence: built-in defaults < ``--config FILE.yaml`` < flags on the command line. A YAML
key is a flag name without the leading dashes (``num-layers`` or ``num_layers``).
Every check here runs before any process group exists, so a bad flag exits at once with a
message on every rank instead of leaving the others waiting in a collective.
"""
from __future__ import annotations

import argparse
import difflib
import importlib.util
import os
import re
from typing import Any, NoReturn, Sequence

import torch

from megatron_mesh.dtypes import flag_dtype_name
from megatron_mesh.megatron.arguments import (
    MESH,
    add_mesh_args,
    attention_head_dims,
    check_mesh_kernel,
    is_mesh,
    validate_mesh_args,
)
from megatron_mesh.megatron.compat import have_transformer_engine, mla_unbuildable_reason
from megatron_mesh.megatron.sink import SOFTMAX_TYPES  # megatron-core's config.softmax_type
from megatron_mesh.training.config import input_checks as validation
from megatron_mesh.training.config import schedule_length
from megatron_mesh.training.config.megatron_lm_flags import add_no_effect_flags
from megatron_mesh.training.config.training_config import TrainingConfig, config_class, freeze
from megatron_mesh.training.data import tokenizer_check
from megatron_mesh.training.data.document_ranks import add_placement_args, resolve_placement_args
from megatron_mesh.training.job.device import has_cuda
from megatron_mesh.training.job.staged_cp_ranks import (
    add_host_staging_args,
    check_host_staging,
    default_backend,
)
from megatron_mesh.training.model.core_attention import core_attention, te_layers
from megatron_mesh.training.model.moe import add_moe_args, check_moe_args

DEFAULT_TRAIN_ITERS = 10
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")
TOKENIZER_TYPES = ("NullTokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer",
                   "SentencePieceTokenizer", "TikTokenizer")
POSITION_EMBEDDINGS = ("learned_absolute", "rope", "none")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")


class ConfigError(ValueError):
    """A flag or config value that cannot work; the driver exits with its message."""


ATTENTION_BACKENDS = ("auto", "flash", "local")

MLA_DIMS: dict[str, int | None] = {
    "q_lora_rank": None,
    "kv_lora_rank": 32,
    "qk_head_dim": 128,
    "qk_pos_emb_head_dim": 64,
    "v_head_dim": 128,
}
"""The multi-latent attention sizes and Megatron-LM's defaults for them (q_lora_rank None:
Q is projected without a low-rank step); they take effect with --multi-latent-attention."""


class _Parser(argparse.ArgumentParser):
    """argparse's own errors (an unknown flag, a bad choice) as ConfigError: one line, like
    every other flag error, instead of the whole usage."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{message} (see --help)")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's "(default: X)" after each flag's help, unless the help states its default
    itself ("default 4 * hidden size", "(default: one per attention head)")."""

    STATES_DEFAULT = re.compile(r"(^|[(,;.]\s*)default\b", re.IGNORECASE)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.help and self.STATES_DEFAULT.search(action.help):
            return action.help
        return super()._get_help_string(action)


def _flag(parser: argparse._ActionsContainer, name: str, **kw: Any) -> None:
    if kw.get("type") is bool:
        kw.pop("type")
        # a negative flag (--no-load-optim) is a plain switch, as in Megatron-LM
        kw["action"] = "store_true" if name.startswith("--no-") else argparse.BooleanOptionalAction
    parser.add_argument(name, **kw)


def build_parser() -> argparse.ArgumentParser:
    """All flags of ``python -m megatron_mesh.pretrain_gpt``; names follow Megatron-LM."""
    p = _Parser(
        prog="python -m megatron_mesh.pretrain_gpt",
        description="Pretrain a GPT model on megatron-core with mesh context parallelism.",
        formatter_class=HelpFormatter,
        allow_abbrev=False,  # as Megatron-LM: a prefix of a flag is an error, not that flag
    )
    p.add_argument("--config", default=None, help="YAML file of flag values (flags override it)")

    g = p.add_argument_group("model")
    _flag(g, "--num-layers", type=int, default=2)
    _flag(g, "--hidden-size", type=int, default=64)
    _flag(g, "--ffn-hidden-size", type=int, default=None, help="default 4 * hidden size")
    _flag(g, "--num-attention-heads", type=int, default=4)
    _flag(g, "--group-query-attention", type=bool, default=False)
    _flag(g, "--num-query-groups", type=int, default=None,
          help="K/V heads with --group-query-attention (default: one per attention head)")
    _flag(g, "--kv-channels", type=int, default=None, help="head dim, default hidden / heads")
    _flag(g, "--max-position-embeddings", type=int, default=None, help="default seq length")
    _flag(g, "--position-embedding-type", default="learned_absolute", choices=POSITION_EMBEDDINGS)
    _flag(g, "--rotary-base", type=int, default=10000)
    _flag(g, "--rotary-percent", type=float, default=1.0,
          help="with --position-embedding-type rope: the share of each head's dims rotated "
               "(megatron-core's rotary_percent)")
    _flag(g, "--normalization", default="LayerNorm", choices=NORMALIZATIONS)
    _flag(g, "--norm-epsilon", type=float, default=1e-5)
    _flag(g, "--swiglu", type=bool, default=False)
    _flag(g, "--disable-bias-linear", type=bool, default=False)
    _flag(g, "--untie-embeddings-and-output-weights", type=bool, default=False)
    _flag(g, "--hidden-dropout", type=float, default=0.0)
    _flag(g, "--attention-dropout", type=float, default=0.0)
    _flag(g, "--window-size", type=int, nargs=2, default=None, metavar=("LEFT", "RIGHT"),
          help="sliding window (left, right) as Transformer Engine defines it, -1 unbounded; "
          "causal: right 0 or -1")
    _flag(g, "--window-attn-skip-freq", type=int, default=None,
          help="with --window-size, every n-th layer is global (full causal attention)")
    _flag(g, "--softmax-type", default="vanilla", choices=SOFTMAX_TYPES,
          help="attention sinks: off-by-one adds a logit 0 to every softmax row, learnable "
               "one learned logit per head (gpt-oss)")
    _flag(g, "--qk-layernorm", type=bool, default=False,
          help="normalize queries and keys per head (--normalization) before attention")
    _flag(g, "--multi-latent-attention", type=bool, default=False,
          help="multi-latent attention (megatron-core's MLASelfAttention): K and V from a "
               "low-rank latent, Q / K head dim --qk-head-dim + --qk-pos-emb-head-dim, V head "
               "dim --v-head-dim; needs megatron-core >= 0.17 or Transformer Engine")
    mla_help = {
        "q_lora_rank": "with --multi-latent-attention: rank of Q's low-rank projection "
                       "(default: none, Q projected directly)",
        "kv_lora_rank": "with --multi-latent-attention: rank of K and V's low-rank latent",
        "qk_head_dim": "with --multi-latent-attention: Q / K head dim without the RoPE part",
        "qk_pos_emb_head_dim": "with --multi-latent-attention: the RoPE part of the Q / K "
                               "head dim",
        "v_head_dim": "with --multi-latent-attention: V head dim",
    }
    for name, default in MLA_DIMS.items():
        _flag(g, "--" + name.replace("_", "-"), type=int, default=default, help=mla_help[name])
    _flag(g, "--init-method-std", type=float, default=0.02)
    _flag(g, "--make-vocab-size-divisible-by", type=int, default=128)

    g = p.add_argument_group("training")
    _flag(g, "--seq-length", type=int, default=64)
    _flag(g, "--micro-batch-size", type=int, default=1)
    _flag(g, "--global-batch-size", type=int, default=None,
          help="default micro batch size * data-parallel size")
    _flag(g, "--train-iters", type=int, default=None,
          help=f"iterations to train (default {DEFAULT_TRAIN_ITERS}); exclusive with "
               "--train-samples")
    _flag(g, "--train-samples", type=int, default=None,
          help="samples to train: iterations = samples / --global-batch-size (with "
               "--rampup-batch-size, the ramp's batches first), as in Megatron-LM")
    _flag(g, "--rampup-batch-size", type=int, nargs=3, default=None,
          metavar=("START", "INCREMENT", "SAMPLES"),
          help="with --train-samples: start at global batch START, grow by INCREMENT evenly "
               "over SAMPLES samples up to --global-batch-size (megatron-core's ramp-up "
               "calculator)")
    _flag(g, "--skip-train", type=bool, default=False,
          help="no training: evaluate the (loaded) model on the validation and test sets")
    _flag(g, "--calculate-per-token-loss", type=bool, default=False,
          help="the loss of an iteration is the sum of its token losses over the global batch "
               "divided by the batch's token count (default: the mean of the micro-batches' "
               "per-token means)")
    _flag(g, "--exit-interval", type=int, default=None,
          help="stop (and save) at the first iteration divisible by this")
    _flag(g, "--seed", type=int, default=1234)
    _flag(g, "--bf16", type=bool, default=False)
    _flag(g, "--fp16", type=bool, default=False)
    _flag(g, "--use-distributed-optimizer", type=bool, default=False,
          help="shard the optimizer state (and fp32 main weights) over DP x CP: megatron-core's "
               "DistributedOptimizer, also on a CPU (Adam)")
    _flag(g, "--overlap-grad-reduce", type=bool, default=False,
          help="megatron-core's DDP reduces each gradient bucket as soon as backward has "
               "filled it, overlapping the reduction with the rest of backward")
    _flag(g, "--overlap-param-gather", type=bool, default=False,
          help="with --use-distributed-optimizer and --overlap-grad-reduce: the updated "
               "parameters are gathered bucket by bucket in the next forward pass")
    _flag(g, "--recompute-granularity", default=None, choices=("full", "selective"),
          help="selective: recompute core attention (the mesh re-runs its forward, "
               "communication included) in backward; full: whole layers")
    _flag(g, "--recompute-method", default=None, choices=("uniform", "block"),
          help="with --recompute-granularity full (default uniform)")
    _flag(g, "--recompute-num-layers", type=int, default=None,
          help="with --recompute-granularity full (default 1)")

    g = p.add_argument_group("optimizer and learning rate")
    _flag(g, "--optimizer", default="adam", choices=("adam", "sgd"))
    _flag(g, "--lr", type=float, default=1e-3)
    _flag(g, "--min-lr", type=float, default=0.0)
    _flag(g, "--lr-decay-style", default="cosine", choices=LR_DECAY_STYLES)
    _flag(g, "--lr-decay-iters", type=int, default=None, help="default --train-iters")
    _flag(g, "--lr-decay-samples", type=int, default=None,
          help="with --train-samples: decay over this many samples (default --train-samples)")
    _flag(g, "--lr-warmup-iters", type=int, default=0)
    _flag(g, "--lr-warmup-samples", type=int, default=0,
          help="with --train-samples: linear warmup over this many samples")
    _flag(g, "--lr-warmup-fraction", type=float, default=None)
    _flag(g, "--weight-decay", type=float, default=0.01)
    _flag(g, "--adam-beta1", type=float, default=0.9)
    _flag(g, "--adam-beta2", type=float, default=0.95)
    _flag(g, "--adam-eps", type=float, default=1e-8)
    _flag(g, "--sgd-momentum", type=float, default=0.9)
    _flag(g, "--clip-grad", type=float, default=1.0)
    g.add_argument("--override-opt_param-scheduler", action="store_true", default=False,
                   help="on --load: use this command line's learning-rate / weight-decay "
                        "schedule instead of the checkpoint's")
    g.add_argument("--use-checkpoint-opt_param-scheduler", action="store_true", default=False,
                   help="on --load: keep the checkpoint's learning-rate / weight-decay schedule, "
                        "whatever this command line says (default: a difference is an error)")

    g = p.add_argument_group("parallelism")
    _flag(g, "--tensor-model-parallel-size", type=int, default=1)
    _flag(g, "--pipeline-model-parallel-size", type=int, default=1)
    _flag(g, "--context-parallel-size", type=int, default=1)
    _flag(g, "--sequence-parallel", type=bool, default=False,
          help="with TP > 1: activations outside the linears sharded over TP along the sequence")
    _flag(g, "--distributed-backend", default=None, choices=("nccl", "gloo"),
          help="default nccl with CUDA, gloo without")
    _flag(g, "--distributed-timeout-minutes", type=float, default=10.0,
          help="collective timeout: a dead peer ends the job after at most this long")
    add_host_staging_args(g)
    _flag(g, "--transformer-impl", default="auto", choices=("auto", "local", "transformer_engine"),
          help="auto: Transformer Engine when installed and on a GPU, else local")
    _flag(g, "--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
          help="core attention: auto = Transformer Engine's with TE layers, else the mesh's "
               "fused tile kernel (flash / cuDNN; at CP = 1 one call over the sequence); "
               "flash = the mesh tile kernel also with TE layers at CP = 1; local = "
               "megatron-core's local layers, unfused attention (S x S scores; CP = 1 only)")
    add_mesh_args(p)
    add_placement_args(p)
    add_moe_args(p)

    g = p.add_argument_group("data")
    _flag(g, "--data-path", nargs="*", default=None,
          help="Megatron indexed dataset prefixes (PREFIX.bin/.idx), optionally weighted: "
               "[W1] P1 [W2] P2 ...; mock data when omitted")
    _flag(g, "--mock-data", type=bool, default=False, help="synthetic data (default without --data-path)")
    _flag(g, "--split", default="969,30,1",
          help="TRAIN,VALID,TEST weights: the documents of --data-path go to the training, "
               "validation and test sets in these proportions")
    _flag(g, "--train-data-path", nargs="*", default=None,
          help="with --valid-data-path / --test-data-path instead of --data-path and --split: "
               "the training set's prefixes ([W1] P1 ...)")
    _flag(g, "--valid-data-path", nargs="*", default=None,
          help="the validation set's prefixes (without --data-path; see --train-data-path)")
    _flag(g, "--test-data-path", nargs="*", default=None,
          help="the test set's prefixes (without --data-path; see --train-data-path)")
    _flag(g, "--data-cache-path", default=None)
    _flag(g, "--tokenizer-type", default="NullTokenizer", choices=TOKENIZER_TYPES)
    _flag(g, "--tokenizer-model", default=None, help="tokenizer file or HF name / directory")
    _flag(g, "--vocab-file", default=None)
    _flag(g, "--merge-file", default=None)
    _flag(g, "--vocab-size", type=int, default=None, help="vocabulary of the NullTokenizer")
    _flag(g, "--eod-mask-loss", type=bool, default=False)
    _flag(g, "--reset-position-ids", type=bool, default=False)
    _flag(g, "--reset-attention-mask", type=bool, default=False)
    _flag(g, "--num-workers", type=int, default=0,
          help="torch DataLoader worker processes reading the samples (0: the training "
               "process reads them; Megatron-LM's default is 2); the batches are the same")

    g = p.add_argument_group("checkpointing")
    _flag(g, "--save", default=None, help="checkpoint directory")
    _flag(g, "--load", default=None, help="resume from this checkpoint directory")
    _flag(g, "--save-interval", type=int, default=None)
    _flag(g, "--ckpt-step", type=int, default=None, help="load this iteration instead of the latest")
    _flag(g, "--no-load-optim", type=bool, default=False)
    _flag(g, "--no-load-rng", type=bool, default=False)
    _flag(g, "--finetune", type=bool, default=False, help="load weights only, start at iteration 0")
    _flag(g, "--use-checkpoint-args", type=bool, default=False,
          help="take the model's shape (layers, hidden size, heads, query groups, FFN size, "
               "sequence length) from the checkpoint at --load instead of the flags")

    g = p.add_argument_group("evaluation")
    _flag(g, "--eval-interval", type=int, default=1000,
          help="evaluate on the validation set every this many iterations")
    _flag(g, "--eval-iters", type=int, default=100,
          help="global batches per evaluation (0: no validation or test evaluation)")

    g = p.add_argument_group("logging")
    _flag(g, "--log-interval", type=int, default=1)
    _flag(g, "--tensorboard-dir", default=None,
          help="write TensorBoard event files here (on the last rank)")
    _flag(g, "--tensorboard-log-interval", type=int, default=1,
          help="iterations between TensorBoard points of the training series")
    _flag(g, "--tensorboard-queue-size", type=int, default=1000,
          help="TensorBoard events held in memory before they are written")
    _flag(g, "--log-timers-to-tensorboard", type=bool, default=False,
          help="also write the iteration time (seconds) to TensorBoard")
    _flag(g, "--log-validation-ppl-to-tensorboard", type=bool, default=False,
          help="also write the validation perplexity to TensorBoard")
    _flag(g, "--log-world-size-to-tensorboard", type=bool, default=False,
          help="also write the world size to TensorBoard")
    _flag(g, "--wandb-project", default=None)
    _flag(g, "--wandb-exp-name", default=None)
    _flag(g, "--wandb-save-dir", default=None)
    validation.add_fault_tolerance_args(p)
    add_no_effect_flags(p)
    return p


# the class of the frozen, typed flags (training_config.py), bound here: it pickles by name
_CONFIG = config_class(build_parser(), home=(__name__, "_CONFIG"))


def _dest(key: str) -> str:
    return key.strip().lstrip("-").replace("-", "_")


def load_config(path: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """YAML file -> {dest: value}; unknown keys are an error naming the valid ones."""
    if not os.path.isfile(path):
        raise ConfigError(f"--config {path}: no such file")
    try:
        import yaml
    except ModuleNotFoundError:
        raise ConfigError(f"--config {path}: reading YAML needs PyYAML, part of the 'megatron' "
                          "extra: pip install 'megatron-mesh[megatron]'") from None
    with open(path) as f:
        raw = yaml.safe_load(f) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"--config {path}: expected a mapping of flag names to values")
    known = {a.dest for a in parser._actions} - {"help", "config"}
    values = {_dest(k): v for k, v in raw.items()}
    unknown = [str(k) for k in raw if _dest(str(k)) not in known]
    if unknown:
        raise ConfigError(f"--config {path}: " + "; ".join(_unknown_key(k, known) for k in unknown)
                          + "; see --help for valid flags")
    return values


def _unknown_key(key: str, known: set[str]) -> str:
    """'unknown key K' as written in the file, with the nearest valid key in its style."""
    dashes = "-" in key.strip().lstrip("-")
    near = difflib.get_close_matches(_dest(key), sorted(known), n=1)
    if not near:
        return f"unknown key {key!r}"
    name = near[0].replace("_", "-") if dashes else near[0]
    return f"unknown key {key!r} (did you mean {name!r}?)"


def parse_args(argv: Sequence[str] | None = None,
               defaults: dict[str, Any] | None = None) -> TrainingConfig:
    """Parse flags over an optional YAML config, check them and derive the rest, once; the
    result is frozen. `defaults` ({dest: value}; generation's: the checkpoint's model) replace
    the built-in ones, under the config and the flags. Raises ConfigError on bad values."""
    parser = build_parser()
    parser.set_defaults(**(defaults or {}))
    pre, _ = parser.parse_known_args(argv)
    if pre.config:
        parser.set_defaults(**schedule_length.drop_other_mode(load_config(pre.config, parser),
                                                              pre))
    args = parser.parse_args(argv)
    for action in parser._actions:  # argparse checks choices on the command line only
        value = getattr(args, action.dest, None)
        if action.choices and value is not None and value not in action.choices:
            raise ConfigError(f"{action.option_strings[0]} {value!r} (from --config): valid "
                              f"values are {', '.join(map(str, action.choices))}")
    if args.use_checkpoint_args:
        _use_checkpoint_args(args)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    validate_args(args, world_size)
    return freeze(args, _CONFIG)


def _use_checkpoint_args(args: argparse.Namespace) -> None:
    """--use-checkpoint-args: the checkpoint's model shape replaces the flags'."""
    from megatron_mesh.training.checkpoints.checkpoint_args import apply_checkpoint_args

    try:
        changed = apply_checkpoint_args(args, build_parser())
    except ValueError as e:
        _fail(str(e))
    if changed and os.environ.get("RANK", "0") == "0":
        print(f" --use-checkpoint-args: from the checkpoint {', '.join(changed)}", flush=True)


def _fail(msg: str) -> None:
    raise ConfigError(msg)


def _check_document_masking(args: argparse.Namespace, cp: int) -> None:
    """--reset-attention-mask packs each micro-batch's documents as THD sequences
    (`training/data/packing.py`); fail for what cannot take them."""
    if args.attention_backend == "local":
        _fail("--reset-attention-mask with --attention-backend local: megatron-core's local "
              "attention takes no packed documents; use --attention-backend auto or flash")
    if cp > 1 and args.context_parallel_algo == "all_gather":
        _fail("--reset-attention-mask with --context-parallel-algo all_gather: Transformer "
              "Engine's all_gather CP takes no packed (THD) documents; use mesh, p2p, a2a or "
              "a2a+p2p")


def _check_rotary(args: argparse.Namespace) -> None:
    """--rotary-percent: in (0, 1], only with RoPE, rotating an even number of head dims."""
    pct = args.rotary_percent
    if pct == 1.0:
        return
    if args.position_embedding_type != "rope" or args.multi_latent_attention:
        _fail(f"--rotary-percent {pct} needs --position-embedding-type rope (without "
              "--multi-latent-attention, whose rotated dims are --qk-pos-emb-head-dim)")
    if not 0.0 < pct <= 1.0:
        _fail(f"--rotary-percent {pct}: must be in (0, 1]")
    head = args.kv_channels or args.hidden_size // max(1, args.num_attention_heads)
    rotated = int(head * pct)
    if rotated < 2 or rotated % 2:
        _fail(f"--rotary-percent {pct} rotates {rotated} of the {head} head dims; it must be "
              "an even number, at least 2")


def _check_resume_flags(args: argparse.Namespace) -> None:
    """The LR-schedule-on-resume switches (exclusive) and the overlap flags' requirements."""
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        _fail("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler are "
              "exclusive: the first takes this command line's LR schedule on --load, the "
              "second the checkpoint's; give one")
    if args.overlap_param_gather and not (args.use_distributed_optimizer
                                          and args.overlap_grad_reduce):
        _fail("--overlap-param-gather needs --use-distributed-optimizer and "
              "--overlap-grad-reduce (megatron-core gathers the parameters the distributed "
              "optimizer updated, overlapped with the next forward)")


def _check_window(args: argparse.Namespace) -> None:
    """--window-size: a causal window (right 0 or -1, both >= -1); --window-attn-skip-freq
    a positive integer, only with a window."""
    from megatron_mesh.masks.window import window_of

    if args.window_size is not None:
        try:
            window_of(tuple(args.window_size), causal=True)
        except ValueError as e:
            _fail(f"--window-size {' '.join(map(str, args.window_size))}: {e}")
    freq = args.window_attn_skip_freq
    if freq is not None and (args.window_size is None or freq < 1):
        _fail(f"--window-attn-skip-freq {freq} needs --window-size and must be >= 1")


def _check_mla(args: argparse.Namespace) -> None:
    """--multi-latent-attention: positive sizes (--q-lora-rank may stay unset), no GQA and
    no --kv-channels (MLA has its own head dims), a megatron-core that builds it. Without
    it, an MLA size other than Megatron-LM's default is refused (it would do nothing)."""
    if not args.multi_latent_attention:
        for name, default in MLA_DIMS.items():
            if getattr(args, name) != default:
                _fail(f"{_flag_name(name)} {getattr(args, name)} needs --multi-latent-attention "
                      "(it sizes multi-latent attention; without it the attention head dim is "
                      "--kv-channels)")
        return
    for name in MLA_DIMS:
        value = getattr(args, name)
        if value is None and name == "q_lora_rank":
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            _fail(f"{_flag_name(name)} {value}: must be a positive integer with "
                  "--multi-latent-attention")
    if args.group_query_attention:
        _fail("--multi-latent-attention and --group-query-attention are exclusive (MLA's K and V "
              "come from one latent for all heads, as in Megatron-LM); drop "
              "--group-query-attention")
    if args.kv_channels is not None:
        _fail(f"--kv-channels {args.kv_channels} with --multi-latent-attention: MLA's head dims "
              "are --qk-head-dim + --qk-pos-emb-head-dim (Q, K) and --v-head-dim (V); drop "
              "--kv-channels")
    if args.attention_backend == "local":
        _fail("--attention-backend local with --multi-latent-attention: megatron-core's local "
              "attention takes no head dims of its own for K and V; use --attention-backend "
              "auto or flash")
    reason = mla_unbuildable_reason()
    if reason is not None:
        _fail(f"--multi-latent-attention: {reason}; use megatron-core >= 0.17 (0.19.2 is "
              "tested) or install Transformer Engine")


def validate_args(args: argparse.Namespace, world_size: int) -> None:
    """Check flags against each other and the world size; fill in derived defaults."""
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                 "micro_batch_size", "tensor_model_parallel_size",
                 "pipeline_model_parallel_size", "context_parallel_size", "log_interval"):
        if getattr(args, name) is None or getattr(args, name) < 1:
            _fail(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    try:
        validation.validate_inputs(args, world_size)
    except ValueError as e:
        _fail(str(e))
    if args.bf16 and args.fp16:
        _fail("--bf16 and --fp16 are exclusive")
    _check_rotary(args)
    _check_resume_flags(args)
    _check_window(args)
    _check_mla(args)
    args.distributed_backend = args.distributed_backend or default_backend(args, has_cuda())
    if args.distributed_backend == "nccl" and not has_cuda():
        _fail("--distributed-backend nccl needs CUDA; use gloo on a CPU")
    pp = args.pipeline_model_parallel_size
    if args.num_layers % pp:
        _fail(f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size "
              f"{pp}: every stage holds the same number of layers; use a divisor of "
              f"{args.num_layers} ({', '.join(str(d) for d in _divisors(args.num_layers))})")
    if args.recompute_granularity == "full":
        args.recompute_method = args.recompute_method or "uniform"
        args.recompute_num_layers = args.recompute_num_layers or 1
    elif args.recompute_method or args.recompute_num_layers:
        _fail("--recompute-method / --recompute-num-layers need --recompute-granularity full")
    if not args.group_query_attention:
        if args.num_query_groups not in (None, args.num_attention_heads):
            _fail("--num-query-groups needs --group-query-attention")
        args.num_query_groups = args.num_attention_heads
    elif args.num_query_groups is None or args.num_attention_heads % args.num_query_groups:
        _fail(f"--num-query-groups {args.num_query_groups} must divide --num-attention-heads "
              f"{args.num_attention_heads}")
    if args.kv_channels is None and not args.multi_latent_attention:
        if args.hidden_size % args.num_attention_heads:
            _fail(f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
                  f"{args.num_attention_heads}; give --kv-channels")
        args.kv_channels = args.hidden_size // args.num_attention_heads
    args.k_channels, args.v_channels = attention_head_dims(args)  # the core attention's
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
        if args.swiglu:  # about the 4h MLP's parameters, a multiple of 64: Megatron-LM's width
            args.ffn_hidden_size = int(2 * args.ffn_hidden_size / 3 / 64) * 64
            if args.ffn_hidden_size < 1:
                _fail(f"--swiglu with --hidden-size {args.hidden_size}: Megatron-LM's width "
                      "(8h/3 rounded down to a multiple of 64) is 0; give --ffn-hidden-size "
                      "or --hidden-size 24 or more")
    try:
        check_moe_args(args, world_size)
    except ValueError as e:
        _fail(str(e))
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.position_embedding_type == "learned_absolute" and (
            args.max_position_embeddings < args.seq_length):
        _fail(f"--max-position-embeddings {args.max_position_embeddings} < --seq-length "
              f"{args.seq_length}")

    tp, cp = args.tensor_model_parallel_size, args.context_parallel_size
    try:  # the mesh shape is decided here, once; the grids are built from args.mesh_shape
        shape = validate_mesh_args(args, packed_documents=True)
    except ValueError as e:
        _fail(str(e))
    if shape is not None:
        args.mesh_shape = shape
    if args.context_parallel_algo is None:
        _fail(f"--cp-comm-type {' '.join(args.cp_comm_type)}: this driver runs one algorithm in "
              "every layer; give one value")
    try:
        check_host_staging(args)
    except ValueError as e:
        _fail(str(e))
    if cp > 1 and not is_mesh(args.context_parallel_algo) and not have_transformer_engine():
        _fail(f"--context-parallel-algo {args.context_parallel_algo} with --context-parallel-size "
              f"{cp} needs Transformer Engine, which is not installed; use "
              "--context-parallel-algo mesh (works without it) or install transformer-engine")
    if not is_mesh(args.context_parallel_algo):  # validate_mesh_args checked the mesh's kernel
        try:  # the mesh's core attention runs under other algorithms too (no TE layers, ...)
            if core_attention(args.attention_backend, args.context_parallel_algo, cp,
                              te_layers(args.transformer_impl)) == MESH:
                check_mesh_kernel(args)
        except (ValueError, RuntimeError) as e:
            _fail(str(e))
    if args.attention_backend == "local" and (args.attention_chunk_size or args.mesh_mask_builder):
        _fail("--attention-chunk-size / --mesh-mask-builder with --attention-backend local: "
              "megatron-core's local attention takes no such mask; use --attention-backend auto")
    if args.attention_backend == "local" and cp > 1:
        _fail(f"--attention-backend local with --context-parallel-size {cp}: megatron-core's "
              "local attention has no context parallelism; use --attention-backend auto or flash")
    if (args.bf16 or args.fp16) and not torch.cuda.is_available():
        _fail(f"--{flag_dtype_name(args.bf16, args.fp16)} needs CUDA; CPU runs train in fp32 (drop the flag)")
    if args.use_distributed_optimizer and args.optimizer != "adam" and not has_cuda():
        _fail(f"--use-distributed-optimizer with --optimizer {args.optimizer} on a CPU: "
              "megatron-core's distributed optimizer over torch's optimizers (no Transformer "
              "Engine / Apex) keeps and checkpoints Adam's state only; use --optimizer adam, or "
              "drop --use-distributed-optimizer")
    if args.reset_attention_mask:
        _check_document_masking(args, cp)
    if args.sequence_parallel and tp == 1:
        args.sequence_parallel = False
    if args.sequence_parallel and (args.seq_length // cp) % tp:
        _fail(f"--sequence-parallel: the {args.seq_length // cp} tokens per context-parallel rank "
              f"(--seq-length {args.seq_length} / CP {cp}) are not divisible by "
              f"--tensor-model-parallel-size {tp}; use a sequence length divisible by CP x TP = "
              f"{cp * tp} (or drop --sequence-parallel)")
    if args.num_attention_heads % tp or args.num_query_groups % tp:
        _fail(f"--tensor-model-parallel-size {tp} must divide the attention heads "
              f"({args.num_attention_heads}) and query groups ({args.num_query_groups})")
    if world_size % (tp * cp * pp):
        _fail(f"world size {world_size} is not divisible by tensor-parallel {tp} x "
              f"context-parallel {cp} x pipeline-parallel {pp}; launch with torchrun "
              f"--nproc-per-node {tp * cp * pp} (or a multiple)")
    args.world_size = world_size
    args.data_parallel_size = world_size // (tp * cp * pp)
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size % per_step:
        _fail(f"--global-batch-size {args.global_batch_size} is not divisible by micro batch "
              f"{args.micro_batch_size} x data-parallel {args.data_parallel_size}")
    args.num_microbatches = args.global_batch_size // per_step
    try:
        schedule_length.resolve(args, DEFAULT_TRAIN_ITERS)
    except ValueError as e:
        _fail(str(e))
    if args.save_interval is not None and args.save_interval < 1:
        _fail(f"--save-interval must be positive, got {args.save_interval}")
    if args.save and importlib.util.find_spec("psutil") is None:
        _fail("--save needs psutil (megatron-core's checkpoint writer uses it): pip install psutil")
    _validate_data(args)
    _validate_evaluation(args)
    _check_logger_packages(args)
    resolve_placement_args(args, _fail)


_SPLIT_PATHS = ("train_data_path", "valid_data_path", "test_data_path")


def _flag_name(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _check_prefixes(flag: str, paths: list[str], ids: validation.TokenIds) -> None:
    """PREFIX.bin / .idx exist and hold token ids of the model's vocabulary (`validation`)."""
    prefixes = [p for p in paths if not _is_number(p)]
    if not prefixes:
        _fail(f"{flag}: no dataset prefix given ([W1] PREFIX1 [W2] PREFIX2 ...)")
    for prefix in prefixes:
        missing = [prefix + ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
        if missing:
            _fail(f"{flag} {prefix}: missing {', '.join(missing)} (give the prefix of a "
                  "Megatron indexed dataset, PREFIX.bin and PREFIX.idx)")
    try:
        validation.check_data_files(prefixes, ids)
    except ValueError as e:
        _fail(str(e).replace("--data-path", flag, 1))


def _validate_data(args: argparse.Namespace) -> None:
    per_split = [name for name in _SPLIT_PATHS if getattr(args, name)]
    if args.data_path and per_split:
        _fail(f"--data-path and {_flag_name(per_split[0])} are exclusive: give --data-path "
              "with --split, or --train-data-path / --valid-data-path / --test-data-path")
    if args.mock_data and (args.data_path or per_split):
        _fail(f"--mock-data and {_flag_name(per_split[0]) if per_split else '--data-path'} "
              "are exclusive")
    if args.num_workers is None or args.num_workers < 0:
        _fail(f"--num-workers {args.num_workers}: must be 0 (read in the training process) "
              "or more")
    if args.tokenizer_type == "NullTokenizer":
        if args.vocab_size is None or args.vocab_size < 1:
            _fail("--tokenizer-type NullTokenizer needs --vocab-size N")
    if args.tokenizer_type == "GPT2BPETokenizer":
        if not (args.vocab_file and args.merge_file):
            _fail("--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file")
    elif args.tokenizer_type != "NullTokenizer" and not args.tokenizer_model:
        _fail(f"--tokenizer-type {args.tokenizer_type} needs --tokenizer-model")
    try:
        tokenizer_check.check_tokenizer_files(args)
        ids = tokenizer_check.model_token_ids(args) if args.data_path or per_split else None
    except ValueError as e:
        _fail(str(e))
    if args.data_path:
        _check_prefixes("--data-path", args.data_path, ids)
    for name in per_split:
        _check_prefixes(_flag_name(name), getattr(args, name), ids)
    if per_split and not args.train_data_path and not args.skip_train:
        _fail("--valid-data-path / --test-data-path without --data-path: give the training "
              "set with --train-data-path (or pass --skip-train to evaluate only)")
    if not (args.data_path or per_split):
        args.mock_data = True


def _validate_evaluation(args: argparse.Namespace) -> None:
    """--eval-interval, --eval-iters and the TensorBoard intervals."""
    for name in ("eval_interval", "tensorboard_log_interval", "tensorboard_queue_size"):
        if getattr(args, name) is None or getattr(args, name) < 1:
            _fail(f"{_flag_name(name)} {getattr(args, name)}: must be a positive integer")
    for name in ("eval_iters",):
        if getattr(args, name) is None or getattr(args, name) < 0:
            _fail(f"{_flag_name(name)} {getattr(args, name)}: must be 0 or more")
    if args.skip_train and not args.eval_iters:
        _fail("--skip-train with --eval-iters 0: nothing to do (give --eval-iters N)")
    if args.data_path:
        used = [not args.skip_train, args.eval_iters > 0, args.eval_iters > 0]
        try:
            validation.check_split_documents(
                [p for p in args.data_path if not _is_number(p)], args.split, used)
        except ValueError as e:
            _fail(str(e))


# flag -> (the module its logger imports, the extra that installs it)
LOGGER_PACKAGES = {"tensorboard_dir": ("torch.utils.tensorboard", "tensorboard"),
                   "wandb_project": ("wandb", "wandb")}


def _check_logger_packages(args: argparse.Namespace) -> None:
    """--tensorboard-dir / --wandb-project: their package imports here, before any process
    group, rather than on the logging rank after the model is built."""
    for dest, (module, extra) in LOGGER_PACKAGES.items():
        if getattr(args, dest) is None:
            continue
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - a broken install raises anything
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
            _fail(f"{_flag_name(dest)} needs the {extra} package, which does not import "
                  f"({reason}): pip install 'megatron-mesh[{extra}]'")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True

