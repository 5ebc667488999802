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
from typing import Any

import numpy as np

EXIT_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT")
_INDEX_MAGIC = b"MMIDIDX\x00\x00"
_TOKEN_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
                 6: np.float64, 7: np.float32, 8: np.uint16}
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


def check_data_files(prefixes: list[str], vocab_size: int | None) -> None:
    """PREFIX.idx / .bin: a readable Megatron index, a .bin of the size it says, and, for a
    NullTokenizer of --vocab-size V (`vocab_size`), token ids in [0, V] through the whole .bin:
    0 .. V - 1 and V, the end-of-document id (one pass at memory speed, see
    docs/reliability.md)."""
    for prefix in prefixes:
        idx, bin_ = prefix + ".idx", prefix + ".bin"
        try:
            header = _read_index(idx)
        except (OSError, ValueError) as e:
            _fail(f"--data-path {prefix}: {idx} is not a Megatron index ({e}); rebuild it with "
                  "megatron-core's IndexedDatasetBuilder / tools/preprocess_data.py")
        dtype, tokens = header
        size = os.path.getsize(bin_)
        if size != tokens * np.dtype(dtype).itemsize or tokens == 0:
            _fail(f"--data-path {prefix}: {bin_} has {size} bytes but {idx} lists {tokens} "
                  f"tokens of {np.dtype(dtype).itemsize} bytes; the pair does not belong together")
        if vocab_size is not None:
            ids = vocab_size + 1  # the EOD id V follows the V ordinary ids
            low, high = _token_id_range(bin_, np.dtype(dtype), tokens, ids)
            bad = high if high >= ids else low
            if high >= ids or low < 0:
                _fail(f"--data-path {prefix}: token id {bad} in {bin_} is outside the "
                      f"NullTokenizer's ids for --vocab-size {vocab_size} (0 .. {vocab_size - 1} "
                      f"and the end-of-document id {vocab_size})")


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


def _read_index(path: str) -> tuple[Any, int]:
    """(token dtype, total tokens) of a Megatron .idx file."""
    with open(path, "rb") as f:
        head = f.read(34)
        if len(head) < 34 or head[:9] != _INDEX_MAGIC:
            raise ValueError("bad header" if head else "empty file")
        code = head[17]
        count = int.from_bytes(head[18:26], "little")
        if code not in _TOKEN_DTYPES:
            raise ValueError(f"unknown dtype code {code}")
        lengths = np.frombuffer(f.read(4 * count), dtype=np.int32)
        if len(lengths) != count or (lengths < 0).any():
            raise ValueError("truncated")
    return _TOKEN_DTYPES[code], int(lengths.sum(dtype=np.int64))


def validate_inputs(args: argparse.Namespace, world_size: int) -> None:
    """Every check of this module, in the order a user would fix them."""
    check_numbers(args)
    check_split(args)
    check_folders(args)
    check_memory(args, world_size)
