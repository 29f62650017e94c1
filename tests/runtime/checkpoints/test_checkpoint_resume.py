"""Resuming from a checkpoint gives exactly the loss curve of an uninterrupted run.

A tiny GPT-2 with dropout (so the RNG matters) trains on the built-in corpus
through the byte tokenizer, with the data position, optimizer state and RNG
all restored from the checkpoint into a model built from another seed.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from potluck.data import ByteTokenizer, TokenDataset, build_dataset, builtin_corpus_path
from potluck.model.hf import hf_config_for
from potluck.model.spec import PRESETS
from potluck.runtime.checkpoints.rng import load_rng_state
from potluck.runtime.checkpoints.storage import (
    apply_training_state,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    training_state,
)

SPEC = PRESETS["tiny-gpt2"]
STEPS = 6


def _setup(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, TokenDataset]:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config_for(SPEC)).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    dataset = build_dataset(builtin_corpus_path(), ByteTokenizer(), seq_len=32, global_batch=4,
                            seed=11)
    return model, optimizer, dataset


def _train(model, optimizer, dataset: TokenDataset, first: int, end: int) -> list[float]:
    losses = []
    for step in range(first, end):
        rows = dataset.global_batch(step)
        logits = model(input_ids=rows[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_resume_gives_the_uninterrupted_loss_curve(tmp_path: Path):
    uninterrupted = _train(*_setup(seed=0), 0, STEPS)

    model, optimizer, dataset = _setup(seed=0)
    before = _train(model, optimizer, dataset, 0, STEPS // 2)
    trainer_state = {"step": STEPS // 2, "data": dataset.state_dict(STEPS // 2)}
    save_checkpoint(tmp_path, STEPS // 2, training_state([model], [optimizer]), trainer_state)

    model, optimizer, dataset = _setup(seed=123)
    path = latest_checkpoint(tmp_path)
    state = training_state([model], [optimizer])
    restored = load_checkpoint(path, state)
    apply_training_state([model], [optimizer], state)
    dataset.load_state_dict(restored["data"])
    assert load_rng_state(path)
    after = _train(model, optimizer, dataset, restored["step"], STEPS)

    assert before + after == uninterrupted
    assert uninterrupted[-1] < uninterrupted[0]


def test_without_the_rng_the_dropout_masks_differ(tmp_path: Path):
    """The test above can fail: skip restoring the RNG and the curve changes."""
    uninterrupted = _train(*_setup(seed=0), 0, 2)
    model, optimizer, dataset = _setup(seed=0)
    _train(model, optimizer, dataset, 0, 1)
    save_checkpoint(tmp_path, 1, training_state([model], [optimizer]), {"step": 1})
    model, optimizer, dataset = _setup(seed=123)
    state = training_state([model], [optimizer])
    load_checkpoint(latest_checkpoint(tmp_path), state)
    apply_training_state([model], [optimizer], state)
    assert _train(model, optimizer, dataset, 1, 2) != uninterrupted[1:]
