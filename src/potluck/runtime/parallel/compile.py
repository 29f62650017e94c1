"""``torch.compile`` of each block and of the loss: the ``compile`` execution trait.

As torchtitan does (``apply_compile``), each transformer block is compiled on its own, after
tensor parallelism and recomputation are applied and before ZeRO-3's ``fully_shard``, so that
the identical blocks share one graph and FSDP2 shards the compiled modules. The block is
compiled in place with :meth:`torch.nn.Module.compile` (``dynamic=False``: a step's
micro-batches have one shape), which keeps parameter names, state-dict keys and the module's
class, so checkpoints, gradient buckets and FSDP2 see the same model. Full recomputation wraps
the compiled block in torch's non-reentrant checkpoint, as eager. The loss's cross-entropy is
compiled too (:meth:`~potluck.runtime.loop.loss.TokenLoss.compile`).

Where compiling pays: the trait's ``auto`` (the default) compiles on GPU ranks, where inductor
fuses the norms, rotary embeddings, activations and residual adds, and one graph replaces a
block's launches; CPU ranks stay eager (inductor takes tens of seconds to compile a tiny model
there), unless the trait is ``true``. Eager, with the reason logged once per rank, where
compiling does not compose with what the rank runs, or is not verified to:

- traced stages (a model without a block adapter): one FX graph per stage, no blocks;
- tensor parallelism (DTensor blocks, vocabulary-parallel loss under ``loss_parallel``) and
  the explicit TP executor (it runs a block's attention and MLP as separate parts, with
  collectives between them): not verified on CPU ranks;
- mixture-of-experts blocks: data-dependent routing, a new graph per expert load;
- the priority schedule with ZeRO-1/2 and optimizer offload: forward pre-hooks on every
  module wait for in-flight all-gathers and host copies, which would break each block's graph;
- single blocks, the rest of the stage compiled: those with selective recomputation (the
  checkpoint inside the block breaks the graph) and those whose saved tensors swap (swap's
  hooks tell a saved weight from an activation by eager autograd's saved tensors).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from potluck.cluster.execution import Execution
from potluck.plans import Plan, explicit_tp
from potluck.plans.memory import Offload
from potluck.runtime.layout import Layout
from potluck.runtime.parallel.pipeline import StageModule

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Compiled:
    """What one rank compiled: block names per stage module, and whether the loss."""

    blocks: tuple[tuple[str, ...], ...] = ()
    loss: bool = False
    eager_reason: str | None = None  # why the rank's blocks run eagerly, if they all do


def compiles(execution: Execution, use_gpu: bool) -> bool:
    """Whether a rank compiles: the trait's value, or with ``auto`` on GPU ranks only."""
    return use_gpu if execution.compile is None else execution.compile


def apply_compile(stages: Sequence[nn.Module], layout: Layout, use_gpu: bool) -> Compiled:
    """Compile the blocks of ``stages`` in place where the plan's execution asks for it and
    it composes with what this rank runs (see the module docstring); log what stays eager."""
    plan = layout.plan
    if not compiles(plan.training.execution, use_gpu):
        return Compiled()
    loss = layout.role.holds_head and layout.role.tp == 1
    reason = rank_eager_reason(plan, layout, stages)
    if reason is not None:
        log.info("torch.compile: this rank's blocks run eagerly: %s", reason)
        return Compiled(loss=loss, eager_reason=reason)
    compiled, kept = [], []
    for stage in stages:
        names = []
        for name, block in stage.blocks.items():
            why = block_eager_reason(stage, name)
            if why is None:
                block.compile(dynamic=False)
                names.append(name)
            else:
                kept.append(f"block {name} ({why})")
        compiled.append(tuple(names))
    if kept:
        log.info("torch.compile: eager %s", ", ".join(kept))
    return Compiled(tuple(compiled), loss)


def rank_eager_reason(plan: Plan, layout: Layout, stages: Sequence[nn.Module]) -> str | None:
    """Why none of this rank's blocks may be compiled, or None."""
    role = layout.role
    if not all(isinstance(stage, StageModule) for stage in stages):
        return "traced stages (a model without a block adapter)"
    if role.tp > 1 or explicit_tp(plan, role.pipeline, role.stage):
        return "tensor parallelism (not verified under compile)"
    if plan.model.num_experts > 0:
        return "mixture-of-experts blocks (data-dependent routing)"
    if plan.comm.dp_priority_schedule and plan.shards_optimizer:
        return "the priority schedule's all-gathers are waited for inside each block"
    if plan.stage_memory(role.pipeline, role.stage).offload is not Offload.NONE:
        return "optimizer offload waits for host copies inside each block"
    return None


def block_eager_reason(stage: StageModule, name: str) -> str | None:
    """Why one block of a compiled stage runs eagerly, or None."""
    attention = getattr(stage.blocks[name], stage.family.attention, None)
    if attention is not None and "forward" in vars(attention):
        return "selective recomputation"
    if name in stage.swapped:
        return "swapped activations"
    return None
