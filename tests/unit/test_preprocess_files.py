"""python -m megatron_mesh.preprocess, in this process: the dataset's files appear only whole
(written under private names, renamed at the end), so a stopped, failed or concurrent run
never leaves a partial or mixed dataset; outputs it cannot write and bad input stop it in
one line before tokenizing; empty documents and blank lines are counted, in the progress
line as in the summary; the ETA waits for a rate; GPT-2 BPE files load with the hub
offline. Every dataset is read back and compared token by token."""
from __future__ import annotations

import io
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from preprocess_cli import refused

from megatron_mesh.preprocess import main
from megatron_mesh.training.data.preprocess_data import Progress, documents

NULL = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"]


def _tokens(prefix: str | Path) -> list[list[int]]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    data = IndexedDataset(str(prefix))
    return [data[i].tolist() for i in range(len(data))]


def _jsonl(path: Path, texts: list[str], key: str = "text") -> Path:
    path.write_text("".join(json.dumps({key: t}) + "\n" for t in texts))
    return path


def _files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


def test_outputs_it_cannot_write_stop_before_tokenizing(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    """Each refused in one line, exit 2; the input's lines would be refused by the
    tokenizer, so a message about the output says it came first; nothing is left."""
    words = _jsonl(tmp_path / "words.jsonl", ["1 2 hello"], key="a/b")
    plain = _jsonl(tmp_path / "plain.jsonl", ["1 2 hello"])
    (tmp_path / "a-file").write_text("not a folder")
    (tmp_path / "taken_text_document.bin").mkdir()
    (tmp_path / "held_text_document_lengths.json").mkdir()
    cases = [
        (plain, str(tmp_path / "a-file" / "corpus"), f"{tmp_path / 'a-file'} is a file, not a "
         "folder"),
        (plain, str(tmp_path / "taken"), f"{tmp_path / 'taken_text_document.bin'} is a folder"),
        (plain, str(tmp_path / "held"), "held_text_document_lengths.json is a folder"),
        (plain, str(tmp_path / "out") + "/", f"--output-prefix '{tmp_path / 'out'}/' names a "
         f"folder, not the start of a file name: give e.g. {tmp_path / 'out' / 'corpus'}"),
        (words, str(tmp_path / "out"), "--json-key 'a/b': the key also names the output"),
    ]
    if os.path.isdir("/sys") and not os.access("/sys", os.W_OK):  # as root too: sysfs
        cases.append((plain, "/sys/corpus", "--output-prefix /sys/corpus: cannot write in "
                      "/sys (Permission denied)"))
    before = _files(tmp_path)
    for source, prefix, message in cases:
        key = ["--json-key", "a/b"] if source == words else []
        err = refused(["--input", str(source), *key, *NULL, "--output-prefix", prefix], capsys)
        assert message in err, (prefix, err)
    assert _files(tmp_path) == before


def test_a_bad_line_near_the_end_stops_the_run_before_tokenizing(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Line 2 is text the tokenizer rejects, line 400 is not JSON: the input is read whole
    first, so line 400 is named (tokenizing first would have named line 2)."""
    lines = _jsonl(tmp_path / "docs.jsonl", ["1 2", "3 hello", *["4 5 6"] * 397])
    with open(lines, "a") as f:
        f.write('{"text": "7 8"\n')
    err = refused(["--input", str(lines), *NULL, "--output-prefix", str(tmp_path / "out")],
                   capsys)
    assert f"{lines} line 400: not JSON" in err, err
    assert _files(tmp_path) == {"docs.jsonl"}


def test_empty_documents_blank_lines_and_a_new_folder(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """`{"text": ""}` (NullTokenizer too): the end-of-document token alone with --append-eod,
    left out without; blank lines skipped; both counted in the summary. A relative
    --output-prefix in folders that do not exist yet makes them."""
    monkeypatch.chdir(tmp_path)
    Path("docs.jsonl").write_text('{"text": "5 6"}\n\n{"text": ""}\n   \n{"text": "7"}\n'
                                  '{"text": ""}\n')
    assert main(["--input", "docs.jsonl", *NULL, "--output-prefix", "data/new/corpus",
                 "--append-eod"]) == 0
    out = capsys.readouterr().out
    assert "4 documents, 7 tokens in " in out and ("(2 of them empty: the end-of-document "
                                                   "token alone; 2 blank lines skipped)") in out
    assert _tokens("data/new/corpus_text_document") == [[5, 6, 1000], [1000], [7, 1000],
                                                        [1000]]
    assert main(["--input", "docs.jsonl", *NULL, "--output-prefix", "data/new/bare"]) == 0
    out = capsys.readouterr().out
    assert "2 documents, 3 tokens in " in out and "(2 empty documents left out; 2 blank " \
        "lines skipped)" in out, out
    assert _tokens("data/new/bare_text_document") == [[5, 6], [7]]
    assert sorted(os.listdir("data/new")) == sorted(
        f"{name}_text_document{s}" for name in ("corpus", "bare")
        for s in (".bin", ".idx", "_lengths.json"))


def test_the_progress_counts_documents_as_the_summary_does(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture) -> None:
    """An empty document left out and a blank line are no documents of the progress line
    either; it counts the input documents read of those the input holds, and every input
    byte (blank lines too) as read, the ETA's measure."""
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "5 6"}\n\n{"text": ""}\n   \n{"text": "7"}\n\n{"text": "8 9"}\n')
    assert main(["--input", str(path), *NULL, "--output-prefix", str(tmp_path / "c")]) == 0
    captured = capsys.readouterr()
    assert "3 documents, 5 tokens in " in captured.out, captured.out
    last = captured.err.strip().splitlines()[-1]
    assert last.startswith("3 documents | 5 tokens | "), captured.err
    assert last.endswith("| 4 of 4 read, 100.0% of the input | ETA 0:00:00"), captured.err
    assert sum(doc.nbytes for doc in documents(str(path), "text")) == path.stat().st_size


def test_a_failed_rerun_leaves_the_earlier_dataset_whole(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    """A rerun that fails at document 300 (the tokenizer rejects it), after the first 299
    were written: the earlier dataset's three files are as they were, nothing else stays."""
    good = _jsonl(tmp_path / "good.jsonl", ["1 2 3", "4"])
    prefix = tmp_path / "out" / "corpus"
    assert main(["--input", str(good), *NULL, "--output-prefix", str(prefix)]) == 0
    folder = tmp_path / "out"
    before = {name: (folder / name).read_bytes() for name in os.listdir(folder)}
    assert len(before) == 3
    capsys.readouterr()
    bad = _jsonl(tmp_path / "bad.jsonl", [*["9 9 9"] * 299, "9 x"])
    err = refused(["--input", str(bad), *NULL, "--output-prefix", str(prefix)], capsys)
    assert f"{bad} line 300: the tokenizer rejects it" in err
    assert {name: (folder / name).read_bytes() for name in os.listdir(folder)} == before
    assert _tokens(str(prefix) + "_text_document") == [[1, 2, 3], [4]]


def test_two_runs_to_one_prefix_at_once_leave_one_runs_whole_output(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Two runs (threads of this process) write to the same prefix at once, one 4000
    documents of 40 tokens, the other 6000 of 1 (writing the first blocks of the .bin last,
    and finishing first): the dataset left is exactly one run's, its lengths file the same
    run's, and no private file stays."""
    shapes = {1: (4000, 40), 2: (6000, 1)}  # documents, tokens each
    want = {run: [[run, *[i % 900] * (n - 2), run][:n] for i in range(count)]
            for run, (count, n) in shapes.items()}
    inputs = {run: _jsonl(tmp_path / f"{run}.jsonl", [" ".join(map(str, d)) for d in docs])
              for run, docs in want.items()}
    prefix = str(tmp_path / "shared")
    codes: dict[int, object] = {}

    def run(which: int) -> None:
        try:
            codes[which] = main(["--input", str(inputs[which]), *NULL, "--output-prefix",
                                 prefix])
        except SystemExit as e:
            codes[which] = e.code

    threads = [threading.Thread(target=run, args=(which,)) for which in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert codes == {1: 0, 2: 0}, capsys.readouterr().err
    got = _tokens(prefix + "_text_document")
    winner = 1 if len(got) == shapes[1][0] else 2
    assert got == want[winner], [d for d in got if d[0] != d[-1] or d[0] != winner][:3]
    lengths = json.loads(Path(prefix + "_text_document_lengths.json").read_text())
    assert (lengths["documents"], lengths["tokens"]) == (shapes[winner][0],
                                                         shapes[winner][0] * shapes[winner][1])
    assert _files(tmp_path) == {"1.jsonl", "2.jsonl", *(f"shared_text_document{s}" for s in
                                                         (".bin", ".idx", "_lengths.json"))}


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                    reason="signal handlers need the main thread")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_run_leaves_nothing(tmp_path: Path, capsys: pytest.CaptureFixture,
                                      signum: int) -> None:
    """The signal comes while documents are being written (the private .bin has grown):
    exit 128 + signal, one line, the earlier dataset untouched and no private file left."""
    prefix = str(tmp_path / "corpus")
    small = _jsonl(tmp_path / "small.jsonl", ["1 2"])
    assert main(["--input", str(small), *NULL, "--output-prefix", prefix]) == 0
    capsys.readouterr()
    before = {p: p.read_bytes() for p in tmp_path.glob("corpus*")}
    big = _jsonl(tmp_path / "big.jsonl", [" ".join(["7"] * 50)] * 40_000)
    late: list[int] = []  # a signal after the run ends lands here, not in pytest
    previous = signal.signal(signum, lambda s, f: late.append(s))
    sent = threading.Event()

    def stop_when_writing() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            growing = [p for p in tmp_path.glob(".corpus*.bin.partial") if p.stat().st_size]
            if growing:
                os.kill(os.getpid(), signum)
                sent.set()
                return
            time.sleep(0.002)

    watcher = threading.Thread(target=stop_when_writing)
    watcher.start()
    try:
        with pytest.raises(SystemExit) as exit_info:
            main(["--input", str(big), *NULL, "--output-prefix", prefix])
    finally:
        watcher.join()
        signal.signal(signum, previous)
    err = capsys.readouterr().err
    assert sent.is_set() and not late
    assert exit_info.value.code == 128 + signum, err
    name = signal.Signals(signum).name
    assert err.strip().splitlines()[-1].startswith(f"preprocess: stopped by {name}: nothing "
                                                   "written"), err
    assert {p: p.read_bytes() for p in tmp_path.glob("corpus*")} == before
    assert _files(tmp_path) == {"small.jsonl", "big.jsonl", *(p.name for p in before)}


def test_the_eta_waits_for_a_rate() -> None:
    """No ETA from the first document (start-up would make it hours); then remaining bytes
    at the rate since the first document; the final line reads all input, ETA 0."""
    stream = io.StringIO()
    progress = Progress(1000, stream=stream, every=3600)
    progress.add(5, 10)
    assert progress.line().endswith("1.0% of the input | ETA --")
    quick = Progress(1000, stream=stream, every=3600, eta_after=0.0)
    quick.add(5, 10)
    assert quick.eta() == "--"  # one document: no rate yet
    time.sleep(0.01)
    quick.add(5, 10)
    assert quick.eta() not in ("--", "0:00:00") and quick.eta().startswith("0:00:")
    quick.show(final=True)
    assert stream.getvalue().endswith("100.0% of the input | ETA 0:00:00\n")


def _gpt2_files(folder: Path, texts: list[str]) -> tuple[str, str]:
    """A GPT-2 style vocab.json / merges.txt pair of 300 tokens trained on `texts`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder.mkdir()
    vocab, merges = tok.model.save(str(folder))
    return vocab, merges


def test_gpt2_bpe_files_load_with_the_hub_offline(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """--tokenizer-type GPT2BPETokenizer --vocab-file --merge-file, HF_HUB_OFFLINE=1 and no
    hub cache: the dataset holds each text's byte-level BPE ids (the `tokenizers` library's
    own reader of the two files) and the end of document; the driver's vocabulary check
    builds the same tokenizer."""
    from argparse import Namespace

    from tokenizers import ByteLevelBPETokenizer

    from megatron_mesh.training.data.tokenizer_check import model_token_ids

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "no-hub"))
    texts = ["The quick brown fox jumps over the lazy dog.", "  two  spaces\tand a tab\n",
             "über naïve café 123 4567", "x"]
    vocab, merges = _gpt2_files(tmp_path / "gpt2", texts * 20)
    lines = _jsonl(tmp_path / "docs.jsonl", texts)
    flags = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file",
             merges]
    assert main(["--input", str(lines), *flags, "--output-prefix", str(tmp_path / "bpe"),
                 "--append-eod"]) == 0
    reference = ByteLevelBPETokenizer.from_file(vocab, merges)
    eod = reference.token_to_id("<|endoftext|>")
    want = [[*reference.encode(t).ids, eod] for t in texts]
    assert _tokens(tmp_path / "bpe_text_document") == want
    assert max(max(ids) for ids in want) > 256  # merges were used
    args = Namespace(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab, merge_file=merges,
                     tokenizer_model=None, make_vocab_size_divisible_by=128,
                     tensor_model_parallel_size=1)
    assert model_token_ids(args).count == 384  # 300 tokens padded to 128s
    capsys.readouterr()
    no_eod = tmp_path / "no-eod.json"
    no_eod.write_text(json.dumps({k: v for k, v in json.loads(Path(vocab).read_text()).items()
                                  if k != "<|endoftext|>"}))
    err = refused(["--input", str(lines), "--tokenizer-type", "GPT2BPETokenizer",
                    "--vocab-file", str(no_eod), "--merge-file", merges, "--output-prefix",
                    str(tmp_path / "x")], capsys)
    assert f"--vocab-file {no_eod}: holds no '<|endoftext|>' token" in err, err
