"""Tokenize text into a Megatron indexed dataset that the driver trains on.

    python -m megatron_mesh.preprocess --input corpus.jsonl --json-key text \\
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model tokenizer/gpt2 \\
        --output-prefix data/corpus --append-eod --workers 2

--input is a JSON lines file (one document a line, its text under --json-key) or a folder
(every file under it one document). Writes PREFIX_KEY_document.bin / .idx (give
PREFIX_KEY_document to --data-path) and PREFIX_KEY_document_lengths.json (the length
histogram `megatron-mesh plan --doc-length-dist histogram:FILE` reads), all three only
whole (private names, renamed at the end; the folder made when missing); shows progress on
stderr (documents counted as the summary counts them) and a summary on stdout. Bad input
or an output it cannot write exits 2 with one line before tokenizing; SIGINT / SIGTERM
exit 128 + the signal, leaving nothing. The work is in
megatron_mesh/training/data/preprocess_data.py; docs/training.md, "Real data", walks
through it.
"""
from __future__ import annotations

import argparse
import sys
import warnings
from typing import NoReturn, Sequence

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed")

PROG = "python -m megatron_mesh.preprocess"
TOKENIZER_TYPES = ("NullTokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer",
                   "SentencePieceTokenizer", "TikTokenizer")  # the driver's --tokenizer-type


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        _fail(f"{message} (see --help)")


def _fail(message: str) -> NoReturn:
    sys.stderr.write(f"preprocess: error: {message}\n")
    sys.stderr.flush()
    raise SystemExit(2)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--input", required=True, metavar="FILE.jsonl|DIR",
                   help="JSON lines (one document a line) or a folder (each file a document)")
    p.add_argument("--json-key", default="text",
                   help="the key of each JSON line's text; also names the output "
                   "(PREFIX_KEY_document) (default: text)")
    p.add_argument("--output-prefix", required=True, metavar="PREFIX")
    p.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES,
                   help="as the driver's: NullTokenizer takes space-separated ids")
    p.add_argument("--tokenizer-model", help="tokenizer file, or HF folder / name")
    p.add_argument("--vocab-file", help="GPT2BPETokenizer's vocab.json")
    p.add_argument("--merge-file", help="GPT2BPETokenizer's merges.txt")
    p.add_argument("--vocab-size", type=_positive,
                   help="NullTokenizer: ids 0 .. N - 1, end of document N")
    p.add_argument("--append-eod", action="store_true",
                   help="append the tokenizer's end-of-document id to every document (what "
                   "the driver's --eod-mask-loss and --reset-attention-mask look for)")
    p.add_argument("--workers", type=_positive, default=1,
                   help="tokenizer processes (default: 1, this process)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from megatron_mesh.training.data.preprocess_data import InputError, Stopped, preprocess
    except ModuleNotFoundError as e:
        _fail(f"preprocess needs the 'megatron' extra (no module named {e.name!r}): "
              "pip install 'megatron-mesh[megatron]'")
    try:
        summary = preprocess(args)
    except InputError as e:
        _fail(str(e))
    except Stopped as e:
        lead = "\n" if sys.stderr.isatty() else ""  # after the progress line's \r
        sys.stderr.write(f"{lead}preprocess: stopped by {e}: nothing written (the dataset's "
                         "files appear only complete; what the output paths held stays)\n")
        sys.stderr.flush()
        raise SystemExit(128 + e.signum) from None
    print(summary.text(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
