"""python -m megatron_mesh.preprocess: 300 real text files (the Python standard library's
modules) tokenized by a byte-level BPE trained here into an indexed dataset holding each
file's tokens (checked against the tokenizer loaded independently) and its end-of-document
id; the summary, the progress line and the length histogram; the driver trains on the
dataset unchanged and the planner reads the histogram; bad input exits 2 with one line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from preloaded import ROOT, TINY, driver, job_env
from preprocess_cli import refused

from megatron_mesh.cli import main as plan_main
from megatron_mesh.planner.pricing.length_histogram import LengthHistogram
from megatron_mesh.preprocess import TOKENIZER_TYPES, main

pytestmark = pytest.mark.distributed
FILES = 300


def _text_files(folder: Path) -> list[Path]:
    """The first FILES UTF-8 .py files of the standard library (sorted), copied to folder."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    folder.mkdir()
    out = []
    for path in sorted(stdlib.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts or not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        copy = folder / f"{len(out):03d}_{path.name}"
        copy.write_text(text, encoding="utf-8")
        out.append(copy)
        if len(out) == FILES:
            return out
    raise AssertionError(f"the standard library holds {len(out)} text files")


def _tokenizer(files: list[Path], folder: Path) -> str:
    """A byte-level BPE of 320 tokens trained on the files, saved as a HF tokenizer folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train([str(f) for f in files[:40]], trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(
        str(folder))
    return str(folder)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("corpus")
    files = _text_files(root / "in")
    tokenizer = _tokenizer(files, root / "tok")
    done = subprocess.run(
        [sys.executable, "-m", "megatron_mesh.preprocess", "--input", str(root / "in"),
         "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tokenizer,
         "--output-prefix", str(root / "stdlib"), "--append-eod", "--workers", "2"],
        env=job_env(HF_HUB_OFFLINE="1"), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return {"root": root, "files": files, "tokenizer": tokenizer, "out": done.stdout,
            "err": done.stderr, "prefix": str(root / "stdlib_text_document")}


def test_dataset_holds_each_files_tokens_and_the_summary(corpus: dict) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(corpus["tokenizer"])
    eod = reference.eos_token_id
    data = IndexedDataset(corpus["prefix"])
    assert len(data) == FILES
    lengths = []
    for i, path in enumerate(corpus["files"]):  # input order: sorted paths
        want = reference(path.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
        got = data[i].tolist()
        assert got == [*want, eod], (i, path.name)
        lengths.append(len(got))
    tokens = sum(lengths)
    out = corpus["out"]
    assert f"{FILES} documents, {tokens} tokens" in out, out
    ordered = np.sort(lengths)
    for p in (0, 50, 90, 100):
        assert f"p{p} {int(np.percentile(ordered, p, method='nearest'))}" in out, out
    assert f"train with --data-path {corpus['prefix']}" in out, out
    # progress on stderr (not a terminal: lines), the last one complete
    last = corpus["err"].strip().splitlines()[-1]
    assert last.startswith(f"{FILES} documents | {tokens} tokens | ") and "tokens/s" in last \
        and "100.0% of the input | ETA 0:00:00" in last, corpus["err"][-2000:]
    # the histogram: every document in its bin, the file's totals
    histogram_file = corpus["prefix"] + "_lengths.json"
    assert f"--doc-length-dist histogram:{histogram_file}" in out
    raw = json.loads(Path(histogram_file).read_text())
    assert (raw["documents"], raw["tokens"]) == (FILES, tokens)
    bins = LengthHistogram.read(histogram_file).bins
    assert [c for _, _, c in bins] == [sum(first <= n <= last for n in lengths)
                                       for first, last, _ in bins]
    assert sum(c for _, _, c in bins) == FILES


def test_the_driver_trains_on_it_and_the_planner_reads_its_lengths(
        corpus: dict, capsys: pytest.CaptureFixture) -> None:
    run = driver(["--config", TINY, "--tokenizer-type", "HuggingFaceTokenizer",
                  "--tokenizer-model", corpus["tokenizer"], "--data-path", corpus["prefix"],
                  "--data-cache-path", str(corpus["root"] / "cache"), "--train-iters", "3",
                  "--lr-warmup-iters", "0", "--eod-mask-loss"], HF_HUB_OFFLINE="1")
    assert run.returncode == 0, run.output[-3000:]
    losses = run.losses()
    assert sorted(losses) == [1, 2, 3] and all(np.isfinite(list(losses.values())))
    assert f"data: {corpus['prefix']}" in run.output
    histogram = corpus["prefix"] + "_lengths.json"
    plan_main(["plan", "--gpus", "4", "--seq-length", "131072", "--num-heads", "8",
               "--hidden-size", "1024", "--doc-length-dist", f"histogram:{histogram}:1"])
    assert "best placed" in capsys.readouterr().out


def test_bad_input_exits_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    null = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    lines = tmp_path / "docs.jsonl"
    lines.write_text('{"text": "1 2 3"}\n{"content": "4 5"}\n')
    binary = tmp_path / "bin"
    binary.mkdir()
    (binary / "a.txt").write_bytes(b"\xff\xfe\x00")
    words = tmp_path / "words.jsonl"
    words.write_text('{"text": "1 2 hello"}\n')
    wide = tmp_path / "wide.jsonl"
    wide.write_text('{"text": "1 200"}\n')
    prefix = str(tmp_path / "out")
    cases = [
        (["--input", str(tmp_path / "missing.jsonl"), *null], "--input "
         f"{tmp_path / 'missing.jsonl'}: no such file or folder"),
        (["--input", str(lines), *null], f"{lines} line 2: no key 'text' (--json-key; the "
         "line has ['content'])"),
        (["--input", str(lines), "--tokenizer-type", "WordPiece"],
         "argument --tokenizer-type: invalid choice: 'WordPiece'"),
        (["--input", str(binary), *null], f"{binary / 'a.txt'}: not UTF-8 text (byte 0)"),
        (["--input", str(lines), "--tokenizer-type", "NullTokenizer"],
         "--tokenizer-type NullTokenizer needs --vocab-size N"),
        (["--input", str(words), *null], f"{words} line 1: the tokenizer rejects it"),
        (["--input", str(wide), *null], f"{wide} line 1: token id 200 outside the "
         "tokenizer's vocabulary 0 .. 100"),
        (["--input", str(lines), "--tokenizer-type", "HuggingFaceTokenizer",
          "--tokenizer-model", str(tmp_path / "no-tok")], "no such file or folder"),
    ]
    for argv, message in cases:
        err = refused([*argv, "--output-prefix", prefix], capsys)
        assert message in err, (argv, err)
    assert not list(tmp_path.glob("out*")), "a refused input left output behind"


def test_ids_through_the_null_tokenizer(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """NullTokenizer: each line's ids as written, its end-of-document id V after each."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    lines = tmp_path / "ids.jsonl"
    lines.write_text('{"body": "5 6 7"}\n\n{"body": "99"}\n')
    assert main(["--input", str(lines), "--json-key", "body", "--tokenizer-type",
                 "NullTokenizer", "--vocab-size", "100", "--output-prefix",
                 str(tmp_path / "ids"), "--append-eod"]) == 0
    data = IndexedDataset(str(tmp_path / "ids_body_document"))
    assert [data[i].tolist() for i in range(len(data))] == [[5, 6, 7, 100], [99, 100]]
    assert "2 documents, 6 tokens" in capsys.readouterr().out


def test_tokenizer_types_are_the_drivers() -> None:
    from megatron_mesh.training.config.arguments import TOKENIZER_TYPES as DRIVER

    assert TOKENIZER_TYPES == DRIVER
    assert os.path.isfile(ROOT / "megatron_mesh" / "preprocess.py")
