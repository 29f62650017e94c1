"""Random token batches, for dry runs and tests without a corpus.

:class:`RandomTokens` serves the same interface as ``potluck.data``'s
datasets: ``replica_rows(step, start, count)`` is rows ``[start, start +
count)`` of global batch ``step``, drawn from a generator seeded by
``(seed, step)``, so every replica and every layout sees the same global batch.
"""

from __future__ import annotations

import torch


class RandomTokens:
    """Uniform random token ids ``[global_batch, seq_len + 1]`` per step."""

    def __init__(self, vocab_size: int, seq_len: int, global_batch: int, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.global_batch_size = global_batch
        self.seed = seed

    def global_batch(self, step: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        shape = (self.global_batch_size, self.seq_len + 1)
        return torch.randint(0, self.vocab_size, shape, generator=generator)

    def replica_rows(self, step: int, start: int, count: int) -> torch.Tensor:
        return self.global_batch(step)[start:start + count]
