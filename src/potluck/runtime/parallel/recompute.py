"""Activation recomputation and swapping, applied to one rank's pipeline stages.

Each stage's own :class:`~potluck.plans.memory.StageMemory` (``plan.stage_memory(k, j)``)
decides: its first ``recompute_blocks`` blocks (all, when unset), in layer order over the
rank's virtual chunks, use the stage's recompute mode and the rest none; its first
``swapped_blocks(n)`` blocks swap their saved tensors
(:mod:`potluck.runtime.memory.swap`). ``full`` keeps only each block's input and runs
the block's forward again in the backward pass; ``selective`` does that for the
attention submodule only (the part whose activations grow with ``s^2``; Korthikanti et
al. 2022). Both use torch's non-reentrant checkpointing and leave parameter names
unchanged (the block or attention module's ``forward`` is wrapped on the instance, no
wrapper module is inserted).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from potluck.model.counts import Recompute
from potluck.plans.memory import StageMemory
from potluck.runtime.memory.ledger import MemoryLedger
from potluck.runtime.memory.swap import ActivationSwap
from potluck.runtime.parallel.pipeline import StageModule, counted_recomputation

log = logging.getLogger(__name__)


def _checkpointed(forward: Callable[..., Any], ledger: MemoryLedger | None) -> Callable[..., Any]:
    counted = counted_recomputation(forward, ledger)

    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(counted, *args, use_reentrant=False, **kwargs)

    return run


def block_names(stages: Sequence[StageModule]) -> list[tuple[StageModule, str]]:
    """Every block of the rank's stage modules, in layer order (chunk after chunk)."""
    return [(stage, name) for stage in stages for name in stage.blocks]


def apply_memory(stages: Sequence[nn.Module], memory: StageMemory, plan_recompute: Recompute,
                 swap: ActivationSwap | None = None, ledger: MemoryLedger | None = None) -> None:
    """Recompute and swap the blocks of ``stages`` as the stage's ``memory`` says."""
    memory = memory.resolved(plan_recompute)
    if not all(isinstance(stage, StageModule) for stage in stages):
        if memory.recompute is not Recompute.NONE or memory.swaps:
            log.warning("recomputation and swapping are not applied to traced stages; "
                        "running without them")
        return
    blocks = block_names(stages)
    swapped = {(id(stage), name) for stage, name in blocks[:memory.swapped_blocks(len(blocks))]}
    for index, (stage, name) in enumerate(blocks):
        mode = memory.recompute_of_block(index, plan_recompute)
        if mode is Recompute.FULL:
            stage.full_recompute = stage.full_recompute | {name}
        elif mode is Recompute.SELECTIVE:
            attention = getattr(stage.blocks[name], stage.family.attention)
            attention.forward = _checkpointed(attention.forward, ledger)
    for stage in stages:
        stage.ledger = ledger
        stage.swapped = frozenset(name for name in stage.blocks if (id(stage), name) in swapped)
        stage.swap = swap if stage.swapped else None

