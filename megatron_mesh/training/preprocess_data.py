"""Text to a Megatron indexed dataset the driver trains on (`python -m megatron_mesh.preprocess`).

Documents come from JSON lines (the value of one key per line) or from a folder (each file
one document, its whole text, files in sorted path order). Each is tokenized with the
tokenizer the driver builds for the same flags (`data.build_tokenizer`), in --workers
processes (documents keep their input order), an end-of-document id appended with
--append-eod, and written by megatron-core's `IndexedDatasetBuilder` as PREFIX_KEY_document
.bin / .idx (Megatron-LM's names), in the smallest dtype that holds the vocabulary. A
progress line on stderr shows documents, tokens, tokens/s and the ETA from input bytes
read; the summary gives the length percentiles and writes the length histogram
(`planner/length_histogram.py`) the planner's `--doc-length-dist histogram:FILE` reads.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from array import array
from collections import deque
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from megatron_mesh.planner.length_histogram import LengthHistogram
from megatron_mesh.training import tokenizer_check

CHUNK = 64  # documents a worker tokenizes per task
PERCENTILES = (0, 10, 50, 90, 99, 100)


class InputError(ValueError):
    """Input that cannot be read as documents; the command exits 2 with its message."""


@dataclass(frozen=True)
class Document:
    """One document's text and the input bytes it came from (for the ETA)."""

    text: str
    where: str  # "FILE line N" or the file's path
    nbytes: int


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


def documents(path: str, key: str) -> Iterator[Document]:
    """The documents of --input `path` in order (a folder: one a file; a file: one a JSON
    line, its `key`); InputError naming the file and line of what cannot be read."""
    if os.path.isdir(path):
        for name in input_files(path):
            with open(name, "rb") as f:
                raw = f.read()
            yield Document(_text(raw, name), name, len(raw))
        return
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
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
            yield Document(record[key], where, len(raw))


def _text(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{where}: not UTF-8 text (byte {e.start})") from None


_worker_tokenizer = None


def _start_worker(args: argparse.Namespace) -> None:
    global _worker_tokenizer
    _worker_tokenizer = load_tokenizer(args)


def _tokenize(chunk: list[tuple[str, str]]) -> list[list[int] | str]:
    """Each (text, where) as ids, or the error's text."""
    out: list[list[int] | str] = []
    for text, where in chunk:
        try:
            out.append([int(i) for i in _worker_tokenizer.tokenize(text)])
        except Exception as e:  # noqa: BLE001 - a tokenizer's error, as one line
            reason = " ".join(str(e).split()) or type(e).__name__
            out.append(f"{where}: the tokenizer rejects it ({reason[:200]})")
    return out


def load_tokenizer(args: argparse.Namespace):
    """The driver's tokenizer for these flags (`data.build_tokenizer`)."""
    from megatron_mesh.training.data import build_tokenizer

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
    """One line on stderr: documents, tokens, tokens/s and the ETA from the input bytes;
    rewritten in place on a terminal, a new line every `every` seconds elsewhere."""

    def __init__(self, total_bytes: int, stream=None, every: float | None = None):
        self.total, self.stream = max(total_bytes, 1), stream or sys.stderr
        self.tty = self.stream.isatty()
        self.every = every if every is not None else (0.2 if self.tty else 10.0)
        self.start = self.last = time.monotonic()
        self.documents = self.tokens = self.done_bytes = 0

    def add(self, tokens: int, nbytes: int) -> None:
        self.documents += 1
        self.tokens += tokens
        self.done_bytes += nbytes
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            self.show()

    def line(self) -> str:
        seconds = max(time.monotonic() - self.start, 1e-9)
        share = min(self.done_bytes / self.total, 1.0)
        eta = seconds * (1 - share) / share if share > 0 else float("inf")
        eta_text = "--:--" if eta == float("inf") else _clock(eta)
        return (f"{self.documents} documents | {self.tokens} tokens | "
                f"{self.tokens / seconds:,.0f} tokens/s | {100 * share:5.1f}% of the input | "
                f"ETA {eta_text}")

    def show(self, final: bool = False) -> None:
        if self.tty:
            self.stream.write("\r" + self.line() + ("\n" if final else ""))
        else:
            self.stream.write(self.line() + "\n")
        self.stream.flush()


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


@dataclass(frozen=True)
class Summary:
    """What `preprocess` wrote."""

    prefix: str  # the dataset's prefix: give it to --data-path
    documents: int
    tokens: int
    skipped: int  # empty documents left out
    percentiles: dict[int, int]  # document length (tokens) at each of PERCENTILES
    histogram: str  # the length histogram file
    seconds: float

    def text(self) -> str:
        p = ", ".join(f"p{k} {v}" for k, v in self.percentiles.items())
        skipped = f" ({self.skipped} empty documents left out)" if self.skipped else ""
        return (f"{self.documents} documents, {self.tokens} tokens in {self.seconds:.1f} s"
                f"{skipped}\n"
                f"document length (tokens): {p}\n"
                f"wrote {self.prefix}.bin and .idx: train with --data-path {self.prefix}\n"
                f"wrote {self.histogram}: plan with megatron-mesh plan ... --doc-length-dist "
                f"histogram:{self.histogram}")


def preprocess(args: argparse.Namespace) -> Summary:
    """Tokenize --input into the dataset (module docstring); InputError on bad input (no
    output left behind)."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    files = input_files(args.input)
    tokenizer = check_tokenizer(args)
    folder = os.path.dirname(os.path.abspath(args.output_prefix))
    if not os.path.isdir(folder):
        raise InputError(f"--output-prefix {args.output_prefix}: folder {folder} does not exist")
    prefix = f"{args.output_prefix}_{args.json_key}_document"
    eod = int(tokenizer.eod) if args.append_eod else None
    vocab = int(tokenizer.vocab_size)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=DType.optimal_dtype(vocab))
    progress = Progress(sum(os.path.getsize(f) for f in files))
    lengths, skipped = array("q"), 0
    try:
        for doc, ids in _tokenized(args, documents(args.input, args.json_key)):
            if isinstance(ids, str):
                raise InputError(ids)
            bad = next((i for i in ids if not 0 <= i < vocab), None)
            if bad is not None:
                raise InputError(f"{doc.where}: token id {bad} outside the tokenizer's "
                                 f"vocabulary 0 .. {vocab - 1}")
            if eod is not None:
                ids.append(eod)
            if not ids:
                skipped += 1
                progress.add(0, doc.nbytes)
                continue
            builder.add_document(np.asarray(ids, dtype=np.int64), [len(ids)])
            lengths.append(len(ids))
            progress.add(len(ids), doc.nbytes)
        if not lengths:
            raise InputError(f"--input {args.input}: every document is empty")
        builder.finalize(prefix + ".idx")
    except BaseException:
        for suffix in (".bin", ".idx"):
            if os.path.exists(prefix + suffix):
                os.remove(prefix + suffix)
        raise
    progress.show(final=True)
    histogram = prefix + "_lengths.json"
    tokens = int(sum(lengths))
    LengthHistogram.of(lengths).write(histogram, tokens)
    ordered = np.sort(np.frombuffer(lengths, dtype=np.int64))
    percentiles = {p: int(np.percentile(ordered, p, method="nearest")) for p in PERCENTILES}
    return Summary(prefix, len(lengths), tokens, skipped, percentiles, histogram,
                   time.monotonic() - progress.start)


def _tokenized(args: argparse.Namespace, docs: Iterator[Document]
               ) -> Iterator[tuple[Document, list[int] | str]]:
    """(document, its ids or an error's text) in input order; --workers processes."""
    if args.workers <= 1:
        _start_worker(args)
        for doc in docs:
            yield doc, _tokenize([(doc.text, doc.where)])[0]
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
