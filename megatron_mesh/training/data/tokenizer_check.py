"""Start-up checks of the tokenizer flags: the files they name exist, and the model's
vocabulary (the tokenizer's, padded as the model pads it) holds every token id of the data.

Both run before any process group: a mistyped --tokenizer-model path would otherwise reach
Hugging Face's hub client ("couldn't connect to huggingface.co"), and a tokenizer smaller
than the data's ids would stop every rank at the first batch inside the embedding.
"""
from __future__ import annotations

import argparse
import os
import re

from megatron_mesh.training.config.input_checks import TokenIds, null_tokenizer_ids

_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")  # "gpt2", "org/model"
_TRUE = ("1", "ON", "YES", "TRUE")
_HF_WHAT = "a local tokenizer folder or a Hugging Face model name"


def _fail(msg: str) -> None:
    raise ValueError(msg)


def hub_offline() -> bool:
    """HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE set: names resolve from the local cache only."""
    return any(os.environ.get(k, "").upper() in _TRUE
               for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _hub_cache() -> str:
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
    return os.path.join(home, "hub")


def looks_like_path(value: str) -> bool:
    """A value that means a local file or folder: absolute, ./ ~ .., more than one '/', not a
    hub name's characters, or a first part that is a folder here ("data/tok")."""
    first = value.split("/")[0]
    return (os.path.isabs(value) or value.startswith((".", "~")) or value.count("/") > 1
            or not _HUB_NAME.match(value) or ("/" in value and os.path.isdir(first)))


def check_tokenizer_files(args: argparse.Namespace) -> None:
    """--tokenizer-model (and GPT2BPE's --vocab-file / --merge-file) name existing files: a
    SentencePiece / TikToken model always, a Hugging Face value when it looks like a path or
    when the hub is offline (then a cached name also does)."""
    kind = args.tokenizer_type
    if kind == "GPT2BPETokenizer":
        for flag, value in (("--vocab-file", args.vocab_file), ("--merge-file", args.merge_file)):
            if value and not os.path.isfile(value):
                _fail(f"{flag} {value}: no such file")
        return
    value = args.tokenizer_model
    if kind == "NullTokenizer" or not value or os.path.exists(os.path.expanduser(value)):
        return
    if kind != "HuggingFaceTokenizer":
        _fail(f"--tokenizer-model {value}: no such file: {value} (the {kind}'s model file)")
    if looks_like_path(value):
        _fail(f"--tokenizer-model {value}: no such file or folder: {value} ({_HF_WHAT})")
    cached = os.path.isdir(os.path.join(_hub_cache(), "models--" + value.replace("/", "--")))
    if hub_offline() and not cached:
        _fail(f"--tokenizer-model {value}: no such file or folder: {value} ({_HF_WHAT}; the hub "
              f"is offline (HF_HUB_OFFLINE) and {_hub_cache()} holds no such model)")


def model_token_ids(args: argparse.Namespace) -> TokenIds:
    """The ids the run's data may hold: NullTokenizer 0 .. V (V: its end-of-document id);
    another tokenizer, its vocabulary padded as the model pads it (`padded_vocab_size`): the
    embedding's rows. Builds the tokenizer; a load error becomes one line."""
    if args.tokenizer_type == "NullTokenizer":
        return null_tokenizer_ids(args.vocab_size)
    from megatron_mesh.training.data.datasets import build_tokenizer
    from megatron_mesh.training.model.gpt import padded_vocab_size

    source = (f"--vocab-file {args.vocab_file}" if args.tokenizer_type == "GPT2BPETokenizer"
              else f"--tokenizer-model {args.tokenizer_model}")
    try:
        tokenizer = build_tokenizer(args)
        size = int(tokenizer.vocab_size)
    except Exception as e:  # noqa: BLE001 - any library's load error, as one line
        reason = " ".join(str(e).split()) or type(e).__name__
        _fail(f"{source}: the {args.tokenizer_type} cannot be loaded ({reason[:300]})")
    padded = padded_vocab_size(size, args)
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    return TokenIds(padded, f"the model's vocabulary, ids 0 .. {padded - 1} (--tokenizer-type "
                            f"{args.tokenizer_type} {source}: {size} tokens, padded to a "
                            f"multiple of {multiple}, --make-vocab-size-divisible-by x TP)")
