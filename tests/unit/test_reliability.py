"""Faults injected into the driver: corrupted and half-written checkpoints, a diverging run,
SIGTERM, and bad inputs. Each asserts the exit status, the message and that nothing saved
is lost. Runs are single-rank driver processes on mock data (the checks are rank-local or use
the same collectives at any world size); bad flags run in-process, before any group exists.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from preloaded import TINY, Job, Run, build_indexed_dataset, job_env

from megatron_mesh.pretrain_gpt import main

from reference import Failure, assert_no_failures

ROOT = Path(__file__).resolve().parents[2]
QUICK = ["--config", TINY, "--train-iters", "4", "--log-interval", "1"]  # mock data


def start_driver(args: list[str]) -> Job:
    """One driver process (world size 1, its own port): its output is all there is to read."""
    return Job(args, job_env())


def driver(args: list[str]) -> Run:
    return start_driver(args).wait(timeout=240)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A job that saved iterations 2 and 4."""
    root = tmp_path_factory.mktemp("ckpt") / "save"
    run = driver([*QUICK, "--save", str(root), "--save-interval", "2"])
    assert run.returncode == 0, run.output[-3000:]
    assert (root / "iter_0000004" / "checksums.json").is_file()
    (root.parent / "output.txt").write_text(run.output)
    return root


def _losses(output: str) -> dict[int, str]:
    """Iteration -> lm loss as the driver logs it."""
    found = re.findall(r"iteration\s+(\d+)/\s*\d+\s*\|.*?lm loss: (\S+)", output)
    return {int(it): loss for it, loss in found}


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


@pytest.mark.distributed
def test_corrupted_and_half_written_checkpoints_are_refused(saved: Path, tmp_path: Path) -> None:
    root = _copy(saved, tmp_path / "ckpt")
    (distcp,) = sorted((root / "iter_0000004").glob("*.distcp"))[:1]
    with open(distcp, "r+b") as f:  # 4 KiB of 0xFF in the middle of a tensor file
        f.seek(os.path.getsize(distcp) // 2)
        f.write(b"\xff" * 4096)
    run = driver([*QUICK, "--train-iters", "6", "--load", str(root)])
    assert run.returncode != 0
    assert "Traceback" not in run.output
    assert (f"checkpoint {root / 'iter_0000004'}: file {distcp.name} is corrupted" in run.output
            and "--ckpt-step N (complete here: 2)" in run.output), run.output[-2000:]
    # the marker cut short, an empty iter_ folder, a stale .tmp left by a crash
    (root / "latest_checkpointed_iteration.txt").write_bytes(b"\xff\x00")
    (root / "iter_0000005").mkdir()
    (root / "iter_0000006.tmp").mkdir()
    run = driver([*QUICK, "--train-iters", "6", "--load", str(root)])
    assert run.returncode != 0 and "Traceback" not in run.output
    assert "latest_checkpointed_iteration.txt is unreadable or truncated" in run.output
    run = driver([*QUICK, "--train-iters", "6", "--load", str(root), "--ckpt-step", "5"])
    assert run.returncode != 0 and "Traceback" not in run.output
    assert f"checkpoint {root / 'iter_0000005'} is empty; load an older one" in run.output
    # the older, intact checkpoint loads and the next save removes the stale folder
    run = driver([*QUICK, "--train-iters", "6", "--load", str(root), "--ckpt-step", "2",
                       "--use-checkpoint-opt_param-scheduler",  # the saved 4-iteration schedule
                       "--save", str(root), "--save-interval", "3"])
    assert run.returncode == 0, run.output[-3000:]
    assert f"loaded checkpoint {root / 'iter_0000002'}" in run.output
    assert "unfinished save of an earlier run" in run.output
    assert not (root / "iter_0000006.tmp").exists() and (root / "iter_0000006").is_dir()


@pytest.mark.distributed
def test_nan_loss_stops_every_rank_unsaved(tmp_path: Path) -> None:
    root = tmp_path / "save"
    run = driver([*QUICK, "--train-iters", "8", "--lr", "1e6", "--lr-warmup-iters", "0",
                       "--save", str(root), "--save-interval", "1"])
    assert run.returncode != 0
    assert "Traceback" not in run.output
    line = next(ln for ln in run.output.splitlines() if "is nan" in ln or "is inf" in ln)
    it = int(line.split("iteration ")[1].split(":")[0])
    assert "lm loss is" in line or "grad norm is" in line, line
    saved = sorted(p.name for p in root.glob("iter_*"))
    assert saved == [f"iter_{i:07d}" for i in range(1, it)], (saved, line)


@pytest.mark.distributed
def test_sigterm_saves_and_exits_cleanly(tmp_path: Path) -> None:
    root = tmp_path / "save"
    job = start_driver([*QUICK, "--train-iters", "100000", "--save", str(root),
                        "--exit-signal-handler"])
    for line in job.follow(timeout=120):
        if "iteration        3/" in line:
            os.kill(job.pid, signal.SIGTERM)
            break
    run = job.wait(timeout=120)
    output = run.output
    assert run.returncode == 0, output[-2000:]
    assert "SIGTERM received: saving and exiting after iteration" in output
    stopped = int(output.split("exiting after iteration ")[1].split()[0])
    assert stopped >= 3
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == str(stopped)


@pytest.mark.distributed
def test_exit_duration_saves_and_resume_continues_exactly(saved: Path, tmp_path: Path) -> None:
    """--exit-duration-in-mins already past at the first iteration's end: the job saves
    iteration 1 and exits 0; resumed, iterations 2-4 log the losses of the unbroken run."""
    root = tmp_path / "save"
    run = driver([*QUICK, "--save", str(root), "--exit-duration-in-mins", "0.001"])
    assert run.returncode == 0, run.output[-2000:]
    assert "--exit-duration-in-mins reached: saving and exiting after iteration 1" in run.output
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    resumed = driver([*QUICK, "--load", str(root), "--save", str(root)])
    assert resumed.returncode == 0, resumed.output[-2000:]
    unbroken = _losses((saved.parent / "output.txt").read_text())
    assert _losses(run.output) == {1: unbroken[1]}
    assert _losses(resumed.output) == {i: unbroken[i] for i in (2, 3, 4)}


@pytest.fixture
def small_disk(saved: Path, tmp_path: Path):
    """A tmpfs of 1.5 times one checkpoint of `saved`: the first save fits, the second
    fills it. Skips where this process may not mount."""
    size = sum(f.stat().st_size for f in (saved / "iter_0000004").rglob("*") if f.is_file())
    mount = tmp_path / "small_disk"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size * 3 // 2 // 4096 * 4}k",
                           "tmpfs", str(mount)], capture_output=True, text=True)
    if proc.returncode:
        pytest.skip(f"cannot mount a small tmpfs to fill ({proc.stderr.strip() or proc.returncode}; "
                    "needs root or CAP_SYS_ADMIN)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


@pytest.mark.distributed
def test_full_disk_during_a_save_says_so_on_every_rank(small_disk: Path) -> None:
    """Two ranks save iteration 2, then fill the disk saving iteration 4: both stop with one
    line that names the folder, the full disk and the intact checkpoint 2, which loads."""
    root = small_disk / "save"
    run = Job([*QUICK, "--save", str(root), "--save-interval", "2"], job_env(), nproc=2
              ).wait(timeout=240)
    assert run.returncode != 0 and "Traceback" not in run.output, run.output[-3000:]
    message = (f"pretrain_gpt: error: saving checkpoint 4 to {root} failed: the disk is full (")
    lines = [ln for ln in run.output.splitlines() if ln.startswith(message)]
    assert len(lines) == 2, run.output[-3000:]
    assert (f"the previous checkpoint 2 ({root / 'iter_0000002'}) is intact (the unfinished "
            "iter_0000004.tmp was removed)") in lines[0], lines[0]
    assert re.search(r"MiB free of [\d.]+ MiB, the last checkpoint took [\d.]+ MiB", lines[0])
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000002",
                                                      "latest_checkpointed_iteration.txt"]
    resumed = driver([*QUICK, "--load", str(root)])
    assert resumed.returncode == 0 and f"loaded checkpoint {root / 'iter_0000002'}" in (
        resumed.output), resumed.output[-2000:]


def _dataset(prefix: Path, *, bad_ids: bool = False) -> str:
    build_indexed_dataset(str(prefix))
    if bad_ids:
        ids = np.memmap(str(prefix) + ".bin", dtype=np.int32, mode="r+")
        ids[5] = 256  # tiny-cpu.yaml's --vocab-size 255: ids 0 .. 254 and the EOD id 255
        ids.flush()
    return str(prefix)


def _long_dataset(prefix: Path, tokens: int, bad_at: int) -> str:
    """One document of `tokens` int32 ids, all 7 but one 256 (out of vocabulary) at `bad_at`."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    ids = np.full(tokens, 7, dtype=np.int32)
    ids[bad_at] = 256
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=np.int32)
    builder.add_document(ids, [tokens])
    builder.finalize(str(prefix) + ".idx")
    return str(prefix)


def _damaged_index_cases(tmp_path: Path) -> list[tuple[list[str], str]]:
    """A good index cut to half, with a garbage document count, with garbage sequence
    pointers, a pointer that goes back, and a document index that runs backwards (64 sequences: lengths at
    bytes 34 .., pointers at 290 .., the document index at 802 ..)."""
    cases = []

    def damaged(name: str, edit, message: str) -> None:
        prefix = _dataset(tmp_path / name)
        data = bytearray(Path(prefix + ".idx").read_bytes())
        Path(prefix + ".idx").write_bytes(bytes(edit(data)))
        cases.append((["--data-path", prefix], f"{prefix}.idx is not a Megatron index ({message}"))

    damaged("half", lambda d: d[:len(d) // 2], "its counts (64 sequences, 64 documents) need")
    damaged("doc_count", lambda d: d[:26] + (123456789).to_bytes(8, "little") + d[34:],
            "its counts (64 sequences, 123456788 documents) need")
    pointers = np.random.default_rng(1).integers(0, 1 << 40, 64).astype("<i8").tobytes()
    damaged("pointers", lambda d: d[:290] + pointers + d[802:], "sequence 0 (bytes ")

    def repeat_pointer(d: bytearray) -> bytearray:  # sequence 5 starts where sequence 3 did
        ptr = np.frombuffer(bytes(d[290:802]), dtype="<i8").copy()
        ptr[5] = ptr[3]
        return d[:290] + ptr.tobytes() + d[802:]

    damaged("backwards", repeat_pointer, "sequence 5 starts at byte ")
    backwards = np.arange(65, dtype="<i8")[::-1].tobytes()
    damaged("documents", lambda d: d[:802] + backwards, "its document index is not ascending")
    return cases


def _tokenizer_path_cases(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                          ) -> list[tuple[list[str], str]]:
    """Tokenizer files that are not there: a path-like Hugging Face value, any value with the
    hub offline (and no such model in its cache), a SentencePiece model file."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    hf = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model"]
    missing = tmp_path / "tokenizers" / "llama-tok"
    return [
        ([*hf, str(missing)], f"--tokenizer-model {missing}: no such file or folder: {missing} "
                              "(a local tokenizer folder or a Hugging Face model name)"),
        ([*hf, "meta-llama/no-such-model"], "no such file or folder: meta-llama/no-such-model "
                                            "(a local tokenizer folder or a Hugging Face "
                                            "model name; the hub is offline"),
        (["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(missing)],
         f"--tokenizer-model {missing}: no such file: {missing}"),
    ]


def _sentencepiece_model(folder: Path, vocab: int) -> str:
    """A character-level SentencePiece model of `vocab` pieces, trained here."""
    spm = pytest.importorskip("sentencepiece", reason="sentencepiece is not installed (dev extra)")
    text = folder / "text.txt"
    text.write_text("\n".join(f"the quick brown fox {i} jumps over the lazy dog" for i in range(50)))
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(folder / "spm"),
                                   vocab_size=vocab, model_type="char", minloglevel=2)
    return str(folder / "spm.model")


def test_tokenizer_smaller_than_the_data_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A SentencePiece tokenizer of 40 pieces (the model's vocabulary: 64 rows, padded to
    --make-vocab-size-divisible-by 64) over data whose ids reach 254: exit 2 at start-up,
    naming the file, the id and the valid range; data inside the 64 ids passes."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from megatron_mesh.training.config.arguments import parse_args

    monkeypatch.setenv("WORLD_SIZE", "1")
    model = _sentencepiece_model(tmp_path, 40)
    tokenizer = ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", model]
    data = _dataset(tmp_path / "wide")
    ids = np.fromfile(data + ".bin", dtype=np.int32)
    code = main([*QUICK, *tokenizer, "--data-path", data])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert (f"token id {ids.max()} in {data}.bin is outside the model's vocabulary, ids 0 .. 63 "
            f"(--tokenizer-type SentencePieceTokenizer --tokenizer-model {model}: 40 tokens, "
            "padded to a multiple of 64") in err, err
    narrow = tmp_path / "narrow"
    builder = IndexedDatasetBuilder(str(narrow) + ".bin", dtype=np.int32)
    for start in range(64):
        builder.add_document((start + np.arange(80)) % 64, [80])
    builder.finalize(str(narrow) + ".idx")
    assert parse_args([*QUICK, *tokenizer, "--data-path", str(narrow)]).tokenizer_model == model


def test_bad_inputs_exit_2_before_any_group(tmp_path: Path, capsys: pytest.CaptureFixture,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "1")
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    empty = tmp_path / "empty"
    empty.with_suffix(".bin").write_bytes(b"")
    empty.with_suffix(".idx").write_bytes(b"")
    garbage = tmp_path / "garbage"
    garbage.with_suffix(".bin").write_bytes(os.urandom(256))
    garbage.with_suffix(".idx").write_bytes(os.urandom(256))
    good = _dataset(tmp_path / "good")
    bad_ids = _dataset(tmp_path / "bad_ids", bad_ids=True)
    deep_bad_id = _long_dataset(tmp_path / "deep", 20 << 20, (20 << 20) - 3)  # at 80 MiB
    noise_bin = _dataset(tmp_path / "noise_bin")  # a good index over random bytes
    size = os.path.getsize(noise_bin + ".bin")
    Path(noise_bin + ".bin").write_bytes(os.urandom(size))
    cases = [
        (["--save", str(a_file)], f"--save {a_file}: {a_file} is a file"),
        (["--save", str(a_file / "ckpt")], "is a file, not a folder"),
        (["--load", str(tmp_path / "nowhere")], "no such folder"),
        (["--kv-channels", "0"], "--kv-channels 0: must be a positive integer"),
        (["--global-batch-size", "0"], "--global-batch-size 0: must be a positive integer"),
        (["--exit-interval", "-3"], "--exit-interval -3: must be a positive integer"),
        (["--lr", "nan"], "--lr nan: must be a finite number"),
        (["--lr", "-1"], "--lr -1.0: must be a finite number in [0.0, inf]"),
        (["--adam-beta1", "1.0"], "--adam-beta1 1.0: must be a finite number in [0.0, 1.0)"),
        (["--adam-beta2", "-0.1"], "--adam-beta2 -0.1"),
        (["--seq-length", str(2**40), "--max-position-embeddings", str(2**40)],
         "GiB per rank"),
        (["--data-path", good, "--split", "1,x"], "--split 1,x: expected up to three"),
        (["--data-path", good, "--split", "1,2,3,4"], "--split 1,2,3,4"),
        (["--data-path", str(empty)], f"{empty}.idx is not a Megatron index (empty file)"),
        (["--data-path", str(garbage)], f"{garbage}.idx is not a Megatron index (bad header)"),
        (["--data-path", bad_ids], "token id 256"),
        (["--data-path", deep_bad_id], f"token id 256 in {deep_bad_id}.bin is outside the "
                                       "NullTokenizer's ids for --vocab-size 255 (0 .. 254 and "
                                       "the end-of-document id 255)"),
        (["--data-path", noise_bin], "is outside the NullTokenizer's ids for --vocab-size 255"),
        (["--data-path", str(tmp_path / "absent")], "absent"),
        (["--exit-duration-in-mins", "0"], "--exit-duration-in-mins 0.0"),
        *_damaged_index_cases(tmp_path),
        *_tokenizer_path_cases(tmp_path, monkeypatch),
    ]
    problems = []
    for flags, message in cases:
        code = main([*QUICK, *flags])
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.strip()]
        if code != 2 or message not in err or len(lines) != 1:
            problems.append(Failure(" ".join(flags), f"exit {code}, {err!r}"))
    assert_no_failures([problems])


def _driver_without(modules: tuple[str, ...], *command_lines: list[str],
                    command: str = "pretrain_gpt") -> list[tuple[int, str, str]]:
    """(exit status, stdout, stderr) of a command's (the driver's, or `generate`) command
    lines, run one after the other in a Python where `modules` cannot be imported, as after
    a plain `pip install .` (None in sys.modules: the import fails as for a missing package)."""
    code = f"""
import contextlib, io, json, sys
for m in {modules!r}:
    sys.modules[m] = None
from megatron_mesh.{command} import main
results = []
for argv in {[list(c) for c in command_lines]!r}:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's --help
            code = e.code
    results.append((code, out.getvalue(), err.getvalue()))
print(json.dumps(results))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=job_env(), cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [tuple(r) for r in json.loads(proc.stdout.splitlines()[-1])]


def test_driver_without_the_megatron_extra_names_it() -> None:
    """Without PyYAML --help still lists the flags and --config names the extra; without
    megatron-core even --help says which extra to install, for the driver and for generate.
    Exit 2, one line, no traceback."""
    extra = "pip install 'megatron-mesh[megatron]'"
    (help_code, help_out, _), config = _driver_without(("yaml",), ["--help"], ["--config", TINY])
    assert help_code == 0 and "--tokenizer-model" in help_out
    (no_megatron,) = _driver_without(("megatron", "yaml"), ["--help"])
    generate_help, generate_run = _driver_without(
        ("megatron",), ["--help"], ["--load", "ckpt"], command="generate")
    for (code, _, err), message in (
            (config, f"--config {TINY}: reading YAML needs PyYAML, part of the 'megatron' extra: "
                     f"{extra}"),
            (no_megatron, f"pretrain_gpt needs the 'megatron' extra (no module named "
                          f"'megatron.core'): {extra}"),
            *((g, f"generate needs the 'megatron' extra (no module named 'megatron.core'): {extra}")
              for g in (generate_help, generate_run))):
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert code == 2 and len(lines) == 1 and message in lines[0], err


def test_fault_wait_mode_runs_on_at_the_signal_and_at_no_other_iteration(monkeypatch):
    """`wait` holds a rank at its iteration until a handled signal arrives (the handler
    still runs); other ranks and iterations pass at once."""
    import threading

    from megatron_mesh.training.loop import faults

    monkeypatch.setenv(faults.ENV, "*:3:wait")
    faults.configured.cache_clear()
    handled = []
    previous = signal.signal(signal.SIGUSR2, lambda s, f: handled.append(s))
    try:
        faults.maybe_fail(0, 2)  # not its iteration: returns
        done = threading.Event()

        def send_until_done() -> None:  # as the Slurm scripts do: again until the rank goes on
            while not done.is_set():
                os.kill(os.getpid(), signal.SIGUSR2)
                done.wait(0.05)

        sender = threading.Thread(target=send_until_done)
        sender.start()
        try:
            faults.maybe_fail(1, 3)
        finally:
            done.set()
            sender.join()
        assert handled and set(handled) == {signal.SIGUSR2}
    finally:
        signal.signal(signal.SIGUSR2, previous)
        faults.configured.cache_clear()
    assert faults.parse("*:3:wait") == (None, 3, "wait")
    assert faults.parse("2:5") == (2, 5, "kill")
