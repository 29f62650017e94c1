"""Tokenizers: a built-in byte-level one, or a Hugging Face one from a local directory.

The byte tokenizer needs no files: ids 0-255 are the bytes of the UTF-8 text,
then four specials (``<pad>`` 256, ``<bos>`` 257, ``<eos>`` 258, ``<unk>``
259: :mod:`potluck.model.byte_vocab`). Any model whose vocabulary holds those
260 ids trains with it, which is why the tiny presets have a 260-entry
vocabulary. A Hugging Face tokenizer is
only ever read from a local directory (``local_files_only``): potluck never
downloads anything at run time. Both are used through the small
:class:`Tokenizer` protocol, so the dataset does not care which one it has.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol

from potluck.errors import ConfigError
from potluck.model import byte_vocab
from potluck.model.spec import ModelSpec

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                   "vocab.txt")


class Tokenizer(Protocol):
    """What the dataset needs from a tokenizer."""

    name: str
    vocab_size: int  # every id the tokenizer can produce is below this
    eos_id: int | None  # separates documents; None: documents are simply concatenated

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def save(self, directory: str | Path) -> None:
        """Write Hugging Face tokenizer files that ``AutoTokenizer.from_pretrained`` reads
        back as this tokenizer (same ids for the same text)."""


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255, then ``<pad>``, ``<bos>``, ``<eos>``, ``<unk>``."""

    name = "bytes"
    SPECIALS = byte_vocab.SPECIALS
    pad_id = byte_vocab.PAD_ID
    bos_id = byte_vocab.BOS_ID
    eos_id = byte_vocab.EOS_ID
    unk_id = byte_vocab.UNK_ID
    vocab_size = byte_vocab.VOCAB_SIZE

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """Bytes back to text; special ids are dropped, broken UTF-8 is replaced."""
        return bytes(i for i in ids if 0 <= i < byte_vocab.BYTES).decode("utf-8", errors="replace")

    def save(self, directory: str | Path) -> None:
        """The byte vocabulary as a Hugging Face fast tokenizer: a byte-level BPE without
        merges whose ids are the byte values, then the four specials."""
        from tokenizers import Tokenizer as Fast
        from tokenizers import decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        vocab = {char: byte for byte, char in bytes_to_unicode().items()}
        fast = Fast(models.BPE(vocab=vocab, merges=[]))
        fast.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        fast.decoder = decoders.ByteLevel()
        fast.add_special_tokens(list(self.SPECIALS))
        pad, bos, eos, unk = self.SPECIALS
        PreTrainedTokenizerFast(tokenizer_object=fast, pad_token=pad, bos_token=bos,
                                eos_token=eos, unk_token=unk).save_pretrained(str(directory))


class HFTokenizer:
    """A Hugging Face tokenizer seen through the :class:`Tokenizer` protocol."""

    def __init__(self, hf_tokenizer: Any, name: str) -> None:
        self.hf = hf_tokenizer
        self.name = name
        self.vocab_size = len(hf_tokenizer)  # includes added special tokens
        eos = hf_tokenizer.eos_token_id
        self.eos_id = eos if eos is not None else hf_tokenizer.sep_token_id
        if self.eos_id is None:
            log.warning("tokenizer %s has no end-of-text token; documents are joined without one",
                        name)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)

    def save(self, directory: str | Path) -> None:
        self.hf.save_pretrained(str(directory))


def load_tokenizer(path: str | Path | None) -> Tokenizer:
    """The byte tokenizer for ``None``, else the Hugging Face tokenizer in directory ``path``."""
    if path is None:
        return ByteTokenizer()
    directory = Path(path)
    if not directory.is_dir():
        raise ConfigError(
            f"tokenizer directory {str(directory)!r} not found; give a local Hugging Face "
            "tokenizer directory, or leave --tokenizer out to use the built-in byte tokenizer"
        )
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(
            f"{directory}: holds no tokenizer files (expected one of {', '.join(TOKENIZER_FILES)})"
        )
    from transformers import AutoTokenizer

    try:
        hf_tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True,
                                                     trust_remote_code=False)
    except Exception as err:  # whatever the cause, a bad directory is told in one line
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"{directory}: not a usable Hugging Face tokenizer directory ({reason})"
        ) from None
    return HFTokenizer(hf_tokenizer, directory.name)


def check_tokenizer_fits(tokenizer: Tokenizer, model: ModelSpec) -> None:
    """Raise a one-line ConfigError if the tokenizer can produce ids the model cannot embed."""
    if tokenizer.vocab_size > model.vocab_size:
        raise ConfigError(
            f"tokenizer {tokenizer.name!r} has {tokenizer.vocab_size} tokens but model "
            f"{model.name!r} embeds only {model.vocab_size}; use the tokenizer made for this "
            "model, or a model whose vocab_size is at least the tokenizer's"
        )
