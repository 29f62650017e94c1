"""What a run reads: a corpus, or random token batches for dry runs and tests.

:func:`batch_source` gives a run its data: the corpus at ``--data`` (through
``potluck.data``), else :class:`RandomTokens`, which serves the same interface
as ``potluck.data``'s datasets: ``replica_rows(step, start, count)`` is rows
``[start, start + count)`` of global batch ``step``, drawn from a generator
seeded by ``(seed, step)``, so every replica and every layout sees the same
global batch.
"""

from __future__ import annotations

import torch

from potluck.errors import ConfigError
from potluck.plans import Plan
from potluck.runtime.loop.trainer import BatchSource
from potluck.runtime.options import TrainOptions


def batch_source(plan: Plan, options: TrainOptions) -> BatchSource:
    """The run's data: the corpus at ``options.data`` or random tokens."""
    shape = plan.training
    if options.data is None:
        return RandomTokens(plan.model.vocab_size, shape.seq_len, shape.global_batch, options.seed)
    try:
        from potluck.data.dataset import build_dataset
        from potluck.data.tokenizer import load_tokenizer
    except ImportError as err:
        raise ConfigError(f"--data needs potluck.data, which is missing ({err})") from None
    tokenizer = load_tokenizer(options.tokenizer)
    return build_dataset(options.data, tokenizer, shape.seq_len, shape.global_batch, options.seed)


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
