"""`python -m megatron_mesh.generate` end to end on CPU: a tiny GPT trained a few iterations by
the driver on a 2-rank mesh (its checkpoint saved on that grid), then greedy generation of
32 tokens for a batch of prompts of different lengths (not multiples of 2P) at CP = 1 and
on the meshes 2x2, 1x4 and 2x1x2: the same token ids, log-probabilities equal to rounding;
sampling with a fixed --seed: the same tokens at CP = 1 and on 2x2; packed prompts placed by
document give the dense continuations; bad input exits 2 with one line before any
collective."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from preloaded import TINY, Run, build_indexed_dataset, launch

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


def generate(nproc: int, args: list[str], out: Path) -> tuple[Run, list[dict]]:
    run = launch(nproc, ["--config", TINY, *args, "--output", str(out)], module=GENERATE)
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


def test_model_flags_the_weights_do_not_pin_must_match(checkpoint: Path, prompt_file: Path,
                                                       work: Path) -> None:
    """RoPE's share of the head dims has no weights: generating with another
    --rotary-percent than the checkpoint's would load and run a different model, so it
    exits 2 naming both values, before any collective."""
    run, records = generate(1, ["--load", str(checkpoint), "--prompt-ids-file",
                                str(prompt_file), "--max-new-tokens", "2",
                                "--rotary-percent", "0.5"], work / "half.jsonl")
    assert run.returncode == 2 and not records, run.output[-3000:]
    assert "holds a model with --rotary-percent 1.0, the flags say 0.5" in run.output
    assert "Traceback" not in run.output


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


def test_windowed_model_with_learned_positions_on_the_mesh_equals_cp1(
        checkpoint: Path, prompt_file: Path, work: Path) -> None:
    """A model with a sliding window of 8 (its decode steps see the last 9 keys), learned
    absolute positions and learnable attention sinks, trained at CP = 1: the same greedy
    ids on 2x1x2 as at CP = 1."""
    model = ["--window-size", "8", "0", "--position-embedding-type", "learned_absolute",
             "--softmax-type", "learnable"]
    trained = launch(1, ["--config", TINY, "--train-iters", "30", "--data-path",
                         str(work / "arith"), "--data-cache-path", str(work / "index-cache"),
                         "--save", str(work / "ckpt-window"), "--save-interval", "30", *model])
    assert trained.returncode == 0, trained.output[-3000:]
    args = ["--load", str(work / "ckpt-window"), "--prompt-ids-file", str(prompt_file),
            "--max-new-tokens", str(NEW), *model]
    run1, one = generate(1, args, work / "window-1.jsonl")
    run4, mesh = generate(4, [*args, *GRIDS["2x1x2"]], work / "window-4.jsonl")
    assert run1.returncode == 0, run1.output[-3000:]
    assert run4.returncode == 0, run4.output[-3000:]
    for got, want in zip(mesh, one, strict=True):
        assert got["generated_ids"] == want["generated_ids"]
        assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-4)


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


def _bad(work: Path, checkpoint: Path, name: str, prompts: object, extra: list[str]) -> Run:
    path = work / f"{name}.json"
    path.write_text(json.dumps(prompts))
    return launch(4, ["--config", TINY, "--load", str(checkpoint), "--prompt-ids-file",
                      str(path), *GRIDS["2x2"], *extra], module=GENERATE, timeout=120)


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
    run = _bad(work, checkpoint, name, prompts, extra)
    assert run.returncode == 2, run.output[-3000:]
    errors = [line for line in run.output.splitlines() if line.startswith("generate: error:")]
    assert errors and all(message in e for e in errors), run.output[-2000:]
    assert "Traceback" not in run.output
    assert "built for" not in run.output and "loaded weights" not in run.output  # no group
