"""Token sequences and the global batches cut from them, in a fixed order per seed.

Documents are tokenized once and concatenated, each followed by the
tokenizer's end-of-text id. The token stream is cut into sequences of
``seq_len + 1`` tokens that overlap by one token (inputs are the first
``seq_len``, targets the last ``seq_len``), and the sequences are shuffled
anew each epoch by numpy's PCG64 generator seeded with ``[seed, epoch]`` (every
bit of both counts; torch's CPU generator would keep only 32 bits of a seed).

Samples are numbered globally: sample ``i`` is position ``i % n`` of epoch
``i // n``'s order. Step ``s`` trains on ``global_batch`` consecutive samples,
and data-parallel replica ``r`` takes rows ``[start_r, start_r + share_r)`` of
them, where the starts add up the plan's batch shares (:func:`replica_starts`).
Every rank computes the same rows without talking to the others. The whole
position is two integers (the next step and its first sample), which a
checkpoint saves with :meth:`TokenDataset.state_dict`; resuming from it gives
exactly the batches an uninterrupted run would have seen, even if the global
batch changes on resume.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from potluck.data.corpus import iter_documents, no_text_error, read_documents
from potluck.data.tokenizer import Tokenizer
from potluck.errors import ConfigError

log = logging.getLogger(__name__)


def tokenize_documents(documents: Sequence[str], tokenizer: Tokenizer) -> torch.Tensor:
    """One long 1-D LongTensor: every document's ids, each followed by the eos id."""
    eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
    ids: list[int] = []
    for document in documents:
        ids.extend(tokenizer.encode(document))
        ids.extend(eos)
    return torch.tensor(ids, dtype=torch.long)


class TokenDataset:
    """Shuffled sequences of ``seq_len + 1`` tokens, served as global batches by step."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, global_batch: int, seed: int = 0):
        if seq_len < 1 or global_batch < 1:
            raise ConfigError("sequence length and global batch must be at least 1")
        if tokens.numel() < seq_len + 1:
            raise too_short_error(tokens.numel(), seq_len)
        self.seq_len = seq_len
        self.global_batch_size = global_batch
        self.seed = seed
        self.sequences = tokens.to(torch.long).unfold(0, seq_len + 1, seq_len)
        self._start_step = 0
        self._start_sample = 0
        self._orders: dict[int, torch.Tensor] = {}

    @property
    def num_sequences(self) -> int:
        return self.sequences.shape[0]

    def order(self, epoch: int) -> torch.Tensor:
        """The permutation of sequence indices used in ``epoch``."""
        if epoch not in self._orders:
            if len(self._orders) >= 2:
                self._orders.pop(min(self._orders))
            permutation = np.random.default_rng([self.seed, epoch]).permutation(self.num_sequences)
            self._orders[epoch] = torch.from_numpy(permutation)
        return self._orders[epoch]

    def samples(self, first: int, count: int) -> torch.Tensor:
        """Samples ``first .. first + count - 1`` as a LongTensor ``[count, seq_len + 1]``."""
        parts = []
        index, end = first, first + count
        while index < end:
            epoch, position = divmod(index, self.num_sequences)
            take = min(self.num_sequences - position, end - index)
            parts.append(self.sequences[self.order(epoch)[position:position + take]])
            index += take
        if not parts:
            return self.sequences[:0].clone()
        return torch.cat(parts)

    def first_sample(self, step: int) -> int:
        """The global index of the first sample of ``step``."""
        if step < self._start_step:
            raise ValueError(f"step {step} comes before the resumed position {self._start_step}")
        return self._start_sample + (step - self._start_step) * self.global_batch_size

    def global_batch(self, step: int) -> torch.Tensor:
        """All rows of ``step``: LongTensor ``[global_batch, seq_len + 1]``."""
        return self.samples(self.first_sample(step), self.global_batch_size)

    def replica_rows(self, step: int, start: int, count: int) -> torch.Tensor:
        """Rows ``[start, start + count)`` of ``step``'s global batch: one replica's share."""
        if start < 0 or count < 0 or start + count > self.global_batch_size:
            raise ValueError(
                f"rows [{start}, {start + count}) are outside the global batch of "
                f"{self.global_batch_size}"
            )
        return self.samples(self.first_sample(step) + start, count)

    def state_dict(self, next_step: int) -> dict[str, Any]:
        """The data position for a run that continues at ``next_step`` (JSON-safe)."""
        return {
            "next_step": next_step,
            "next_sample": self.first_sample(next_step),
            "seed": self.seed,
            "seq_len": self.seq_len,
            "num_sequences": self.num_sequences,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position; the data, seed and seq_len must be the same."""
        saved = (state["seed"], state["seq_len"], state["num_sequences"])
        mine = (self.seed, self.seq_len, self.num_sequences)
        if saved != mine:
            raise ConfigError(
                f"the checkpoint's data position does not apply: it was made with seed, seq_len, "
                f"sequences = {saved}, this run has {mine}; resume with the same data and settings"
            )
        self._start_step = int(state["next_step"])
        self._start_sample = int(state["next_sample"])


def too_short_error(num_tokens: int, seq_len: int) -> ConfigError:
    return ConfigError(f"the data has {num_tokens} tokens, fewer than one sequence of "
                       f"{seq_len + 1}; give more text or a shorter sequence length")


def check_one_sequence(data_path: str | Path, tokenizer: Tokenizer, seq_len: int) -> None:
    """The error :func:`build_dataset` would raise for data too short for one sequence of
    ``seq_len + 1`` tokens (or with no text at all), from only as much text as that takes:
    documents are read one file at a time and tokenized until there are enough tokens."""
    needed = seq_len + 1
    found = 0
    for document in iter_documents(data_path):
        found += _token_count(document, tokenizer, needed - found)
        found += 0 if tokenizer.eos_id is None else 1
        if found >= needed:
            return
    if found == 0:
        raise no_text_error(data_path)
    raise too_short_error(found, seq_len)


def _token_count(text: str, tokenizer: Tokenizer, needed: int) -> int:
    """The tokens of ``text``, or of a prefix of it when that already holds ``needed``
    (one spare for a token the cut may split)."""
    prefix = text[:8 * (needed + 1)]
    count = len(tokenizer.encode(prefix))
    if len(prefix) == len(text) or count > needed:
        return count
    return len(tokenizer.encode(text))


def replica_starts(batch_shares: Sequence[int]) -> list[int]:
    """The first row of each replica in the global batch: running sums of the shares."""
    starts, total = [], 0
    for share in batch_shares:
        starts.append(total)
        total += share
    return starts


def build_dataset(data_path: str | Path, tokenizer: Tokenizer, seq_len: int,
                  global_batch: int, seed: int = 0) -> TokenDataset:
    """Read, tokenize and cut the text at ``data_path``."""
    documents = read_documents(data_path)
    tokens = tokenize_documents(documents, tokenizer)
    dataset = TokenDataset(tokens, seq_len, global_batch, seed)
    log.info("data %s: %d documents, %d tokens, %d sequences of %d", data_path,
             len(documents), tokens.numel(), dataset.num_sequences, seq_len + 1)
    return dataset
