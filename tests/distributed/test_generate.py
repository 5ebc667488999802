"""`python -m megatron_mesh.generate` end to end on CPU: a tiny GPT trained a few iterations by
the driver on a 2-rank mesh (its checkpoint saved on that grid), then greedy generation of
32 tokens for a batch of prompts of different lengths (not multiples of 2P) at CP = 1 and
on the meshes 2x2, 1x4 and 2x1x2: the same token ids, log-probabilities equal to rounding;
sampling with a fixed --seed: the same tokens at CP = 1 and on 2x2; packed prompts placed by
document give the dense continuations; without --output the continuations are printed;
model flags left out are the checkpoint's, and one that differs from it is refused; a
chunked model's continuations are the same at CP = 1 and on 2x1x2 and their
log-probabilities a no-cache forward's; bad input exits 2 with one line before any
collective."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from megatron.core import dist_checkpointing
from preloaded import (
    DRIVER,
    ROOT,
    TINY,
    TINY_VOCAB,
    Job,
    Run,
    build_indexed_dataset,
    job_env,
    launch,
)

from megatron_mesh.training.checkpoints.checksums import MANIFEST, file_checksum, write_manifest
from megatron_mesh.training.checkpoints.model_description import MODEL_FLAGS, SAVED_FLAGS
from megatron_mesh.training.job.console import PRINT_DELAY_ENV

GENERATE = "megatron_mesh.generate"
PROMPTS = [[3, 5, 7, 9, 11], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52],
           [100, 103, 106, 109, 112, 115, 118, 121, 124, 127, 130, 133, 136, 139, 142,
            145, 148, 151, 154, 157, 160, 163]]  # 5, 13, 22 tokens
NEW = 32
GRIDS = {"2x2": ["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--mesh-shape", "2x2"],
         "1x4": ["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--mesh-shape", "1x4"],
         "2x1x2": ["--context-parallel-size", "4", "--cp-comm-type", "mesh",
                   "--mesh-shape", "2x1x2"]}


@pytest.fixture(scope="module")
def checkpoint(work: Path) -> Path:
    """The driver's checkpoint after 60 iterations on a 1x2 mesh (CP = 2)."""
    prefix = str(work / "arith")
    build_indexed_dataset(prefix)
    run = launch(2, ["--config", TINY, "--train-iters", "60", "--data-path", prefix,
                     "--data-cache-path", str(work / "index-cache"), "--save",
                     str(work / "ckpt"), "--save-interval", "60",
                     "--context-parallel-size", "2", "--cp-comm-type", "mesh"])
    assert run.returncode == 0, run.output[-3000:]
    return work / "ckpt"


@pytest.fixture(scope="module")
def prompt_file(work: Path) -> Path:
    path = work / "prompts.json"
    path.write_text(json.dumps(PROMPTS))
    return path


def generate(nproc: int, args: list[str], out: Path, config: bool = True
             ) -> tuple[Run, list[dict]]:
    run = launch(nproc, [*(["--config", TINY] if config else []), *args, "--output", str(out)],
                 module=GENERATE)
    records = [json.loads(line) for line in out.read_text().splitlines()] \
        if run.returncode == 0 and out.exists() else []
    return run, records


@pytest.fixture(scope="module")
def greedy_cp1(checkpoint: Path, prompt_file: Path, work: Path) -> list[dict]:
    run, records = generate(1, ["--load", str(checkpoint), "--prompt-ids-file", str(prompt_file),
                                "--max-new-tokens", str(NEW)], work / "cp1.jsonl")
    assert run.returncode == 0, run.output[-3000:]
    assert "prefill:" in run.output and "decode:" in run.output and "KV cache per rank" in run.output
    return records


def test_greedy_cp1_generates_full_continuations(greedy_cp1: list[dict]) -> None:
    assert [r["prompt_ids"] for r in greedy_cp1] == PROMPTS
    for r in greedy_cp1:
        assert 1 <= len(r["generated_ids"]) <= NEW
        assert len(r["logprobs"]) == len(r["generated_ids"])
        # not a degenerate continuation: the model trained on arithmetic sequences
        assert len(set(r["generated_ids"])) > 1, r


def test_without_output_the_continuations_are_printed(greedy_cp1: list[dict], checkpoint: Path,
                                                      prompt_file: Path) -> None:
    """No --output: each prompt and its continuation on stdout, one line each, as the
    tokenizer writes them (the NullTokenizer: ids separated by spaces)."""
    run = launch(1, ["--config", TINY, "--load", str(checkpoint), "--prompt-ids-file",
                     str(prompt_file), "--max-new-tokens", str(NEW)], module=GENERATE)
    assert run.returncode == 0, run.output[-3000:]
    want = [f"{' '.join(map(str, r['prompt_ids']))} -> {' '.join(map(str, r['generated_ids']))}"
            for r in greedy_cp1]
    lines = run.output.splitlines()
    assert want[0] in lines, run.output[-3000:]
    at = lines.index(want[0])
    assert lines[at:at + len(want)] == want


@pytest.mark.parametrize("grid, exchange", [(g, "all_gather") for g in GRIDS]
                         + [("2x2", "all_reduce")])
def test_greedy_on_the_mesh_equals_cp1(grid: str, exchange: str, greedy_cp1: list[dict],
                                       checkpoint: Path, prompt_file: Path, work: Path) -> None:
    run, records = generate(4, ["--load", str(checkpoint), "--prompt-ids-file",
                                str(prompt_file), "--max-new-tokens", str(NEW), *GRIDS[grid],
                                "--decode-exchange", exchange], work / f"{grid}-{exchange}.jsonl")
    assert run.returncode == 0, run.output[-3000:]
    assert f"mesh {grid}" in run.output
    cache = [line for line in run.output.splitlines() if "KV cache per rank" in line][0]
    # slots per rank: 24 / 4 (the zigzag share of the prompts padded to 24) + 32 / 4 steps
    assert "(14 slots x 3 sequences x 2 layers" in cache, cache
    for got, want in zip(records, greedy_cp1, strict=True):
        assert got["generated_ids"] == want["generated_ids"]
        assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-4)


def refused(run: Run) -> str:
    """The error line, printed once (exit 2, no traceback, no group built)."""
    assert run.returncode == 2, run.output[-3000:]
    errors = [line for line in run.output.splitlines() if line.startswith("generate: error:")]
    assert len(errors) == 1 and "Traceback" not in run.output, run.output[-3000:]
    assert "built for" not in run.output and "loaded weights" not in run.output
    return errors[0]


FLAGS_WITHOUT_WEIGHTS = {  # flag values -> the difference named
    ("--rotary-percent", "0.5"): "--rotary-percent 1.0, the flags say 0.5",
    ("--rotary-base", "500"): "--rotary-base 10000, the flags say 500",
    ("--norm-epsilon", "1e-6"): "--norm-epsilon 1e-05, the flags say 1e-06",
    ("--window-size", "8", "0"): "--window-size unset, the flags say 8 0",
    ("--window-attn-skip-freq", "2"): "--window-attn-skip-freq unset, the flags say 2",
    ("--softmax-type", "off-by-one"): "--softmax-type vanilla, the flags say off-by-one",
}
FLAGS_WITH_WEIGHTS = {
    ("--softmax-type", "learnable"): "--softmax-type vanilla, the flags say learnable",
    ("--qk-layernorm",): "--qk-layernorm off, the flags say on",
    ("--num-experts", "4"): "--num-experts unset, the flags say 4",
    (): "--moe-ffn-hidden-size unset, the flags say 128",  # derived from --num-experts
}


def test_model_flags_that_differ_from_the_checkpoint_are_refused(
        checkpoint: Path, prompt_file: Path, work: Path) -> None:
    """The checkpoint describes its model by every model flag. Flags without weights (RoPE's
    share and base, the norm's epsilon, a window, its skip frequency, off-by-one sinks)
    loaded and ran another model, exit 0; flags that add weights (learnable sinks, QK norms,
    experts) crashed in the load. Each exits 2 with one line naming every flag that differs
    and both values, before any process group."""
    saved = dist_checkpointing.load_common_state_dict(str(checkpoint / "iter_0000060"))
    assert tuple(saved["model_shape"]) == SAVED_FLAGS
    for flags in (FLAGS_WITHOUT_WEIGHTS, FLAGS_WITH_WEIGHTS):
        run, records = generate(1, ["--load", str(checkpoint), "--prompt-ids-file",
                                    str(prompt_file), "--max-new-tokens", "2",
                                    *(v for values in flags for v in values)],
                                work / "refused.jsonl")
        line = refused(run)
        assert f"checkpoint {checkpoint / 'iter_0000060'} holds a model with " in line
        assert line.count("the flags say") == len(flags), line
        for named in flags.values():
            assert named in line, line


OLDER_DESCRIPTION = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                     "seq_length", "ffn_hidden_size", "kv_channels", "group_query_attention",
                     "swiglu", "normalization", "position_embedding_type", "rotary_percent",
                     "max_position_embeddings", "disable_bias_linear",
                     "untie_embeddings_and_output_weights")
"""What checkpoints of an older version describe of their model."""


FIRST_DESCRIPTION = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                     "seq_length", "ffn_hidden_size")
"""What the first checkpoints with a description recorded: the group count, not the switch."""


def latest(root: Path) -> Path:
    """The folder of the newest checkpoint under root."""
    iteration = int((root / "latest_checkpointed_iteration.txt").read_text())
    return root / f"iter_{iteration:07d}"


def rewrite_common(path: Path, change) -> None:
    """change(common state) on checkpoint folder `path`'s common.pt, saved back, its checksum
    in the manifest (where there is one) updated to match."""
    common = torch.load(path / "common.pt", weights_only=False)
    change(common)
    torch.save(common, path / "common.pt")
    if (path / MANIFEST).exists():
        manifest = json.loads((path / MANIFEST).read_text())
        manifest["files"]["common.pt"] = list(file_checksum(str(path / "common.pt")))
        (path / MANIFEST).write_text(json.dumps(manifest))


def as_saved_by_an_older_version(root: Path, to: Path,
                                 description: tuple[str, ...] = OLDER_DESCRIPTION) -> Path:
    """A copy of the checkpoint folder `root` whose model description holds only
    `description` (its manifest updated to match)."""
    shutil.copytree(root, to)
    path = latest(to)
    rewrite_common(path, lambda common: common.update(
        model_shape={k: common["model_shape"][k] for k in description}))
    return path


def test_a_checkpoint_saved_by_an_older_version(greedy_cp1: list[dict], checkpoint: Path,
                                               prompt_file: Path, work: Path) -> None:
    """Its description lacks most model flags: those run with the flags' values, named in
    one warning line; a description of the first kind (six keys: the group count, not the
    GQA switch) generates with a config that does not give the switch, which was refused by a
    flag never given; a flag that adds weights the checkpoint lacks (learnable sinks) exits
    2 naming the weight and the flag (a KeyError traceback before)."""
    old = work / "ckpt-old"
    path = as_saved_by_an_older_version(checkpoint, old)
    args = ["--load", str(old), "--prompt-ids-file", str(prompt_file), "--max-new-tokens", "4"]
    run, records = generate(1, args, work / "old.jsonl")
    assert run.returncode == 0, run.output[-3000:]
    unrecorded = len(MODEL_FLAGS) - len(OLDER_DESCRIPTION) + 1
    (warning,) = [line for line in run.output.splitlines() if "older version" in line]
    assert (f"checkpoint {path} (saved by an older version) does not record {unrecorded} "
            "model flags; generating with the flags' --norm-epsilon 1e-05, --rotary-base "
            "10000") in warning and "--softmax-type vanilla" in warning, warning
    for got, want in zip(records, greedy_cp1, strict=True):
        assert got["generated_ids"] == want["generated_ids"][:4]
    # the first descriptions record the group count, not --group-query-attention: a config
    # without the switch was refused ("--num-query-groups needs --group-query-attention")
    first = work / "ckpt-first"
    as_saved_by_an_older_version(checkpoint, first, FIRST_DESCRIPTION)
    config = work / "tiny-no-gqa.yaml"
    config.write_text("".join(line for line in Path(TINY).read_text().splitlines(True)
                              if not line.startswith("group-query-attention")))
    run, records = generate(1, ["--config", str(config), "--load", str(first), *args[2:]],
                            work / "first.jsonl", config=False)
    assert run.returncode == 0, run.output[-3000:]
    (warning,) = [line for line in run.output.splitlines() if "older version" in line]
    assert "--group-query-attention" not in warning, warning
    for got, want in zip(records, greedy_cp1, strict=True):
        assert got["generated_ids"] == want["generated_ids"][:4]
    # on 4 ranks: the weights are checked after the process groups exist, each rank alike;
    # the line is printed once
    run = each_rank(4, ["--config", TINY, *args, "--softmax-type", "learnable", *GRIDS["2x2"]])
    assert "Traceback" not in run.output, run.output[-3000:]
    (line,) = [line for line in run.output.splitlines() if line.startswith("generate: error:")]
    assert (f"checkpoint {path} has no weight decoder.layers.self_attention.core_attention."
            "softmax_offset, which the flags' model has (made by --softmax-type learnable)"
            ) in line, line


@pytest.fixture(scope="module")
def hidden32(work: Path) -> Path:
    """The driver's checkpoint of a model of hidden size 32 (otherwise tiny-cpu.yaml's), mock
    data, 4 iterations."""
    run = launch(1, ["--config", TINY, "--train-iters", "4", "--hidden-size", "32",
                     "--save", str(work / "ckpt-h32")])
    assert run.returncode == 0, run.output[-3000:]
    return work / "ckpt-h32"


def _damaged(root: Path, to: Path, checksums: bool = True) -> Path:
    """A copy of checkpoint folder `root` (without its manifest unless `checksums`); the
    newest checkpoint's folder in it."""
    shutil.copytree(root, to)
    path = latest(to)
    if not checksums:
        (path / MANIFEST).unlink()
    return path


def _error(run: Run, prog: str = "generate") -> str:
    """The one error line of a job that exited 2 without a traceback."""
    assert run.returncode == 2, run.output[-3000:]
    errors = [line for line in run.output.splitlines() if line.startswith(f"{prog}: error:")]
    assert len(errors) == 1 and "Traceback" not in run.output, run.output[-3000:]
    return errors[0]


def test_damaged_checkpoints_exit_2_naming_what_differs(
        checkpoint: Path, hidden32: Path, prompt_file: Path, work: Path) -> None:
    """A common.pt of garbage bytes (with or without its checksums), a model description that
    is not a mapping or holds --hidden-size 64.5, the weights of a hidden-32 model in the
    checkpoint of another, tensor files of another model without checksums: generate and
    pretrain_gpt --use-checkpoint-args read common.pt before any check (UnpicklingError,
    ValueError, torch's CheckpointException tracebacks) or named the vocabulary, which does
    not differ. Each exits 2 with one line naming the file, flag or tensor that differs."""
    prompts = ["--prompt-ids-file", str(prompt_file), "--max-new-tokens", "4"]

    def both(root: Path) -> tuple[str, str]:
        """generate's line, and --use-checkpoint-args' of the driver on the same folder."""
        gen = _error(launch(1, ["--config", TINY, "--load", str(root), *prompts],
                            module=GENERATE))
        drv = _error(launch(1, ["--config", TINY, "--train-iters", "6", "--load", str(root),
                                "--use-checkpoint-args"], module=DRIVER), "pretrain_gpt")
        return gen, drv

    def garbage(common: Path) -> None:  # as many bytes as were written
        size = common.stat().st_size
        common.write_bytes((bytes(range(256)) * (size // 256 + 1))[:size])

    path = _damaged(checkpoint, work / "bad-common")
    garbage(path / "common.pt")
    gen, drv = both(work / "bad-common")
    assert gen.startswith(f"generate: error: checkpoint {path}: file common.pt is corrupted "
                          "(crc32 "), gen
    assert drv.startswith(f"pretrain_gpt: error: --use-checkpoint-args: checkpoint {path}: "
                          "file common.pt is corrupted (crc32 "), drv

    path = _damaged(checkpoint, work / "bad-common-unlisted", checksums=False)
    garbage(path / "common.pt")
    unreadable = (f"checkpoint {path}: its common state (common.pt, metadata.json) cannot be "
                  "read (UnpicklingError)")
    for line in both(work / "bad-common-unlisted"):
        assert unreadable in line, line

    for name, shape, message in (
            ("list", [64, 2], "its model description (model_shape in common.pt) is a list, "
                              "not a mapping of flags to values"),
            ("half", {"hidden_size": 64.5}, "its model description has --hidden-size 64.5, "
                                            "not an integer")):
        path = _damaged(checkpoint, work / f"description-{name}")
        rewrite_common(path, lambda common: common.update(model_shape=shape))
        for line in both(work / f"description-{name}"):
            assert f"checkpoint {path}: {message}" in line, line

    # the weights of a hidden-32 model (.metadata and tensor files), checksums to match
    path = _damaged(checkpoint, work / "weights-h32")
    for f in latest(hidden32).iterdir():
        if f.suffix == ".distcp" or f.name == ".metadata":
            shutil.copy(f, path / f.name)
    write_manifest(str(path))
    line = _error(launch(1, ["--config", TINY, "--load", str(work / "weights-h32"), *prompts],
                         module=GENERATE))
    assert (f"checkpoint {path} holds embedding.word_embeddings.weight of shape [256, 32], the "
            "flags' model (--hidden-size 64) [256, 64]: give the model flags it was trained "
            "with") in line, line

    # tensor files of the hidden-32 model under the other's .metadata, no checksums: shorter
    # than the offsets it names, found before any process group
    path = _damaged(checkpoint, work / "files-h32", checksums=False)
    for f in latest(hidden32).glob("*.distcp"):
        shutil.copy(f, path / f.name)
    line = _error(launch(1, ["--config", TINY, "--load", str(work / "files-h32"), *prompts],
                         module=GENERATE))
    assert f"checkpoint {path}: file __0_0.distcp has " in line, line
    assert "the tensor files are not this checkpoint's" in line, line
    # the other way round (longer files at other offsets) fails in the load itself: one line
    # from 2 ranks, the same on both
    path = _damaged(hidden32, work / "files-h64", checksums=False)
    for f in latest(checkpoint).glob("*.distcp"):
        if (path / f.name).exists():
            shutil.copy(f, path / f.name)
    run = launch(2, ["--config", TINY, "--load", str(work / "files-h64"), "--hidden-size", "32",
                     *prompts, "--context-parallel-size", "2", "--cp-comm-type", "mesh"],
                 module=GENERATE)
    line = _error(run)
    assert (f"checkpoint {path}: its tensor files do not hold what its .metadata says ("
            ) in line and "loaded weights" not in run.output, line


@pytest.mark.parametrize("grid", ["2x2", "2x1x2"])
def test_packed_prompts_equal_cp1(grid: str, greedy_cp1: list[dict], checkpoint: Path,
                                  work: Path) -> None:
    """--pack-prompts: the prompts packed in one sequence (5 + 13 tokens and a padding
    document to 24) and placed by document; the same continuations as dense at CP = 1."""
    path = work / "two.json"
    path.write_text(json.dumps(PROMPTS[:2]))
    run, records = generate(4, ["--load", str(checkpoint), "--prompt-ids-file", str(path),
                                "--max-new-tokens", str(NEW), "--pack-prompts", *GRIDS[grid]],
                            work / f"packed-{grid}.jsonl")
    assert run.returncode == 0, run.output[-3000:]
    assert "slots of packed documents" in run.output
    for got, want in zip(records, greedy_cp1[:2], strict=True):
        assert got["generated_ids"] == want["generated_ids"]
        assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-4)


def test_windowed_moe_model_with_sinks_takes_the_checkpoints_flags(
        checkpoint: Path, prompt_file: Path, work: Path) -> None:
    """A model with a sliding window of 8 (its decode steps see the last 9 keys), learned
    absolute positions, learnable attention sinks and 4 experts, trained at CP = 1: the same
    greedy ids on 2x1x2 without any model flag (every one the checkpoint's: before, no window,
    no sinks, another shape) as at CP = 1 with them. A model flag given with another value
    (vanilla softmax, another window, a longer position table, another router top-k) exits 2
    naming each; with a description of an older version, a model without the sinks is
    refused by the weights it would not load."""
    model = ["--window-size", "8", "0", "--position-embedding-type", "learned_absolute",
             "--softmax-type", "learnable", "--num-experts", "4"]
    ckpt = work / "ckpt-window"
    trained = launch(1, ["--config", TINY, "--train-iters", "30", "--data-path",
                         str(work / "arith"), "--data-cache-path", str(work / "index-cache"),
                         "--save", str(ckpt), "--save-interval", "30", *model])
    assert trained.returncode == 0, trained.output[-3000:]
    prompts = ["--prompt-ids-file", str(prompt_file), "--max-new-tokens", str(NEW)]
    run1, one = generate(1, ["--load", str(ckpt), *prompts, *model], work / "window-1.jsonl")
    run4, mesh = generate(4, ["--load", str(ckpt), *prompts, "--tokenizer-type", "NullTokenizer",
                              "--vocab-size", str(TINY_VOCAB), *GRIDS["2x1x2"]],
                          work / "window-4.jsonl", config=False)
    assert run1.returncode == 0, run1.output[-3000:]
    assert run4.returncode == 0, run4.output[-3000:]
    for got, want in zip(mesh, one, strict=True):
        assert got["generated_ids"] == want["generated_ids"]
        assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-4)

    other = {("--softmax-type", "vanilla"): "--softmax-type learnable, the flags say vanilla",
             ("--window-size", "4", "0"): "--window-size 8 0, the flags say 4 0",
             ("--max-position-embeddings", "128"):
                 "--max-position-embeddings 64, the flags say 128",
             ("--moe-router-topk", "3"): "--moe-router-topk 2, the flags say 3"}
    run, _ = generate(1, ["--load", str(ckpt), *prompts, "--position-embedding-type",
                          "learned_absolute", *(v for values in other for v in values)],
                      work / "refused.jsonl")
    line = refused(run)
    assert line.count("the flags say") == len(other), line
    for named in other.values():
        assert named in line, line

    path = as_saved_by_an_older_version(ckpt, work / "ckpt-window-old")
    run = launch(1, ["--config", TINY, "--load", str(work / "ckpt-window-old"), *prompts,
                     "--window-size", "8", "0", "--position-embedding-type", "learned_absolute",
                     "--num-experts", "4"], module=GENERATE)  # no --softmax-type learnable
    assert run.returncode == 2 and "Traceback" not in run.output, run.output[-3000:]
    (line,) = {line for line in run.output.splitlines() if line.startswith("generate: error:")}
    assert (f"checkpoint {path} holds weights the flags' model has no place for (decoder.layers."
            "self_attention.core_attention.softmax_offset (made by --softmax-type learnable)); "
            "they would not be loaded") in line, line


def test_sampling_with_a_seed_is_the_same_at_cp1_and_on_the_mesh(
        checkpoint: Path, prompt_file: Path, work: Path) -> None:
    args = ["--load", str(checkpoint), "--prompt-ids-file", str(prompt_file), "--max-new-tokens",
            str(NEW), "--temperature", "1.5", "--top-k", "40", "--top-p", "0.95", "--seed", "7"]
    run1, one = generate(1, args, work / "s1.jsonl")
    run4, mesh = generate(4, [*args, *GRIDS["2x2"]], work / "s4.jsonl")
    assert run1.returncode == 0, run1.output[-3000:]
    assert run4.returncode == 0, run4.output[-3000:]
    assert [r["generated_ids"] for r in mesh] == [r["generated_ids"] for r in one]
    run_other, other = generate(1, [*args[:-1], "8"], work / "s8.jsonl")
    assert run_other.returncode == 0
    assert [r["generated_ids"] for r in other] != [r["generated_ids"] for r in one]


def test_text_prompts_go_through_the_tokenizer(greedy_cp1: list[dict], checkpoint: Path,
                                              work: Path) -> None:
    """--prompts-file: one prompt a line through the model's tokenizer (NullTokenizer: ids
    as text); the same continuations as the ids, with their text."""
    path = work / "prompts.txt"
    path.write_text("".join(" ".join(map(str, p)) + "\n" for p in PROMPTS))
    run, records = generate(4, ["--load", str(checkpoint), "--prompts-file", str(path),
                                "--max-new-tokens", str(NEW), *GRIDS["1x4"]], work / "text.jsonl")
    assert run.returncode == 0, run.output[-3000:]
    for got, want in zip(records, greedy_cp1, strict=True):
        assert got["prompt_ids"] == want["prompt_ids"]
        assert got["generated_ids"] == want["generated_ids"]
        assert got["text"] == " ".join(map(str, want["generated_ids"]))


def each_rank(nproc: int, args: list[str]) -> Run:
    """generate on `nproc` ranks, none stopped for another's exit: each exits 2 by itself."""
    job = Job(args, job_env(), nproc, stop_others=False, module=GENERATE)
    run = job.wait(timeout=120)
    assert job.exitcodes == [2] * nproc, run.output[-3000:]
    return run


def _bad(work: Path, checkpoint: Path, name: str, prompts: object, extra: list[str]) -> Run:
    path = work / f"{name}.json"
    path.write_text(json.dumps(prompts))
    return each_rank(4, ["--config", TINY, "--load", str(checkpoint), "--prompt-ids-file",
                         str(path), *GRIDS["2x2"], *extra])


@pytest.mark.parametrize("name, prompts, extra, message", [
    ("long", [list(range(40))], ["--max-new-tokens", "32"],
     "40 prompt tokens + --max-new-tokens 32 exceed --max-position-embeddings 64"),
    ("empty", [[1, 2], []], [], "prompt 1: the prompt is empty"),
    ("vocab", [[1, 2, 256]], [], "token id 256 is outside the vocabulary (valid ids 0 .. 255)"),
    ("shape", [[1, 2]], ["--hidden-size", "128"],
     "holds a model with --hidden-size 64, the flags say 128"),
    ("layers", [[1, 2]], ["--num-layers", "3"],
     "holds a model with --num-layers 2, the flags say 3"),
    ("notjson", "x", [], "expected a non-empty JSON list of token-id lists"),
    ("noload", [[1, 2]], ["--load", "/nonexistent/ckpt"],
     "--load /nonexistent/ckpt: no such folder"),
    ("exchange", [[1, 2]], ["--decode-exchange", "ring"],
     "--decode-exchange 'ring': valid values are all_gather, all_reduce"),
])
def test_bad_input_exits_2_with_one_line(name: str, prompts: object, extra: list[str],
                                         message: str, checkpoint: Path, work: Path) -> None:
    """On 4 ranks: each exits 2, the line printed once (the first local rank; every rank
    finds the same error from the command line and the files)."""
    run = _bad(work, checkpoint, name, prompts, extra)
    assert run.returncode == 2, run.output[-3000:]
    errors = [line for line in run.output.splitlines() if line.startswith("generate: error:")]
    assert len(errors) == 1 and message in errors[0], run.output[-2000:]
    assert "Traceback" not in run.output
    assert "built for" not in run.output and "loaded weights" not in run.output  # no group


def test_bad_sampling_flags_and_prompt_files_exit_2_when_parsed(checkpoint: Path,
                                                                prompt_file: Path,
                                                                work: Path) -> None:
    """--temperature nan (or inf) was accepted and crashed in torch.multinomial after the
    model had loaded; a --prompts-file that is not UTF-8 raised UnicodeDecodeError on every
    rank. Each exits 2 with one line, before any process group."""
    latin = work / "latin1.txt"
    latin.write_bytes("caf\xe9 1 2\n".encode("latin-1"))
    cases = [
        (["--temperature", "nan"], "--temperature must be a finite number >= 0 (0: greedy), "
                                   "got nan"),
        (["--temperature", "inf"], "--temperature must be a finite number >= 0 (0: greedy), "
                                   "got inf"),
        (["--temperature", "-1"], "--temperature must be a finite number >= 0 (0: greedy), "
                                  "got -1.0"),
        (["--top-p", "nan"], "--top-p must be in (0, 1], got nan"),
        (["--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
        (["--top-k", "-1"], "--top-k must be >= 0 (0: all tokens), got -1"),
        (["--prompts-file", str(latin)], f"--prompts-file {latin}: not UTF-8 text (byte 3: "
                                         "invalid continuation byte); save it as UTF-8"),
    ]
    for extra, message in cases:
        run = launch(1, ["--config", TINY, "--load", str(checkpoint), "--prompt-ids-file",
                         str(prompt_file), *extra], module=GENERATE, timeout=120)
        line = refused(run)
        assert line == f"generate: error: {message}", (extra, line)


def test_a_fresh_generate_prints_no_library_warnings(checkpoint: Path, prompt_file: Path,
                                                     work: Path) -> None:
    """generate printed megatron-core's and torch's notes to their developers (a deprecated
    CUDA-graph scope, DCP's load_state_dict, ShardedTensor; about 16 lines on 4 ranks) that
    the driver hides. A fresh process, not forked from the tests' server (which imported the
    driver, filters and all): its own lines only, nothing on stderr."""
    out = work / "fresh.jsonl"
    proc = subprocess.run([sys.executable, "-m", GENERATE, "--config", TINY, "--load",
                           str(checkpoint), "--prompt-ids-file", str(prompt_file),
                           "--max-new-tokens", "2", "--output", str(out)],
                          env=job_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stderr == "" and "Warning" not in proc.stdout, proc.stderr[-3000:]
    assert "loaded weights" in proc.stdout and out.exists()


def test_a_flag_error_under_torchrun_is_printed_by_a_slow_rank(tmp_path: Path) -> None:
    """torchrun stops every rank once one ends. The first local rank prints a flag error;
    the others waited a fixed 2 s and exited, so a printing rank slower than that (a loaded
    machine; here slowed by 15 s through the tests' hook) was stopped with SIGTERM before it
    wrote, and `generate --max-new-tokens 0` on 2 ranks exited with no line at all. The
    others now wait until the line is written."""
    (tmp_path / "prompts.json").write_text("[[1, 2]]")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", "-m", GENERATE, "--load", str(tmp_path),
                           "--prompt-ids-file", str(tmp_path / "prompts.json"),
                           "--max-new-tokens", "0"],
                          env=job_env(**{PRINT_DELAY_ENV: "15"}), cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("generate: error:")]
    assert errors == ["generate: error: --max-new-tokens must be a positive integer, got 0"], \
        output[-3000:]


def test_a_chunked_model_generates_what_its_full_forward_predicts(
        checkpoint: Path, prompt_file: Path, work: Path) -> None:
    """A model trained with --attention-chunk-size 8 --no-rope-freq 2 (layer 1 chunked with
    RoPE, layer 2 causal over the whole sequence without): the same greedy ids and
    log-probabilities at CP = 1 and on 2x1x2, each generated token's log-probability the one
    a no-cache forward of its prompt and the tokens before it gives (the prefill of that
    sequence, one new token); --pack-prompts refused with one line."""
    ckpt = work / "ckpt-chunked"
    trained = launch(1, ["--config", TINY, "--train-iters", "20", "--data-path",
                         str(work / "arith"), "--data-cache-path", str(work / "index-cache"),
                         "--save", str(ckpt), "--save-interval", "20", "--context-parallel-algo",
                         "mesh", "--attention-chunk-size", "8", "--no-rope-freq", "2"])
    assert trained.returncode == 0, trained.output[-3000:]
    prompts = ["--load", str(ckpt), "--prompt-ids-file", str(prompt_file)]
    run1, one = generate(1, [*prompts, "--max-new-tokens", str(NEW), "--cp-comm-type", "mesh"],
                         work / "chunked-1.jsonl")
    run4, mesh = generate(4, [*prompts, "--max-new-tokens", str(NEW), *GRIDS["2x1x2"]],
                          work / "chunked-4.jsonl")
    for run in (run1, run4):
        assert run.returncode == 0, run.output[-3000:]
    for got, want in zip(mesh, one, strict=True):
        assert got["generated_ids"] == want["generated_ids"]
        assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-4)
    cases = [(r, k) for r in one for k in (0, 3, 11, 20, 30) if k < len(r["generated_ids"])]
    path = work / "chunked-prefixes.json"
    path.write_text(json.dumps([r["prompt_ids"] + r["generated_ids"][:k] for r, k in cases]))
    run, full = generate(1, ["--load", str(ckpt), "--prompt-ids-file", str(path),
                             "--max-new-tokens", "1", "--cp-comm-type", "mesh"],
                         work / "chunked-full.jsonl")
    assert run.returncode == 0, run.output[-3000:]
    for (r, k), got in zip(cases, full, strict=True):
        assert got["generated_ids"] == [r["generated_ids"][k]], (k, r)
        assert got["logprobs"][0] == pytest.approx(r["logprobs"][k], abs=1e-4), (k, r)
    line = refused(generate(1, [*prompts, "--pack-prompts", "--cp-comm-type", "mesh"],
                            work / "chunked-packed.jsonl")[0])
    assert "--pack-prompts with a model trained with --attention-chunk-size 8" in line, line
