"""Flags of megatron_mesh.pretrain_gpt: configs, overrides, and bad values exiting early."""
from __future__ import annotations

import dataclasses
import glob
import re
from pathlib import Path

import pytest
import torch
from preloaded import Job, job_env

from megatron_mesh.pretrain_gpt import main
from megatron_mesh.training.config.arguments import parse_args
from megatron_mesh.training.config.training_config import as_dict

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny-cpu.yaml")
G8 = ["--global-batch-size", "8"]  # micro batch 2 x DP 4 (WORLD_SIZE 4)
MESH1 = ["--context-parallel-algo", "mesh"]  # the mesh's core attention at CP = 1
BUILDERS = "examples.mask_builders"

# GPT-3 paper, Table 2.1: n_layers, d_model, n_heads, d_head
GPT3 = {
    "125m": (12, 768, 12, 64), "350m": (24, 1024, 16, 64), "760m": (24, 1536, 16, 96),
    "1.3b": (24, 2048, 24, 128), "2.7b": (32, 2560, 32, 80), "6.7b": (32, 4096, 32, 128),
    "13b": (40, 5140, 40, 128), "175b": (96, 12288, 96, 128),
}


@pytest.fixture(autouse=True)
def _world(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")


@pytest.mark.parametrize("name", sorted(GPT3))
def test_gpt3_configs_have_paper_shapes(name: str) -> None:
    args = parse_args(["--config", str(ROOT / "configs" / f"gpt3-{name}.yaml"),
                       "--context-parallel-size", "4", "--context-parallel-algo", "mesh",
                       "--mesh-shape", "2x2"])
    assert (args.num_layers, args.hidden_size, args.num_attention_heads,
            args.kv_channels) == GPT3[name]
    assert args.seq_length == 2048
    assert sorted(glob.glob(str(ROOT / "configs" / "gpt3-*.yaml"))) == sorted(
        str(ROOT / "configs" / f"gpt3-{n}.yaml") for n in GPT3)


def test_flags_override_config() -> None:
    args = parse_args(["--config", TINY, "--hidden-size", "32", "--no-swiglu",
                       "--context-parallel-size", "4", "--context-parallel-algo", "mesh"])
    assert args.hidden_size == 32 and args.swiglu is False
    assert args.num_layers == 2  # from the config
    heads, rows, cols = args.mesh_shape
    assert args.data_parallel_size == 1 and heads * rows * cols == 4
    with pytest.raises(dataclasses.FrozenInstanceError):  # decided once, read everywhere
        args.mesh_shape = (1, 4, 1)


@pytest.mark.parametrize("flags, shape", [
    (["--mesh-shape", "2x2x1"], (2, 2, 1)),
    (["--mesh-shape", "2x1", "--mesh-heads", "2"], (2, 2, 1)),
    (["--mesh-shape", "1x2x2", "--mesh-heads", "1"], (1, 2, 2)),
    (["--mesh-shape", "2x2"], (1, 2, 2)),
])
def test_mesh_heads_and_3d_shapes(flags: list[str], shape: tuple[int, int, int]) -> None:
    """The grid the groups are built from (args.mesh_shape) is the flag check's (A, R, C)."""
    args = parse_args(["--config", TINY, "--context-parallel-size", "4",
                       "--context-parallel-algo", "mesh", *flags])
    assert args.mesh_shape == shape and args.mesh_heads == shape[0]


def test_backend_is_decided_with_the_flags(monkeypatch) -> None:
    import torch

    from megatron_mesh.training.config.arguments import ConfigError

    monkeypatch.setenv("WORLD_SIZE", "1")

    args = parse_args(["--config", TINY])
    assert args.distributed_backend == ("nccl" if torch.cuda.is_available() else "gloo")
    if not torch.cuda.is_available():  # refused up front, not after torchrun started ranks
        with pytest.raises(ConfigError, match="--distributed-backend nccl needs CUDA"):
            parse_args(["--config", TINY, "--distributed-backend", "nccl"])


def test_cp_comm_type_mesh_is_context_parallel_algo_mesh() -> None:
    common = ["--config", TINY, "--context-parallel-size", "4", "--mesh-shape", "2x2"]
    by_algo = as_dict(parse_args(common + ["--context-parallel-algo", "mesh"]))
    by_comm = as_dict(parse_args(common + ["--cp-comm-type", "mesh"]))
    assert by_comm.pop("cp_comm_type") == ("mesh",) and by_algo.pop("cp_comm_type") is None
    assert by_comm == by_algo and by_comm["context_parallel_algo"] == "mesh"


def test_recompute_flags_reach_the_transformer_config() -> None:
    from megatron_mesh.training.model.gpt import transformer_config

    common = ["--config", TINY, "--context-parallel-size", "4", "--cp-comm-type", "mesh"]
    full = transformer_config(parse_args(common + ["--recompute-granularity", "full"]))
    assert (full.recompute_granularity, full.recompute_method, full.recompute_num_layers) == (
        "full", "uniform", 1)
    selective = transformer_config(parse_args(common + ["--recompute-granularity", "selective"]))
    assert selective.recompute_granularity == "selective"


def test_window_flags_reach_the_transformer_config() -> None:
    from megatron_mesh.training.model.gpt import transformer_config

    common = ["--config", TINY, "--context-parallel-size", "4", "--cp-comm-type", "mesh"]
    config = transformer_config(parse_args(common + ["--window-size", "16", "0",
                                                     "--window-attn-skip-freq", "2"]))
    assert (tuple(config.window_size), config.window_attn_skip_freq) == ((16, 0), 2)
    assert transformer_config(parse_args(common)).window_size is None


def test_mask_flags_reach_the_config_and_the_spec() -> None:
    """--no-rope-freq (an int or a pattern) reaches megatron-core's no_rope_freq,
    --attention-chunk-size the mesh core attention's spec params."""
    from megatron_mesh.training.model.gpt import layer_spec, transformer_config

    common = ["--config", TINY, "--context-parallel-size", "4", "--cp-comm-type", "mesh"]
    args = parse_args(common + ["--attention-chunk-size", "8", "--no-rope-freq", "([0]+[1])*1"])
    assert args.attention_chunk_size == 8 and transformer_config(args).no_rope_freq == [0, 1]
    core = layer_spec(args).submodules.self_attention.submodules.core_attention
    assert core.params["attention_chunk_size"] == 8
    assert transformer_config(parse_args(common + ["--no-rope-freq", "2"])).no_rope_freq == [0, 1]
    plain = parse_args(common)
    assert plain.attention_chunk_size is None and transformer_config(plain).no_rope_freq is None
    assert "attention_chunk_size" not in (
        layer_spec(plain).submodules.self_attention.submodules.core_attention.params)


def test_mesh_kernel_reaches_the_spec_and_the_banner() -> None:
    """--mesh-kernel names the tile kernel of the mesh's core attention (its spec's
    `backend`, as Megatron-LM's patch passes it too: `mesh_spec_options`); auto leaves the
    choice to the kernels and is not written."""
    from megatron_mesh.megatron import mesh_spec_options
    from megatron_mesh.training.model.gpt import layer_spec
    from megatron_mesh.training.run import _attention_label

    common = ["--config", TINY, "--context-parallel-size", "4", "--cp-comm-type", "mesh"]
    for flags, backend in (([], "auto"), (["--mesh-kernel", "flex"], "flex")):
        args = parse_args(common + flags)
        params = layer_spec(args).submodules.self_attention.submodules.core_attention.params
        assert params.get("backend", "auto") == backend
        assert mesh_spec_options(args.mesh)["backend"] == backend
        assert _attention_label(args) == "mesh tile kernel" + (" flex" if flags else "")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's refusal; a GPU may run them")
def test_mesh_kernel_is_checked_wherever_the_mesh_attention_runs() -> None:
    """Without Transformer Engine layers the layers run the mesh's core attention under any
    algorithm (here the default at CP = 1): a kernel the CPU cannot run is refused with the
    flags there too, not at the first layer; megatron-core's local attention reads no
    --mesh-kernel and is not refused."""
    from megatron_mesh.training.config.arguments import ConfigError
    from megatron_mesh.training.model.gpt import attention_algo, use_transformer_engine

    for kernel in ("cudnn", "te"):
        flags = ["--config", TINY, "--global-batch-size", "8", "--mesh-kernel", kernel]
        with pytest.raises(ConfigError, match=f"--mesh-kernel {kernel}: backend='{kernel}' "
                                              "cannot run here: tensors are on cpu"):
            parse_args(flags)
        local = parse_args(flags + ["--attention-backend", "local"])
        assert attention_algo(local, use_transformer_engine(local)) is None
    flex = parse_args(["--config", TINY, "--global-batch-size", "8", "--mesh-kernel", "flex"])
    assert flex.context_parallel_algo != "mesh"
    assert attention_algo(flex, use_transformer_engine(flex)) == "mesh"


def test_pipeline_stages_share_the_world() -> None:
    """PP 2 x CP 2 on 4 ranks leaves DP 1; the batch is still split into micro-batches, and
    the default wandb run name says PP."""
    from megatron_mesh.training.logs.metrics import run_name

    args = parse_args(["--config", TINY, "--pipeline-model-parallel-size", "2",
                       "--context-parallel-size", "2", "--cp-comm-type", "mesh"])
    assert (args.pipeline_model_parallel_size, args.data_parallel_size,
            args.num_microbatches) == (2, 1, 2)
    assert run_name(args, "1x2") == "mesh-1x2-tp1-pp2-dp1"


def test_help_lists_megatron_flags(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--num-layers", "--seq-length", "--micro-batch-size", "--global-batch-size",
                 "--train-iters", "--lr-decay-style", "--bf16", "--tensor-model-parallel-size",
                 "--pipeline-model-parallel-size", "--context-parallel-size",
                 "--context-parallel-algo", "--cp-comm-type",
                 "--mesh-shape", "--mesh-heads", "--seed",
                 "--save", "--load", "--save-interval", "--log-interval", "--wandb-project",
                 "--wandb-exp-name", "--wandb-save-dir", "--data-path", "--tokenizer-type"):
        assert flag in text, flag


@pytest.mark.parametrize("flags, message", [
    (["--context-parallel-size", "4", "--context-parallel-algo", "ring"],
     "invalid choice: 'ring'"),
    (["--context-parallel-size", "4", "--context-parallel-algo", "mesh", "--mesh-shape", "3x2"],
     "mesh shape 3x2 has 6 ranks but the context-parallel size is 4; valid shapes: 4x1, 2x2, "
     "1x4, 2x2x1, 2x1x2, 4x1x1"),
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--attention-dropout", "0.1"],
     "--cp-comm-type mesh does not implement attention dropout (--attention-dropout 0.1)"),
    (["--context-parallel-size", "4", "--context-parallel-algo", "mesh",
      "--attention-dropout", "0.1"], "--context-parallel-algo mesh does not implement"),
    (["--eval-interval", "0", "--global-batch-size", "8"], "--eval-interval 0: must be a positive integer"),
    (["--eval-iters", "-1", "--global-batch-size", "8"], "--eval-iters -1: must be 0 or more"),
    (["--skip-train", "--global-batch-size", "8"], "--skip-train with --eval-iters 0: nothing to do"),
    (["--valid-data-path", "/nonexistent/valid", "--global-batch-size", "8"],
     "--valid-data-path /nonexistent/valid: missing"),
    (["--context-parallel-size", "4", "--context-parallel-algo", "mesh", "--seq-length", "60",
      "--max-position-embeddings", "64"], "--seq-length 60 must be divisible by 2"),
    (["--global-batch-size", "8", "--data-path", "/nonexistent/corpus_text_document"],
     "--data-path /nonexistent/corpus_text_document: missing"),
    (["--context-parallel-size", "2", "--context-parallel-algo", "p2p"],
     "needs Transformer Engine"),
    (["--tensor-model-parallel-size", "3"], "must divide the attention heads"),
    # tiny-cpu.yaml: 4 attention heads, 2 query groups
    (["--context-parallel-size", "2", "--tensor-model-parallel-size", "2",
      "--context-parallel-algo", "mesh", "--mesh-heads", "4"],
     "--mesh-heads 4 (the heads all-to-all size) must divide the context-parallel size 2 and "
     "the 2 query heads (1 K/V heads) per rank after tensor parallelism 2; valid: 1, 2"),
    (["--context-parallel-size", "4", "--context-parallel-algo", "mesh", "--mesh-shape", "2x2x2"],
     "mesh shape 2x2x2 has 8 ranks but the context-parallel size is 4; valid shapes: 2x2x1, "
     "2x1x2"),
    (["--context-parallel-size", "4", "--context-parallel-algo", "mesh", "--mesh-shape", "2x2x1",
      "--mesh-heads", "4"], "--mesh-heads 4 disagrees with --mesh-shape 2x2x1"),
    (["--context-parallel-size", "4", "--context-parallel-algo", "mesh", "--mesh-shape", "2x2x"],
     "must be written RxC or AxRxC"),
    (["--context-parallel-size", "8", "--context-parallel-algo", "mesh"],
     "world size 4 is not divisible"),
    (["--config", "missing.yaml"], "missing.yaml: no such file"),
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "p2p"], "cannot be mixed"),
    (["--cp-comm-type", "p2p", "a2a"], "one algorithm in every layer"),
    (["--pipeline-model-parallel-size", "3"], "--num-layers 2 is not divisible by "
     "--pipeline-model-parallel-size 3: every stage holds the same number of layers; use a "
     "divisor of 2 (1, 2)"),
    (["--pipeline-model-parallel-size", "2", "--context-parallel-size", "4",
      "--cp-comm-type", "mesh"], "world size 4 is not divisible by tensor-parallel 1 x "
     "context-parallel 4 x pipeline-parallel 2; launch with torchrun --nproc-per-node 8"),
    (["--use-distributed-optimizer", "--optimizer", "sgd"], "--use-distributed-optimizer with "
     "--optimizer sgd on a CPU: megatron-core's distributed optimizer over torch's optimizers"),
    (["--recompute-num-layers", "2"], "need --recompute-granularity full"),
    (["--window-size", "16", "4"], "right must be 0 or -1"),
    (["--window-size", "-3", "0"], ">= -1"),
    (["--window-attn-skip-freq", "2"], "needs --window-size"),
    (["--hidden-size", "16", "--num-attention-heads", "2", "--swiglu"],
     "--swiglu with --hidden-size 16: Megatron-LM's width (8h/3 rounded down to a multiple "
     "of 64) is 0"),
    # flags Megatron-LM checks the same way
    ([*G8, "--context-parallel-size", "4", "--cp-comm-type", "mesh", "--mesh-shap", "2x2x"],
     "unrecognized arguments: --mesh-shap 2x2x"),
    ([*G8, "--train-samples", "40", "--train-iters", "10"],
     "--train-samples 40 with --train-iters: sample-based training counts its schedule"),
    ([*G8, "--lr-decay-samples", "40"], "--lr-decay-samples with iteration-based training"),
    ([*G8, "--train-samples", "3"], "--train-samples 3 is less than one global batch"),
    ([*G8, "--train-samples", "40", "--lr-warmup-samples", "40"],
     "the LR warmup (40 samples) must be shorter than the decay (40 samples)"),
    # --train-iters 0 (also refused) keeps the case from training where the ramp was ignored
    ([*G8, "--rampup-batch-size", "2", "2", "8", "--train-iters", "0"],
     "--rampup-batch-size with iteration-based training "
     "(a batch-size ramp is counted in samples, as in Megatron-LM)"),
    ([*G8, "--train-samples", "40", "--rampup-batch-size", "1", "1", "8"],
     "--rampup-batch-size 1 1 8: START and INCREMENT must be multiples of micro batch 2 x "
     "data-parallel 4 = 8"),
    ([*G8, "--train-samples", "40", "--rampup-batch-size", "8", "8", "0"],
     "--rampup-batch-size 8 8 0: START, INCREMENT and SAMPLES must be positive"),
    ([*G8, "--train-samples", "40", "--rampup-batch-size", "2", "4", "8"],
     "--global-batch-size 8 must be START plus a whole number of INCREMENTs"),
    ([*G8, "--train-samples", "40", "--rampup-batch-size", "8", "8", "8",
      "--reset-attention-mask", "--calculate-per-token-loss", "--mesh-balance-data-parallel"],
     "--mesh-balance-data-parallel with --rampup-batch-size: the balance deals documents over "
     "the full global batch"),
    ([*G8, "--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"],
     "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler are exclusive"),
    ([*G8, "--overlap-param-gather", "--use-distributed-optimizer", "--optimizer", "sgd"],
     "--overlap-param-gather needs --use-distributed-optimizer and "
     "--overlap-grad-reduce"),
    ([*G8, "--rotary-percent", "0.5", "--position-embedding-type", "learned_absolute"],
     "--rotary-percent 0.5 needs --position-embedding-type rope"),
    ([*G8, "--rotary-percent", "0.1"], "--rotary-percent 0.1 rotates 1 of the 16 head dims"),
    ([*G8, "--use-checkpoint-args"], "--use-checkpoint-args needs --load DIR"),
    ([*G8, "--use-checkpoint-args", "--load", "/nonexistent/ckpt"],
     "--use-checkpoint-args: no checkpoint under --load /nonexistent/ckpt"),
    ([*G8, "--attention-chunk-size", "8"], "--attention-chunk-size 8 runs in the mesh's core "
     "attention: add --context-parallel-algo mesh"),
    ([*G8, "--attention-chunk-size", "0"],
     "argument --attention-chunk-size: '0' is not a positive integer"),
    ([*G8, *MESH1, "--attention-chunk-size", "8", "--window-size", "4", "0"],
     "--attention-chunk-size 8 with --window-size: give one mask"),
    ([*G8, *MESH1, "--mesh-mask-builder", f"{BUILDERS}:prefix_lm", "--reset-attention-mask",
      "--mesh-balance-data-parallel"],
     f"--mesh-mask-builder {BUILDERS}:prefix_lm with --mesh-balance-data-parallel: the balance"),
    ([*G8, *MESH1, "--attention-chunk-size", "8", "--mesh-mask-builder", f"{BUILDERS}:prefix_lm"],
     "--attention-chunk-size 8 and --mesh-mask-builder examples.mask_builders:prefix_lm are "
     "exclusive"),
    ([*G8, *MESH1, "--mesh-mask-builder", "prefix_lm"],
     "--mesh-mask-builder 'prefix_lm': give MODULE:FUNCTION"),
    ([*G8, *MESH1, "--mesh-mask-builder", "no_such_module_here:f"],
     "--mesh-mask-builder no_such_module_here:f: cannot import 'no_such_module_here' "
     "(ModuleNotFoundError"),
    ([*G8, *MESH1, "--mesh-mask-builder", f"{BUILDERS}:nothing"],
     "--mesh-mask-builder examples.mask_builders:nothing: module 'examples.mask_builders' has "
     "no function 'nothing'"),
    ([*G8, *MESH1, "--mesh-mask-builder", f"{BUILDERS}:PREFIX_SHARE"],
     "has no function 'PREFIX_SHARE' (it is a int)"),
    ([*G8, *MESH1, "--mesh-mask-builder", f"{BUILDERS}:prefix_lm", "--attention-backend",
      "local"], "--attention-chunk-size / --mesh-mask-builder with --attention-backend local"),
    ([*G8, *MESH1, "--mesh-kernel", "fast"],
     "argument --mesh-kernel: invalid choice: 'fast'"),
    # a kernel this machine cannot run: refused with the flags, not at the first layer
    *([([*G8, *MESH1, "--mesh-kernel", "te"],
        "--mesh-kernel te: backend='te' cannot run here: tensors are on cpu")]
      if not torch.cuda.is_available() else []),
    ([*G8, "--no-rope-freq", "3"], "--no-rope-freq 3 must divide --num-layers 2"),
    ([*G8, "--no-rope-freq", "[0,1,1]"], "--no-rope-freq gives 3 layers, --num-layers is 2"),
    ([*G8, "--no-rope-freq", "__import__('os')"],
     "argument --no-rope-freq: \"__import__('os')\": give an int N >= 1"),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--seq-length", "63"],
     "--sequence-parallel: the 63 tokens per context-parallel rank (--seq-length 63 / CP 1) are "
     "not divisible by --tensor-model-parallel-size 2"),
])
def test_bad_flags_exit_nonzero_with_message(flags: list[str], message: str,
                                             capsys: pytest.CaptureFixture) -> None:
    try:
        code = main(["--config", TINY, *flags])
    except SystemExit as exit_info:  # argparse's own errors (e.g. an invalid choice)
        code = exit_info.code
    assert code not in (0, None)
    err = capsys.readouterr().err
    assert message in err, err


@pytest.mark.distributed  # forks a driver job on every rank
def test_bad_flags_fail_fast_on_every_rank() -> None:
    """Four ranks of a job with a bad mesh shape, or a bad choice argparse itself rejects:
    each exits 2 by itself (no rank is stopped for another's failure), before any group
    exists, so none hangs; the message is printed once (the first local rank), in one line."""
    for flags, message in (
            (["--mesh-shape", "1x2"], "pretrain_gpt: error: mesh shape 1x2 has 2 ranks"),
            (["--mesh-schedule", "ring"],
             "pretrain_gpt: error: argument --mesh-schedule: invalid choice: 'ring'")):
        job = Job(["--config", TINY, "--context-parallel-size", "4", "--context-parallel-algo",
                   "mesh", *flags], job_env(), nproc=4, stop_others=False)
        run = job.wait(timeout=100)
        assert job.exitcodes == [2, 2, 2, 2], run.output[-2000:]
        assert run.output.count(message) == 1, run.output[-2000:]
        assert run.output.strip().count("\n") == 0 and "usage:" not in run.output, run.output
    # as under torchrun, which stops every rank at the first that ends: the line still comes
    job = Job(["--config", TINY, "--context-parallel-size", "4", "--context-parallel-algo", "mesh",
               "--mesh-shape", "1x2"], job_env(), nproc=4, stop_others=True)
    run = job.wait(timeout=100)
    assert run.returncode == 2 and run.output.count(
        "pretrain_gpt: error: mesh shape 1x2 has 2 ranks") == 1, run.output[-2000:]


def test_bad_config_values_are_checked_like_flags(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("context-parallel-algo: ring\ncontext-parallel-size: 4\n")
    assert main(["--config", str(config)]) == 2
    assert "--context-parallel-algo 'ring' (from --config): valid values are p2p" in (
        capsys.readouterr().err)
    config.write_text("num-layerz: 2\n")
    assert main(["--config", str(config)]) == 2
    assert "unknown key 'num-layerz' (did you mean 'num-layers'?)" in capsys.readouterr().err


def test_config_key_typos_are_named_as_written_with_the_nearest_key(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Each unknown key as the file spells it (dashes or underscores), the nearest valid key
    in the same spelling, none where nothing is near; one line."""
    config = tmp_path / "typos.yaml"
    config.write_text("hiden-size: 32\nnum_attention_head: 4\nzzqqxx: 1\n")
    assert main(["--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    for part in ("unknown key 'hiden-size' (did you mean 'hidden-size'?)",
                 "unknown key 'num_attention_head' (did you mean 'num_attention_heads'?)",
                 "unknown key 'zzqqxx'; see --help"):
        assert part in err, err


def test_help_states_each_default_once(monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture) -> None:
    """Every line of --help (wide enough that each help is one line) states a default
    at most once: a help naming its own default gets no "(default: None)" after it."""
    monkeypatch.setenv("COLUMNS", "2000")
    with pytest.raises(SystemExit):
        main(["--help"])
    lines = capsys.readouterr().out.splitlines()
    assert any(line.strip() == "K/V heads with --group-query-attention (default: one per "
               "attention head)" for line in lines)
    twice = [line.strip() for line in lines
             if len(re.findall(r"(?:^|[(,;.]\s*)default\b", line.strip(), re.IGNORECASE)) > 1]
    assert not twice, "\n".join(twice)


# Every flag the GPT example scripts of Megatron-LM core_v0.16.1 and core_v0.19.0 pass
# (examples/gpt3/train_gpt3_175b_distributed.sh, both tags), the flags of a Megatron-LM user's
# Megatron-LM command line, and Megatron-LM's TensorBoard / logging flags, with example values.
MEGATRON_LM_GPT_FLAGS = [
    # GPT_MODEL_ARGS
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--max-position-embeddings", "64", "--attention-backend", "auto",
    # TRAINING_ARGS (core_v0.19.0: --step-batch-size-schedule; core_v0.16.1's
    # --rampup-batch-size beside --train-iters is refused, as Megatron-LM's own check does:
    # test_rampup_batch_size_is_sample_based)
    "--micro-batch-size", "1", "--global-batch-size", "16",
    "--step-batch-size-schedule", "0:16 2.4B:320 4.8B:624",
    "--train-iters", "500000", "--weight-decay", "0.1", "--adam-beta1", "0.9",
    "--adam-beta2", "0.95", "--init-method-std", "0.006", "--clip-grad", "1.0",
    "--lr", "6.0e-5", "--lr-decay-style", "cosine", "--min-lr", "6.0e-6",
    "--lr-warmup-fraction", ".001", "--lr-decay-iters", "430000",
    # MODEL_PARALLEL_ARGS
    "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
    # DATA_ARGS (mock data here: no --data-path)
    "--split", "949,50,1",
    # EVAL_AND_LOGGING_ARGS
    "--log-interval", "100", "--save-interval", "10000", "--eval-interval", "1000",
    "--eval-iters", "10", "--tensorboard-dir", "tb",
    # a Megatron-LM user's command line (fusions off, flash attention, loader workers)
    "--no-gradient-accumulation-fusion", "--no-rope-fusion", "--no-masked-softmax-fusion",
    "--use-flash-attn", "--num-workers", "2", "--calculate-per-token-loss",
    # Megatron-LM's TensorBoard / logging flags
    "--tensorboard-log-interval", "1", "--tensorboard-queue-size", "1000",
    "--log-timers-to-tensorboard", "--log-validation-ppl-to-tensorboard",
    "--log-memory-to-tensorboard", "--log-world-size-to-tensorboard",
    "--log-throughput", "--log-params-norm", "--log-num-zeros-in-grad",
    "--no-log-loss-scale-to-tensorboard", "--timing-log-level", "0",
    # common in Megatron-LM's other GPT-family scripts
    "--use-mcore-models", "--ckpt-format", "torch_dist", "--overlap-grad-reduce",
    "--overlap-param-gather", "--use-distributed-optimizer", "--manual-gc", "--cross-entropy-loss-fusion",
    "--attention-softmax-in-fp32", "--no-bias-dropout-fusion", "--no-bias-gelu-fusion",
    "--no-bias-swiglu-fusion", "--empty-unused-memory-level", "1", "--dataloader-type", "single",
]


def test_megatron_lm_gpt_example_flags_are_accepted_and_reported_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPT example's flag list parses; honoured flags take their values, and each flag
    without effect here is named once, with its reason, in the start-up report."""
    from megatron_mesh.training.config.megatron_lm_flags import NO_EFFECT, no_effect_report

    monkeypatch.setenv("WORLD_SIZE", "8")
    args = parse_args(["--vocab-size", "255", *MEGATRON_LM_GPT_FLAGS])
    assert (args.eval_interval, args.eval_iters, args.tensorboard_dir) == (1000, 10, "tb")
    assert args.calculate_per_token_loss and args.log_timers_to_tensorboard
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
            args.data_parallel_size, args.num_microbatches) == (2, 2, 2, 8)
    report = no_effect_report(args)
    given = {f.name for f in NO_EFFECT if f.name in MEGATRON_LM_GPT_FLAGS}
    assert sorted(line.split(":")[0].split(" ")[0] for line in report) == sorted(given)
    assert args.overlap_grad_reduce and args.overlap_param_gather  # honoured: megatron-core's DDP
    assert "--step-batch-size-schedule 0:16 2.4B:320 4.8B:624: no effect here" in "\n".join(report)
    assert no_effect_report(parse_args(["--vocab-size", "255"])) == []


@pytest.mark.parametrize("flags, named", [
    (["--position-embedding-type", "rope"], "with --position-embedding-type rope (RoPE"),
    (["--position-embedding-type", "none"], "with --position-embedding-type none (no position"),
    (["--position-embedding-type", "rope", "--reset-attention-mask"], None),
    (["--position-embedding-type", "learned_absolute"], None),
])
def test_reset_position_ids_without_effect_is_named(flags: list[str], named: str | None) -> None:
    """--reset-position-ids moves learned positions only: with RoPE (or none) and no
    --reset-attention-mask the start-up report says it does nothing."""
    from megatron_mesh.training.config.megatron_lm_flags import no_effect_report

    report = no_effect_report(parse_args(["--vocab-size", "255", "--reset-position-ids", *flags]))
    if named is None:
        assert report == []
    else:
        assert len(report) == 1 and report[0].startswith("--reset-position-ids: no effect "
                                                         "here " + named), report


def test_megatron_lm_command_line_sets_the_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPT example's command line (with --num-workers 2) gives 2 workers, and the flag is
    not among those reported as having no effect."""
    from megatron_mesh.training.config.megatron_lm_flags import no_effect_report

    monkeypatch.setenv("WORLD_SIZE", "8")
    args = parse_args(["--vocab-size", "255", *MEGATRON_LM_GPT_FLAGS])
    assert args.num_workers == 2
    assert not [line for line in no_effect_report(args) if "--num-workers" in line]


def test_sample_based_training_is_megatron_lms_iterations_and_schedule() -> None:
    """--train-samples N: N / GBS iterations; --lr-decay-samples / --lr-warmup-samples give
    the schedule in samples, the same as the iteration flags times the global batch. On the
    command line they replace the config's iteration counts (tiny-cpu.yaml: train-iters 20,
    lr-warmup-iters 2)."""
    def schedule(flags: list[str]) -> tuple[int, ...]:
        a = parse_args(["--config", TINY, "--global-batch-size", "8", *flags])
        return a.train_iters, a.lr_warmup_steps, a.lr_decay_steps, a.wd_incr_steps

    by_iters = schedule(["--train-iters", "5", "--lr-decay-iters", "4", "--lr-warmup-iters", "1"])
    by_samples = schedule(["--train-samples", "44", "--lr-decay-samples", "32",
                           "--lr-warmup-samples", "8"])
    assert by_iters == (5, 8, 32, 40) and by_samples == (5, 8, 32, 44)
    assert schedule(["--train-samples", "40", "--lr-warmup-fraction", "0.25"]) == (5, 10, 40, 40)
    assert schedule([])[:3] == (20, 16, 160)  # the config's iterations, unchanged


def test_rampup_batch_size_is_sample_based(monkeypatch: pytest.MonkeyPatch) -> None:
    """--rampup-batch-size START INCREMENT SAMPLES with --train-samples: the iterations count
    the ramp's batches first (2, 2, then 4 from 4 consumed samples on), as Megatron-LM does."""
    from megatron_mesh.training.config.batch_ramp import batch_at, ramp_calculator

    monkeypatch.setenv("WORLD_SIZE", "1")
    args = parse_args(["--config", TINY, "--train-samples", "20",
                       "--rampup-batch-size", "2", "2", "4"])
    assert args.rampup_batch_size == (2, 2, 4) and args.train_iters == 6
    calculator, consumed, batches = ramp_calculator(args), 0, []
    for _ in range(args.train_iters):
        gbs, micro = batch_at(calculator, args, consumed)
        batches.append((gbs, micro))
        consumed += gbs
    assert batches == [(2, 1), (2, 1), (4, 2), (4, 2), (4, 2), (4, 2)] and consumed == 20


def test_rampup_that_starts_at_the_global_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """START = --global-batch-size leaves no step to ramp: every batch is the global one (it
    divided by zero steps before)."""
    from megatron_mesh.training.config.batch_ramp import batch_at, ramp_calculator

    monkeypatch.setenv("WORLD_SIZE", "1")
    args = parse_args(["--config", TINY, "--train-samples", "16", "--global-batch-size", "4",
                       "--rampup-batch-size", "4", "2", "8"])
    calculator = ramp_calculator(args)
    assert [batch_at(calculator, args, n) for n in (0, 4, 8, 12)] == [(4, 2)] * 4
    assert args.train_iters == 4


def test_plan_cli_refuses_flag_prefixes(capsys: pytest.CaptureFixture) -> None:
    """megatron-mesh plan: a prefix of a flag is an error naming it, not that flag."""
    from megatron_mesh.cli import main as cli_main

    with pytest.raises(SystemExit) as exit_info:
        cli_main(["plan", "--gpus", "4", "--seq-length", "8192", "--num-heads", "8",
                  "--hidden-size", "1024", "--num-lay", "2"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --num-lay 2" in capsys.readouterr().err


def test_a_mask_builder_keeps_the_documents_in_their_samples(monkeypatch) -> None:
    """--mesh-balance-data-parallel is on by default for placed documents with a per-token
    loss at DP > 1, and off with a mask builder (the balance moves documents between
    samples, a builder masks a sample's positions: nothing would call it)."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    flags = [*G8, "--vocab-size", "255", "--mock-data", "--reset-attention-mask",
             "--calculate-per-token-loss",
             "--context-parallel-size", "2", "--context-parallel-algo", "mesh"]
    assert parse_args(flags).mesh_balance_data_parallel is True
    built = parse_args([*flags, "--mesh-mask-builder", f"{BUILDERS}:prefix_lm"])
    assert built.mesh_balance_data_parallel is False


def test_no_rope_freq_is_refused_with_mla() -> None:
    """megatron-core's MLA reads no --no-rope-freq: the pair is refused by name."""
    import argparse

    from megatron_mesh.megatron.arguments import check_mask_args

    args = argparse.Namespace(no_rope_freq=2, multi_latent_attention=True, num_layers=4)
    with pytest.raises(ValueError, match="--no-rope-freq 2 with --multi-latent-attention"):
        check_mask_args(args)
    check_mask_args(argparse.Namespace(no_rope_freq=2, multi_latent_attention=False,
                                       num_layers=4))
