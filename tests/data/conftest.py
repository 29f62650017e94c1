"""Fixtures for the data tests: a tiny Hugging Face tokenizer built on the spot."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def word_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local word-level HF tokenizer directory (16 words and marks, <unk> and </s>)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["<unk>", "</s>"])
    backend.train_from_iterator(
        ["the cat sat on the mat", "a dog ran to the old red barn", "it was late ."], trainer
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", unk_token="<unk>")
    directory = tmp_path_factory.mktemp("word_tokenizer")
    fast.save_pretrained(str(directory))
    return directory
