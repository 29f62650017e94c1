"""The training loss: a token-weighted share of the global batch's mean.

Each micro-batch's loss is the *sum* of its token cross-entropies divided by
the number of target tokens in the whole global batch (all replicas, all
micro-batches). Summing these over micro-batches and replicas gives exactly
the mean over the global batch, whatever the replicas' shares, so gradients
are plain sums: no average of unequal averages. Targets equal to
``IGNORE_INDEX`` (padding) count for nothing.

Works on plain logits and on vocabulary-sharded DTensor logits (inside
``loss_parallel``). The scale may be left to the first loss of a step
(:meth:`TokenLoss.defer_scale`): under the data-parallel priority schedule the global
token count is still being summed when the schedule starts, and only the ranks that hold
the head wait for it, before their first loss. :meth:`TokenLoss.compile` compiles the
cross-entropy sum (the ``compile`` execution trait, :mod:`potluck.runtime.parallel.compile`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def logits_of(output: Any) -> torch.Tensor:
    """Logits from what a model returns: a tensor, a tuple, or an object with ``.logits``."""
    if hasattr(output, "logits"):
        return output.logits
    if isinstance(output, tuple | list):
        return output[0]
    return output


class TokenLoss:
    """``loss_fn(output, targets)`` for the pipeline schedules; ``scale`` is 1 / global tokens."""

    def __init__(self) -> None:
        self.scale = 1.0
        self._scale_of: Callable[[], float] | None = None
        self._token_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = token_sum

    @property
    def compiled(self) -> bool:
        return self._token_sum is not token_sum

    def compile(self) -> None:
        """Compile the cross-entropy sum (plain logits only: not under ``loss_parallel``)."""
        self._token_sum = torch.compile(token_sum, dynamic=False)

    def defer_scale(self, scale_of: Callable[[], float]) -> None:
        """Set :attr:`scale` to ``scale_of()`` when the next loss is computed, not before."""
        self._scale_of = scale_of

    def __call__(self, output: Any, targets: torch.Tensor) -> torch.Tensor:
        if self._scale_of is not None:
            self.scale, self._scale_of = self._scale_of(), None
        return self._token_sum(logits_of(output), targets) * self.scale


def token_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The sum of the target tokens' cross-entropies, in FP32 (padding counts nothing)."""
    flat = logits.flatten(0, 1).float()
    return F.cross_entropy(flat, targets.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)


