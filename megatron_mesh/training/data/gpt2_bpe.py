"""--tokenizer-type GPT2BPETokenizer from local --vocab-file / --merge-file, with no network.

megatron-core's own GPT2BPETokenizer asks the Hugging Face hub for "gpt2" even when both
files are given. This one builds GPT-2's byte-level BPE from the two files with the
`tokenizers` library (GPT-2's pre-tokenizing pattern, no prefix space) and hands it to
megatron-core's GPT tokenizer classes, so the driver, `generate` and the dataset tool use it
as any other megatron-core tokenizer: the end of document is `<|endoftext|>`, which the
vocabulary must hold, and the vocabulary size is the vocab file's.
"""
from __future__ import annotations

import json

from megatron.core.tokenizers.text.libraries.huggingface_tokenizer import HuggingFaceTokenizer
from megatron.core.tokenizers.text.models import GPTTokenizer

END_OF_DOCUMENT = "<|endoftext|>"


def _gpt2_bpe(vocab_file: str, merges_file: str):
    """A transformers fast tokenizer over the files' byte-level BPE; ValueError naming the
    file when they cannot make one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    try:
        with open(vocab_file, encoding="utf-8") as f:
            vocab = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--vocab-file {vocab_file}: not a GPT-2 vocab.json ({e})") from None
    if not isinstance(vocab, dict) or END_OF_DOCUMENT not in vocab:
        raise ValueError(f"--vocab-file {vocab_file}: holds no {END_OF_DOCUMENT!r} token (the "
                         "end of document of GPT2BPETokenizer); give GPT-2's vocab.json")
    try:
        bpe = models.BPE.from_file(vocab_file, merges_file)
    except Exception as e:  # noqa: BLE001 - the library's parse error, as one line
        raise ValueError(f"--merge-file {merges_file}: not GPT-2 merges for --vocab-file "
                         f"{vocab_file} ({' '.join(str(e).split())})") from None
    core = Tokenizer(bpe)
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token=END_OF_DOCUMENT,
                                   eos_token=END_OF_DOCUMENT, unk_token=END_OF_DOCUMENT)


class _FilesLibrary(HuggingFaceTokenizer):
    """megatron-core's Hugging Face wrapper around `_gpt2_bpe` (its constructor would load
    by name through AutoTokenizer)."""

    def __init__(self, vocab_file: str, merges_file: str) -> None:
        self.tokenizer = _gpt2_bpe(vocab_file, merges_file)
        self.include_special_tokens = False
        self.original_vocab_size = len(self.tokenizer)
        self.chat_template = None
        self.eos_token = END_OF_DOCUMENT
        self._inv_vocab_dict = {}
        self.add_special_tokens({})  # copies bos / eos / unk ... onto this wrapper
        self.space_sensitive = self.text_to_tokens("x y") != self.text_to_tokens("x") + \
            self.text_to_tokens("y")


class Gpt2BpeFiles(GPTTokenizer):
    """megatron-core's GPT tokenizer over `_FilesLibrary`."""

    def _restore_model(self, **kwargs) -> _FilesLibrary:
        return _FilesLibrary(kwargs["vocab_file"], kwargs["merges_file"])


def gpt2_bpe_tokenizer(vocab_file: str, merges_file: str) -> GPTTokenizer:
    """The GPT-2 BPE tokenizer of these two local files (no hub access)."""
    return Gpt2BpeFiles(path=vocab_file, config={"library": "megatron"},
                        vocab_file=vocab_file, merges_file=merges_file)
