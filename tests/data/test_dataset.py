"""Sequences, deterministic shuffles, replica shares and resuming the data position."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from potluck.data import (
    ByteTokenizer,
    TokenDataset,
    build_dataset,
    builtin_corpus_path,
    load_tokenizer,
    replica_starts,
    tokenize_documents,
)
from potluck.errors import ConfigError


def _counting_dataset(num_tokens: int = 101, seq_len: int = 10, global_batch: int = 4,
                      seed: int = 0) -> TokenDataset:
    return TokenDataset(torch.arange(num_tokens), seq_len, global_batch, seed)


def test_documents_are_joined_with_eos():
    tokens = tokenize_documents(["ab", "c"], ByteTokenizer())
    assert tokens.tolist() == [97, 98, 258, 99, 258]


def test_hf_tokenizer_feeds_the_dataset(word_tokenizer_dir: Path):
    tokenizer = load_tokenizer(word_tokenizer_dir)
    tokens = tokenize_documents(["the cat sat", "a dog"], tokenizer)
    assert tokens.tolist()[-1] == tokenizer.eos_id and tokens.numel() == 7


def test_sequences_overlap_by_one_token_so_targets_follow_inputs():
    dataset = _counting_dataset()
    assert dataset.num_sequences == 10
    assert dataset.sequences[0].tolist() == list(range(11))
    assert dataset.sequences[1].tolist() == list(range(10, 21))


def test_every_sequence_appears_once_per_epoch_in_a_seeded_order():
    dataset = _counting_dataset(global_batch=5)
    epoch0 = torch.cat([dataset.global_batch(0), dataset.global_batch(1)])
    assert sorted(epoch0[:, 0].tolist()) == list(range(0, 100, 10))
    epoch1 = torch.cat([dataset.global_batch(2), dataset.global_batch(3)])
    assert not torch.equal(epoch0, epoch1)
    assert sorted(epoch1[:, 0].tolist()) == list(range(0, 100, 10))


def test_same_seed_same_batches_other_seed_other_batches():
    first, again, other = (_counting_dataset(seed=s) for s in (7, 7, 8))
    assert all(torch.equal(first.global_batch(s), again.global_batch(s)) for s in range(6))
    assert any(not torch.equal(first.global_batch(s), other.global_batch(s)) for s in range(6))


def test_batch_larger_than_the_data_wraps_across_epochs():
    dataset = _counting_dataset(global_batch=25)
    batch = dataset.global_batch(0)
    assert batch.shape == (25, 11)
    assert torch.equal(batch[:10], dataset.sequences[dataset.order(0)])
    assert torch.equal(batch[20:], dataset.sequences[dataset.order(2)[:5]])


def test_replica_shares_tile_the_global_batch_exactly():
    dataset = _counting_dataset(global_batch=7)
    shares = [3, 1, 3]  # uneven, as a heterogeneous plan may give
    for step in range(4):
        rows = [dataset.replica_rows(step, start, share)
                for start, share in zip(replica_starts(shares), shares, strict=True)]
        assert torch.equal(torch.cat(rows), dataset.global_batch(step))
    with pytest.raises(ValueError, match="outside the global batch"):
        dataset.replica_rows(0, 5, 3)


def test_replica_starts_are_running_sums():
    assert replica_starts([4, 2, 2]) == [0, 4, 6]


def test_resumed_dataset_continues_with_the_same_batches():
    reference = _counting_dataset(global_batch=3, seed=5)
    state = reference.state_dict(next_step=4)
    resumed = _counting_dataset(global_batch=3, seed=5)
    resumed.load_state_dict(state)
    for step in range(4, 12):
        assert torch.equal(resumed.global_batch(step), reference.global_batch(step))


def test_resume_with_a_new_global_batch_continues_where_the_data_stopped():
    reference = _counting_dataset(global_batch=4)
    resumed = _counting_dataset(global_batch=2)
    resumed.load_state_dict(reference.state_dict(next_step=3))
    assert torch.equal(torch.cat([resumed.global_batch(3), resumed.global_batch(4)]),
                       reference.global_batch(3))


def test_resume_with_other_data_or_seed_is_refused():
    state = _counting_dataset(seed=1).state_dict(next_step=2)
    with pytest.raises(ConfigError, match="data position does not apply"):
        _counting_dataset(seed=2).load_state_dict(state)
    with pytest.raises(ConfigError, match="data position does not apply"):
        _counting_dataset(num_tokens=300).load_state_dict(state)


def test_too_little_data_for_one_sequence_is_a_config_error():
    with pytest.raises(ConfigError, match="fewer than one sequence"):
        TokenDataset(torch.arange(5), seq_len=8, global_batch=1)


def test_builtin_corpus_builds_batches_the_tiny_models_can_embed():
    dataset = build_dataset(builtin_corpus_path(), ByteTokenizer(), seq_len=64, global_batch=8)
    batch = dataset.global_batch(0)
    assert batch.shape == (8, 65) and batch.dtype == torch.long
    assert int(batch.max()) < 260 and dataset.num_sequences > 1000
