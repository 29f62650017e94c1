"""Shared pieces of the economics tests: a small model, a training shape, offers files."""

from __future__ import annotations

from pathlib import Path

import pytest

from potluck.api import training_shape
from potluck.model.loading import load_model
from potluck.model.spec import ModelSpec
from potluck.plans import TrainingShape

MODEL = "gpt3-350m"


@pytest.fixture
def model() -> ModelSpec:
    return load_model(MODEL)


@pytest.fixture
def shape(model: ModelSpec) -> TrainingShape:
    return training_shape(model, global_batch=32, seq_len=1024)


@pytest.fixture
def write(tmp_path: Path):
    """Write a text file under the test's temporary directory and return its path."""

    def _write(name: str, text: str) -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path

    return _write
