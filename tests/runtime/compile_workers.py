"""Rank workers for the compile tests: train a plan and report its losses and what each rank
compiled (block names whose module has a compiled call, the loss, FSDP2 over the blocks)."""

from __future__ import annotations

from dataclasses import dataclass

from runtime_helpers import LR

from potluck.plans import Plan
from potluck.runtime import Trainer, build_model, parallelize, start
from potluck.runtime.launch.local import run_local
from potluck.runtime.loop.batches import RandomTokens


@dataclass(frozen=True)
class CompileReport:
    losses: list[float]
    grad_norms: list[float]
    compiled_blocks: list[str]  # blocks whose calls run torch.compile's code
    eager_blocks: list[str]
    loss_compiled: bool
    sharded_blocks: int  # blocks FSDP2 shards (ZeRO-3)
    graphs: int  # distinct graphs dynamo compiled
    graph_breaks: int


def _train(plan: Plan, steps: int) -> CompileReport:
    from torch._dynamo.utils import counters
    from torch.distributed.fsdp import FSDPModule

    session = start(plan, timeout_s=60)
    try:
        model = parallelize(build_model(plan.model), session)
        trainer = Trainer(model, None, lr=LR)
        shape = plan.training
        data = RandomTokens(plan.model.vocab_size, shape.seq_len, shape.global_batch)
        losses, norms = [], []
        for step in range(steps):
            metrics = trainer.step(data.replica_rows(step, *session.layout.batch_rows))
            losses.append(metrics.loss)
            norms.append(metrics.grad_norm)
        blocks = {name: block for stage in model.stages for name, block in stage.blocks.items()}
        compiled = [n for n, b in blocks.items() if b._compiled_call_impl is not None]
        return CompileReport(losses, norms, compiled,
                             [n for n in blocks if n not in compiled], model.loss_fn.compiled,
                             sum(isinstance(b, FSDPModule) for b in blocks.values()),
                             counters["stats"]["unique_graphs"],
                             sum(counters["graph_break"].values()))
    finally:
        session.close()


def train_compiled(plan: Plan, steps: int) -> list[CompileReport]:
    """Every rank's report of ``plan`` trained for ``steps`` on CPU ranks of this machine."""
    return run_local(_train, plan.devices, (plan, steps), timeout_s=300)
