"""Checks of the driver's inputs that need no process group: numbers, folders, data files.

Each raises ValueError with one line naming the flag, the bad value and what is valid; the
driver turns it into exit status 2 on every rank before any group is built. Also the flags
of stopping early (signal, clock, NaN), which belong to the same promise: nothing lost.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import signal
import tempfile
from dataclasses import dataclass

import numpy as np

from megatron_mesh.training.data.index_file import read_index

EXIT_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT")
_SCAN_CHUNK_BYTES = 64 << 20  # the whole .bin is scanned for token ids, this much at a time


def add_fault_tolerance_args(parser: argparse.ArgumentParser) -> None:
    """--check-for-nan-in-loss-and-grad, --exit-signal-handler, --exit-signal,
    --exit-duration-in-mins (Megatron-LM's names and defaults)."""
    g = parser.add_argument_group("stopping safely")
    g.add_argument("--check-for-nan-in-loss-and-grad", action=argparse.BooleanOptionalAction,
                   default=True, help="stop at the first NaN / Inf loss or grad norm, unsaved")
    g.add_argument("--exit-signal-handler", action=argparse.BooleanOptionalAction, default=False,
                   help="on --exit-signal: finish the iteration, save, exit 0")
    g.add_argument("--exit-signal", default="SIGTERM", choices=EXIT_SIGNALS)
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="save and exit 0 once the job has run this long")


def _fail(msg: str) -> None:
    raise ValueError(msg)


def _finite(args: argparse.Namespace, name: str, low: float, high: float = math.inf, *,
            low_open: bool = False, high_open: bool = False, optional: bool = False) -> None:
    value = getattr(args, name)
    if value is None and optional:
        return
    flag = "--" + name.replace("_", "-")
    ok = isinstance(value, (int, float)) and math.isfinite(value) and (
        value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        _fail(f"{flag} {value}: must be a finite number in {interval}")


def check_numbers(args: argparse.Namespace) -> None:
    """Positive sizes and finite hyper-parameters in their ranges."""
    for name in ("kv_channels", "global_batch_size", "exit_interval", "num_query_groups",
                 "ffn_hidden_size", "vocab_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            _fail(f"--{name.replace('_', '-')} {value}: must be a positive integer")
    _finite(args, "lr", 0.0)
    _finite(args, "min_lr", 0.0)
    _finite(args, "adam_beta1", 0.0, 1.0, high_open=True)
    _finite(args, "adam_beta2", 0.0, 1.0, high_open=True)
    _finite(args, "adam_eps", 0.0, low_open=True)
    _finite(args, "weight_decay", 0.0)
    _finite(args, "clip_grad", 0.0)
    _finite(args, "sgd_momentum", 0.0)
    _finite(args, "exit_duration_in_mins", 0.0, low_open=True, optional=True)
    _finite(args, "lr_warmup_fraction", 0.0, 1.0, optional=True)
    if args.lr_warmup_iters < 0:
        _fail(f"--lr-warmup-iters {args.lr_warmup_iters}: must be 0 or more")
    if not hasattr(signal, args.exit_signal):
        _fail(f"--exit-signal {args.exit_signal}: not a signal here")


def check_split(args: argparse.Namespace) -> None:
    """--split: up to three non-negative weights (train, valid, test), train above 0."""
    parts = re.split(r"[,/]", str(args.split))
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        weights = []
    if not 1 <= len(weights) <= 3 or not all(math.isfinite(w) and w >= 0 for w in weights) or (
            weights[0] <= 0):
        _fail(f"--split {args.split}: expected up to three non-negative numbers "
              "TRAIN,VALID,TEST with TRAIN > 0 (e.g. 969,30,1)")


def check_memory(args: argparse.Namespace, world_size: int) -> None:
    """--seq-length no memory can hold: the logits of one micro-batch alone must fit."""
    tp = args.tensor_model_parallel_size
    cp = args.context_parallel_size
    vocab = args.vocab_size or 50257
    tokens = args.seq_length // cp * args.micro_batch_size
    need = tokens * (vocab // tp + args.hidden_size * args.num_layers) * 4
    have = _memory_bytes()
    if need > have:
        _fail(f"--seq-length {args.seq_length}: one micro-batch needs at least {need / 2**30:.1f} "
              f"GiB per rank (logits and layer inputs, CP {cp}, TP {tp}), more than the "
              f"{have / 2**30:.1f} GiB here; shorten it or raise --context-parallel-size")


def _memory_bytes() -> int:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_folders(args: argparse.Namespace) -> None:
    """--save must be (or become) a writable folder; --load must exist unless it is --save."""
    if args.save:
        base = os.path.abspath(args.save)
        while not os.path.exists(base):
            base = os.path.dirname(base)
        if not os.path.isdir(base):
            _fail(f"--save {args.save}: {base} is a file, not a folder")
        try:
            with tempfile.TemporaryFile(dir=base):
                pass
        except OSError as e:
            _fail(f"--save {args.save}: cannot write in {base} ({e.strerror})")
    if args.load and not os.path.isdir(args.load):
        if os.path.abspath(args.load) != os.path.abspath(args.save or ""):
            _fail(f"--load {args.load}: no such folder (it may be missing only when it is the "
                  "--save folder of a first launch)")


@dataclass(frozen=True)
class TokenIds:
    """The token ids a run can take: 0 .. count - 1, and what gives them (for the message)."""

    count: int
    what: str


def null_tokenizer_ids(vocab_size: int) -> TokenIds:
    """A NullTokenizer of --vocab-size V: ids 0 .. V - 1 and the end-of-document id V."""
    return TokenIds(vocab_size + 1, f"the NullTokenizer's ids for --vocab-size {vocab_size} "
                                    f"(0 .. {vocab_size - 1} and the end-of-document id "
                                    f"{vocab_size})")


def check_data_files(prefixes: list[str], ids: TokenIds | None) -> None:
    """PREFIX.idx / .bin: a sound Megatron index (`index_file.read_index`), a .bin of the size
    it says, and token ids in `ids` through the whole .bin (one pass at memory speed, see
    docs/reliability.md; None: not checked)."""
    for prefix in prefixes:
        idx, bin_ = prefix + ".idx", prefix + ".bin"
        size = os.path.getsize(bin_)
        try:
            index = read_index(idx, size)
        except (OSError, ValueError) as e:
            _fail(f"--data-path {prefix}: {idx} is not a Megatron index ({e}); rebuild it with "
                  "megatron-core's IndexedDatasetBuilder / tools/preprocess_data.py")
        dtype, tokens = index.dtype, index.tokens
        if size != tokens * dtype.itemsize or tokens == 0:
            _fail(f"--data-path {prefix}: {bin_} has {size} bytes but {idx} lists {tokens} "
                  f"tokens of {dtype.itemsize} bytes; the pair does not belong together")
        if ids is not None:
            low, high = _token_id_range(bin_, dtype, tokens, ids.count)
            bad = high if high >= ids.count else low
            if high >= ids.count or low < 0:
                _fail(f"--data-path {prefix}: token id {bad} in {bin_} is outside {ids.what}")


SPLIT_NAMES = ("training", "validation", "test")


def split_weights(split: str) -> list[float]:
    """--split TRAIN,VALID,TEST as three normalized weights (missing ones 0)."""
    weights = [float(p) for p in re.split(r"[,/]", str(split))]
    weights = (weights + [0.0, 0.0])[:3]
    return [w / sum(weights) for w in weights]


def check_split_documents(prefixes: list[str], split: str, used: list[bool]) -> None:
    """Every split the run reads (`used`: training, validation, test) and --split gives a
    share gets at least one document of every prefix, as megatron-core cuts a dataset's documents
    (book-ends rounded to whole documents); an empty one would never fill its samples."""
    weights = split_weights(split)
    ends = [sum(weights[:i]) for i in range(4)]
    for prefix in prefixes:
        documents = _document_count(prefix + ".idx")
        for i, name in enumerate(SPLIT_NAMES):
            if not used[i] or weights[i] == 0:  # a share of 0: that set is not built
                continue
            first, last = round(ends[i] * documents), round(ends[i + 1] * documents)
            if last <= first:
                _fail(f"--split {split}: the {name} set gets no document of {prefix} "
                      f"({documents} documents); give it a larger share (e.g. --split 90,5,5)"
                      + ("" if i == 0 else ", or --eval-iters 0 for no evaluation"))


def _document_count(path: str) -> int:
    """Documents in a Megatron .idx file (its header's document-index length less one)."""
    with open(path, "rb") as f:
        head = f.read(34)
    return int.from_bytes(head[26:34], "little") - 1


def _token_id_range(bin_: str, dtype: np.dtype, tokens: int, vocab_size: int) -> tuple[int, int]:
    """(min, max) token id of a whole .bin, read in chunks through a memmap; skipped (0, 0)
    when the dtype cannot hold an id outside [0, vocab_size)."""
    if dtype.kind == "u" and np.iinfo(dtype).max < vocab_size:
        return 0, 0
    ids = np.memmap(bin_, dtype=dtype, mode="r", shape=(tokens,))
    step = max(1, _SCAN_CHUNK_BYTES // dtype.itemsize)
    low, high = 0, 0
    for start in range(0, tokens, step):
        chunk = ids[start:start + step]
        low, high = min(low, int(chunk.min())), max(high, int(chunk.max()))
    return low, high


def validate_inputs(args: argparse.Namespace, world_size: int) -> None:
    """Every check of this module, in the order a user would fix them."""
    check_numbers(args)
    check_split(args)
    check_folders(args)
    check_memory(args, world_size)
