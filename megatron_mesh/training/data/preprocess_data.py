"""Text to a Megatron indexed dataset the driver trains on (`python -m megatron_mesh.preprocess`).

Documents come from JSON lines (the value of one key per line) or from a folder (each file
one document, its whole text, files in sorted path order). Each is tokenized with the
tokenizer the driver builds for the same flags (`data.build_tokenizer`), in --workers
processes (documents keep their input order), an end-of-document id appended with
--append-eod, and written by megatron-core's `IndexedDatasetBuilder` as PREFIX_KEY_document
.bin / .idx (Megatron-LM's names), in the smallest dtype that holds the vocabulary. A
progress line on stderr shows the documents written (as the summary counts them), tokens,
tokens/s, the input documents read of those the input holds and the ETA from input bytes
read (blank lines' included); the summary gives the length percentiles and writes the length histogram
(`planner/pricing/length_histogram.py`) the planner's `--doc-length-dist histogram:FILE` reads.
The input is read whole once before tokenizing (a bad line stops the run at once), and the
three files appear only whole (`DatasetFiles`).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import secrets
import signal
import sys
import threading
import time
from array import array
from collections import deque
from contextlib import closing, contextmanager
from dataclasses import dataclass, replace
from typing import Iterator

import numpy as np

from megatron_mesh.planner.pricing.length_histogram import LengthHistogram
from megatron_mesh.training.data import tokenizer_check

CHUNK = 64  # documents a worker tokenizes per task
PERCENTILES = (0, 10, 50, 90, 99, 100)


class InputError(ValueError):
    """Input that cannot be read as documents; the command exits 2 with its message."""


@dataclass(frozen=True)
class Document:
    """One document's text and the input bytes it came from (for the ETA)."""

    text: str
    where: str  # "FILE line N" or the file's path
    nbytes: int  # its line's, and the blank lines' just before it


def input_files(path: str) -> list[str]:
    """--input: a JSON lines file, or every file under a folder (sorted); InputError when
    missing or empty."""
    if os.path.isdir(path):
        files = sorted(os.path.join(root, name) for root, _, names in os.walk(path)
                       for name in names)
        if not files:
            raise InputError(f"--input {path}: the folder holds no file")
        return files
    if not os.path.isfile(path):
        raise InputError(f"--input {path}: no such file or folder")
    return [path]


def _records(path: str, key: str) -> Iterator[Document | None]:
    """The documents of --input `path` in order (a folder: one a file; a file: one a JSON
    line, its `key`, its bytes counting the blank lines before it), None for each blank
    line; InputError naming the file and line of what cannot be read."""
    if os.path.isdir(path):
        for name in input_files(path):
            with open(name, "rb") as f:
                raw = f.read()
            yield Document(_text(raw, name), name, len(raw))
        return
    blank = 0  # bytes of the blank lines since the last document
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                blank += len(raw)
                yield None
                continue
            where = f"{path} line {number}"
            try:
                record = json.loads(_text(raw, where))
            except json.JSONDecodeError as e:
                raise InputError(f"{where}: not JSON ({e.msg}); --input takes JSON lines "
                                 "or a folder of text files") from None
            if not isinstance(record, dict) or key not in record:
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise InputError(f"{where}: no key {key!r} (--json-key; the line has {keys})")
            if not isinstance(record[key], str):
                raise InputError(f"{where}: {key!r} holds {type(record[key]).__name__}, not "
                                 "text")
            yield Document(record[key], where, blank + len(raw))
            blank = 0


def documents(path: str, key: str) -> Iterator[Document]:
    """The documents of --input `path` in order, blank lines skipped (`_records`)."""
    return (doc for doc in _records(path, key) if doc is not None)


def check_documents(path: str, key: str) -> tuple[int, int]:
    """Read all of --input once without tokenizing: InputError at the first line or file
    that cannot be read (so a bad line near the end stops the run before the long part);
    returns (documents, blank lines skipped)."""
    found = blank = 0
    for doc in _records(path, key):
        found += doc is not None
        blank += doc is None
    return found, blank


def _text(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{where}: not UTF-8 text (byte {e.start})") from None


class _Ids:
    """Text to token ids with one tokenizer: an empty text has none (the tokenizer is not
    asked: NullTokenizer would fail on it), NullTokenizer's ids are read as written."""

    def __init__(self, tokenizer, null: bool):
        self.tokenizer, self.null = tokenizer, null

    def __call__(self, chunk: list[tuple[str, str]]) -> list[list[int] | str]:
        """Each (text, where) as ids, or the error's text."""
        out: list[list[int] | str] = []
        for text, where in chunk:
            try:
                ids = [] if not text or (self.null and not text.strip()) else \
                    self.tokenizer.tokenize(text)
                out.append([int(i) for i in ids])
            except Exception as e:  # noqa: BLE001 - a tokenizer's error, as one line
                reason = " ".join(str(e).split()) or type(e).__name__
                out.append(f"{where}: the tokenizer rejects it ({reason[:200]})")
        return out


_worker_ids: _Ids | None = None  # a worker process's tokenizer


def _start_worker(args: argparse.Namespace) -> None:
    global _worker_ids
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the parent stops the pool
    _worker_ids = _Ids(load_tokenizer(args), args.tokenizer_type == "NullTokenizer")


def _tokenize(chunk: list[tuple[str, str]]) -> list[list[int] | str]:
    return _worker_ids(chunk)


def load_tokenizer(args: argparse.Namespace):
    """The driver's tokenizer for these flags (`data.build_tokenizer`)."""
    from megatron_mesh.training.data.datasets import build_tokenizer

    return build_tokenizer(args)


def check_tokenizer(args: argparse.Namespace):
    """The tokenizer, or InputError naming why it cannot be built (the driver's checks)."""
    if args.tokenizer_type == "NullTokenizer" and (args.vocab_size or 0) < 1:
        raise InputError("--tokenizer-type NullTokenizer needs --vocab-size N (ids 0 .. N - 1; "
                         "end of document N)")
    if args.tokenizer_type == "GPT2BPETokenizer" and not (args.vocab_file and args.merge_file):
        raise InputError("--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file")
    if args.tokenizer_type not in ("NullTokenizer", "GPT2BPETokenizer") and \
            not args.tokenizer_model:
        raise InputError(f"--tokenizer-type {args.tokenizer_type} needs --tokenizer-model")
    try:
        tokenizer_check.check_tokenizer_files(args)
    except ValueError as e:
        raise InputError(str(e)) from None
    try:
        return load_tokenizer(args)
    except Exception as e:  # noqa: BLE001 - any library's load error, as one line
        reason = " ".join(str(e).split()) or type(e).__name__
        raise InputError(f"--tokenizer-type {args.tokenizer_type}: the tokenizer cannot be "
                         f"loaded ({reason[:300]})") from None


class Progress:
    """One line on stderr: the documents written (as the summary counts them: not an empty
    one left out), tokens, tokens/s, the input documents read (of `total_documents`, when
    known) and the ETA from the input bytes; rewritten in place on a terminal, a new line
    every `every` seconds elsewhere. The ETA comes from the rate since the first document
    (start-up is not work) and reads `--` until `eta_after` seconds of that rate exist."""

    def __init__(self, total_bytes: int, stream=None, every: float | None = None,
                 eta_after: float = 2.0, total_documents: int | None = None):
        self.total, self.stream = max(total_bytes, 1), stream or sys.stderr
        self.total_documents, self.read = total_documents, 0
        self.tty = self.stream.isatty()
        self.every = every if every is not None else (0.2 if self.tty else 10.0)
        self.eta_after = eta_after
        self.start = self.last = time.monotonic()
        self.documents = self.tokens = self.done_bytes = 0
        self.first: tuple[float, int] | None = None  # (time, bytes) at the first document

    def add(self, tokens: int, nbytes: int, written: bool = True) -> None:
        """One input document read: `tokens` written of it (`written`: as a document of
        the dataset), `nbytes` of the input."""
        self.read += 1
        self.documents += written
        self.tokens += tokens
        self.done_bytes += nbytes
        now = time.monotonic()
        if self.first is None:
            self.first = (now, self.done_bytes)
        if now - self.last >= self.every:
            self.last = now
            self.show()

    def eta(self) -> str:
        """The time left as H:MM:SS, or `--` without a rate yet."""
        if self.done_bytes >= self.total:
            return _clock(0)
        if self.first is None:
            return "--"
        seconds = time.monotonic() - self.first[0]
        done = self.done_bytes - self.first[1]
        if seconds < self.eta_after or done <= 0:
            return "--"
        return _clock((self.total - self.done_bytes) * seconds / done)

    def line(self) -> str:
        seconds = max(time.monotonic() - self.start, 1e-9)
        share = min(self.done_bytes / self.total, 1.0)
        of = "" if self.total_documents is None else f" of {self.total_documents}"
        return (f"{self.documents} documents | {self.tokens} tokens | "
                f"{self.tokens / seconds:,.0f} tokens/s | {self.read}{of} read, "
                f"{100 * share:5.1f}% of the input | ETA {self.eta()}")

    def show(self, final: bool = False) -> None:
        """Write the line; `final`: all of the input is read (blank lines included)."""
        if final:
            self.done_bytes = self.total
        if self.tty:
            self.stream.write("\r" + self.line() + ("\n" if final else ""))
        else:
            self.stream.write(self.line() + "\n")
        self.stream.flush()


def _count(n: int, thing: str) -> str:
    return f"{n} {thing}{'' if n == 1 else 's'}"


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


@dataclass(frozen=True)
class Summary:
    """What `preprocess` wrote."""

    prefix: str  # the dataset's prefix: give it to --data-path
    documents: int
    tokens: int
    eod_only: int  # empty documents kept as the end-of-document token alone (--append-eod)
    skipped: int  # empty documents left out (no --append-eod)
    blank_lines: int  # blank input lines, skipped
    percentiles: dict[int, int]  # document length (tokens) at each of PERCENTILES
    histogram: str  # the length histogram file
    seconds: float

    def text(self) -> str:
        p = ", ".join(f"p{k} {v}" for k, v in self.percentiles.items())
        notes = [text for count, text in (
            (self.eod_only, f"{self.eod_only} of them empty: the end-of-document token alone"),
            (self.skipped, f"{_count(self.skipped, 'empty document')} left out"),
            (self.blank_lines, f"{_count(self.blank_lines, 'blank line')} skipped")) if count]
        notes_text = f" ({'; '.join(notes)})" if notes else ""
        return (f"{self.documents} documents, {self.tokens} tokens in {self.seconds:.1f} s"
                f"{notes_text}\n"
                f"document length (tokens): {p}\n"
                f"wrote {self.prefix}.bin and .idx: train with --data-path {self.prefix}\n"
                f"wrote {self.histogram}: plan with megatron-mesh plan ... --doc-length-dist "
                f"histogram:{self.histogram}")


def dataset_prefix(output_prefix: str, key: str) -> str:
    """PREFIX_KEY_document, the dataset's files' common start; InputError when
    --output-prefix names no file or --json-key would make the name a folder's."""
    name = os.path.basename(output_prefix)
    if name in ("", ".", ".."):
        example = os.path.join(output_prefix or ".", "corpus")
        raise InputError(f"--output-prefix {output_prefix!r} names a folder, not the start of "
                         f"a file name: give e.g. {example} (writes {example}_{key}_document"
                         ".bin)")
    if not key or any(c in key for c in {"/", os.sep, os.altsep or "/", "\0"}):
        raise InputError(f"--json-key {key!r}: the key also names the output "
                         f"({name}_KEY_document.bin), so it must be non-empty and hold no "
                         "'/'; give the JSON key of the text")
    return f"{output_prefix}_{key}_document"


class Stopped(BaseException):
    """SIGINT or SIGTERM stopped the run (its files removed); the command exits 128 +
    the signal's number."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _StopOnSignals:
    """While entered (in the main thread): SIGINT and SIGTERM raise Stopped, except inside
    `held()`, whose steps (renaming, removing) a signal must not cut in two."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __enter__(self) -> _StopOnSignals:
        self.holding, self.previous = False, {}
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)

    def _handle(self, signum: int, frame) -> None:
        if not self.holding:
            raise Stopped(signum)

    @contextmanager
    def held(self) -> Iterator[None]:
        self.holding = True
        try:
            yield
        finally:
            self.holding = False


@contextmanager
def _folder_lock(folder: str) -> Iterator[None]:
    """An exclusive lock on the folder itself (flock; none where there is no fcntl): runs
    publishing into the same folder take turns."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class DatasetFiles:
    """The dataset's files (PREFIX.bin, PREFIX.idx, PREFIX_lengths.json), written under
    private names in their folder (`staged`) and renamed onto their paths together at the
    end (`publish`): until then the paths hold what they held before, and a run that fails
    or is stopped leaves nothing (`discard`); of two runs to the same prefix at once, the
    one that publishes last leaves its whole output."""

    SUFFIXES = (".bin", ".idx", "_lengths.json")

    def __init__(self, prefix: str, flag: str):
        self.prefix, self.flag = prefix, flag  # flag: --output-prefix, for messages
        self.final = {s: prefix + s for s in self.SUFFIXES}
        self.folder = os.path.dirname(os.path.abspath(prefix))
        self.staged: dict[str, str] = {}
        self.made: list[str] = []  # folders this run made, outermost first

    def open(self) -> None:
        """Make the folder and the private files; InputError when it cannot write there."""
        for path in self.final.values():
            if os.path.isdir(path):
                raise InputError(f"--output-prefix {self.flag}: {path} is a folder; the "
                                 "dataset's file needs its name (remove it or give another "
                                 "--output-prefix)")
        self._make_folder()
        name = os.path.basename(self.prefix)
        while not self.staged:
            stem = os.path.join(self.folder, f".{name}.{os.getpid()}-{secrets.token_hex(4)}")
            try:  # this run's own name: created here, so no other run writes it
                os.close(os.open(stem + ".bin.partial", os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                                 0o666))
            except FileExistsError:
                continue
            except OSError as e:
                raise InputError(f"--output-prefix {self.flag}: cannot write in "
                                 f"{self.folder} ({e.strerror or e})") from None
            self.staged = {s: f"{stem}{s}.partial" for s in self.SUFFIXES}

    def _make_folder(self) -> None:
        missing, folder = [], self.folder
        while not os.path.exists(folder):
            missing.append(folder)
            folder = os.path.dirname(folder)
        if not os.path.isdir(folder):
            raise InputError(f"--output-prefix {self.flag}: {folder} is a file, not a folder")
        for path in reversed(missing):
            try:
                os.mkdir(path)
            except FileExistsError:
                continue  # made meanwhile by another run
            except OSError as e:
                raise InputError(f"--output-prefix {self.flag}: cannot make the folder "
                                 f"{path} ({e.strerror or e})") from None
            self.made.append(path)

    def publish(self) -> None:
        """Rename the private files onto the dataset's paths, under the folder's lock."""
        with _folder_lock(self.folder):
            for suffix in self.SUFFIXES:
                os.replace(self.staged[suffix], self.final[suffix])
        self.staged = {}

    def discard(self) -> None:
        """Remove the private files and the folders this run made (when empty)."""
        for path in self.staged.values():
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
        self.staged = {}
        for folder in reversed(self.made):
            try:
                os.rmdir(folder)
            except OSError:
                break  # another run's files are in it


def preprocess(args: argparse.Namespace) -> Summary:
    """Tokenize --input into the dataset (module docstring); InputError on bad input and
    Stopped on SIGINT / SIGTERM, either leaving the output paths as they were."""
    files = input_files(args.input)
    outputs = DatasetFiles(dataset_prefix(args.output_prefix, args.json_key),
                           args.output_prefix)
    with _StopOnSignals() as signals:
        try:
            outputs.open()  # before the tokenizer's load: a bad output fails at once
            tokenizer = check_tokenizer(args)
            found, blank_lines = check_documents(args.input, args.json_key)
            counts = _write(args, tokenizer, files, outputs, found)
            with signals.held():
                outputs.publish()
        except BaseException:
            with signals.held():
                outputs.discard()
            raise
    return replace(counts, blank_lines=blank_lines)


def _write(args: argparse.Namespace, tokenizer, files: list[str], outputs: DatasetFiles,
           found: int | None = None) -> Summary:
    """Tokenize the documents (`found` in the input) into `outputs`' private files; the
    Summary of what they hold."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    eod = int(tokenizer.eod) if args.append_eod else None
    vocab = int(tokenizer.vocab_size)
    progress = Progress(sum(os.path.getsize(f) for f in files), total_documents=found)
    lengths, skipped, eod_only = array("q"), 0, 0
    ids_of = _Ids(tokenizer, args.tokenizer_type == "NullTokenizer")
    try:
        builder = IndexedDatasetBuilder(outputs.staged[".bin"],
                                        dtype=DType.optimal_dtype(vocab))
        with closing(_tokenized(args, ids_of, documents(args.input, args.json_key))) as done:
            for doc, ids in done:
                if isinstance(ids, str):
                    raise InputError(ids)
                bad = next((i for i in ids if not 0 <= i < vocab), None)
                if bad is not None:
                    raise InputError(f"{doc.where}: token id {bad} outside the tokenizer's "
                                     f"vocabulary 0 .. {vocab - 1}")
                if not ids:
                    eod_only += eod is not None
                    skipped += eod is None
                if eod is not None:
                    ids.append(eod)
                if not ids:
                    progress.add(0, doc.nbytes, written=False)
                    continue
                builder.add_document(np.asarray(ids, dtype=np.int64), [len(ids)])
                lengths.append(len(ids))
                progress.add(len(ids), doc.nbytes)
        if not lengths:
            raise InputError(f"--input {args.input}: every document is empty")
        builder.finalize(outputs.staged[".idx"])
        tokens = int(sum(lengths))
        LengthHistogram.of(lengths).write(outputs.staged["_lengths.json"], tokens)
    except OSError as e:
        if e.filename not in (None, *outputs.staged.values()):
            raise
        raise InputError(f"--output-prefix {args.output_prefix}: cannot write in "
                         f"{outputs.folder} ({e.strerror or e})") from None
    progress.show(final=True)
    ordered = np.sort(np.frombuffer(lengths, dtype=np.int64))
    percentiles = {p: int(np.percentile(ordered, p, method="nearest")) for p in PERCENTILES}
    return Summary(outputs.prefix, len(lengths), tokens, eod_only, skipped, 0, percentiles,
                   outputs.final["_lengths.json"], time.monotonic() - progress.start)


def _tokenized(args: argparse.Namespace, ids_of: _Ids, docs: Iterator[Document]
               ) -> Iterator[tuple[Document, list[int] | str]]:
    """(document, its ids or an error's text) in input order: in this process with
    `ids_of`, or in --workers processes."""
    if args.workers <= 1:
        for doc in docs:
            yield doc, ids_of([(doc.text, doc.where)])[0]
        return
    context = multiprocessing.get_context("spawn")  # no fork of a process holding threads
    with context.Pool(args.workers, initializer=_start_worker, initargs=(args,)) as pool:
        pending: deque = deque()  # (chunk, its result): at most 4 chunks a worker in flight
        for chunk in _chunks(docs):
            pending.append((chunk, pool.apply_async(_tokenize, ([(d.text, d.where)
                                                                  for d in chunk],))))
            if len(pending) >= 4 * args.workers:
                done, result = pending.popleft()
                yield from zip(done, result.get())
        while pending:
            done, result = pending.popleft()
            yield from zip(done, result.get())


def _chunks(docs: Iterator[Document]) -> Iterator[list[Document]]:
    chunk: list[Document] = []
    for doc in docs:
        chunk.append(doc)
        if len(chunk) == CHUNK:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
