"""Activation recomputation, applied to a model's pipeline stages.

``full`` keeps only each block's input and runs the block's forward again in
the backward pass; ``selective`` does that for the attention submodule only
(the part whose activations grow with ``s^2``; Korthikanti et al. 2022). Both
use torch's non-reentrant checkpointing and leave parameter names unchanged
(the block or attention module's ``forward`` is wrapped on the instance, no
wrapper module is inserted).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from potluck.model.counts import Recompute
from potluck.runtime.parallel.pipeline import StageModule

log = logging.getLogger(__name__)


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def apply_recompute(stages: Sequence[nn.Module], recompute: Recompute) -> None:
    """Recompute activations of every block of ``stages`` as the plan says."""
    if recompute is Recompute.NONE:
        return
    for stage in stages:
        if not isinstance(stage, StageModule):
            log.warning("recomputation is not applied to traced stages; running without it")
            return
        if recompute is Recompute.FULL:
            stage.recompute = Recompute.FULL
            continue
        for block in stage.blocks.values():
            attention = getattr(block, stage.family.attention)
            attention.forward = _checkpointed(attention.forward)
