"""The byte tokenizer, local Hugging Face tokenizers, and the vocabulary check."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from potluck.data import ByteTokenizer, check_tokenizer_fits, load_tokenizer
from potluck.errors import ConfigError
from potluck.model.spec import PRESETS


def test_byte_tokenizer_round_trips_utf8_and_has_four_specials_after_the_bytes():
    tokenizer = load_tokenizer(None)
    assert isinstance(tokenizer, ByteTokenizer)
    text = "Grüße, potluck! ½ 🍲"
    ids = tokenizer.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tokenizer.decode(ids + [tokenizer.eos_id]) == text
    assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id, tokenizer.unk_id) == (
        256, 257, 258, 259)
    assert tokenizer.vocab_size == 260


def test_byte_tokenizer_fits_the_tiny_presets_and_larger_vocabularies():
    tokenizer = ByteTokenizer()
    for name in ("tiny-llama", "tiny-gpt2", "llama2-7b"):
        check_tokenizer_fits(tokenizer, PRESETS[name])


def test_a_vocabulary_too_small_for_the_tokenizer_is_one_clear_line():
    small = replace(PRESETS["tiny-llama"], vocab_size=256)
    with pytest.raises(ConfigError) as err:
        check_tokenizer_fits(ByteTokenizer(), small)
    message = str(err.value)
    assert "260" in message and "256" in message and "\n" not in message


def test_local_hf_tokenizer_loads_without_network_and_encodes(word_tokenizer_dir: Path):
    tokenizer = load_tokenizer(word_tokenizer_dir)
    assert tokenizer.vocab_size == 18  # 16 words and marks, <unk>, </s>
    ids = tokenizer.encode("the cat ran")
    assert len(ids) == 3 and max(ids) < tokenizer.vocab_size
    assert tokenizer.decode(ids) == "the cat ran"
    assert tokenizer.eos_id == tokenizer.hf.convert_tokens_to_ids("</s>")
    check_tokenizer_fits(tokenizer, PRESETS["tiny-llama"])
    with pytest.raises(ConfigError, match="embeds only 8"):
        check_tokenizer_fits(tokenizer, replace(PRESETS["tiny-llama"], vocab_size=8))


def test_missing_tokenizer_directory_is_a_config_error(tmp_path: Path):
    with pytest.raises(ConfigError, match="not found"):
        load_tokenizer(tmp_path / "nope")


def test_directory_without_tokenizer_files_is_a_config_error(tmp_path: Path):
    with pytest.raises(ConfigError, match="no tokenizer files"):
        load_tokenizer(tmp_path)


def test_broken_tokenizer_file_is_one_line(tmp_path: Path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not a usable Hugging Face tokenizer") as err:
        load_tokenizer(tmp_path)
    assert "\n" not in str(err.value)


def test_a_tokenizer_directory_never_runs_its_own_code(tmp_path: Path, word_tokenizer_dir: Path):
    """A tokenizer directory from someone else may name Python code of its own (``auto_map``);
    potluck refuses it in one line instead of importing it."""
    import json
    import shutil

    directory = tmp_path / "evil_tokenizer"
    shutil.copytree(word_tokenizer_dir, directory)
    marker = tmp_path / "owned"
    (directory / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n"
                                       "from transformers import PreTrainedTokenizerFast\n"
                                       "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": [None, "evil.EvilTokenizer"]}
    config["tokenizer_class"] = "EvilTokenizer"
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="not a usable Hugging Face tokenizer") as err:
        load_tokenizer(directory)
    assert "\n" not in str(err.value)
    assert not marker.exists()
