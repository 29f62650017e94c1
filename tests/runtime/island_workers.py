"""Rank workers for the islands tests: train a plan with plain SGD and report each step's
metrics and this rank's weights after every step."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from runtime_helpers import LR

from potluck.plans import Island, Islands, Plan, SyncMethod
from potluck.runtime import Trainer, build_model, parallelize, start
from potluck.runtime.grads.buckets import local
from potluck.runtime.launch.local import run_local
from potluck.runtime.loop.batches import RandomTokens
from potluck.runtime.loop.trainer import StepMetrics


@dataclass(frozen=True)
class IslandReport:
    pipeline: int
    metrics: list[StepMetrics]
    weights: list[dict[str, torch.Tensor]]  # this rank's local weights: initial, then per step
    units: dict[str, str]  # each local parameter's unit
    drained: dict[str, torch.Tensor]  # the weights once every push in flight has landed
    before: list[dict[str, torch.Tensor]]  # per step: the weights before its exchanges


def split(plan: Plan, *members: tuple[int, ...], **kwargs) -> Plan:
    """``plan`` with its pipelines in islands ``members`` (default diloco)."""
    kwargs.setdefault("sync", SyncMethod.DILOCO)
    islands = Islands(islands=tuple(Island(pipelines=m) for m in members), **kwargs)
    return replace(plan, islands=islands)


def _train(plan: Plan, steps: int, lr: float) -> IslandReport:
    session = start(plan, timeout_s=60)
    try:
        model = parallelize(build_model(plan.model), session)
        optimizer = torch.optim.SGD(list(model.parameters()), lr=lr)
        trainer = Trainer(model, optimizer, lr=lr, max_grad_norm=None)
        shape = plan.training
        data = RandomTokens(plan.model.vocab_size, shape.seq_len, shape.global_batch)
        metrics, weights, before = [], [_weights(model)], []
        exchange = trainer.islands.after_step

        def recorded(step: int):
            before.append(_weights(model))
            return exchange(step)

        trainer.islands.after_step = recorded
        for step in range(steps):
            metrics.append(trainer.step(data.replica_rows(step, *session.layout.batch_rows)))
            weights.append(_weights(model))
        trainer.islands.drain()
        return IslandReport(session.layout.role.pipeline, metrics, weights, model.units,
                            _weights(model), before)
    finally:
        session.close()


def as_tensors(weights: dict) -> dict[str, torch.Tensor]:
    return {name: torch.from_numpy(value) for name, value in weights.items()}


def _weights(model) -> dict[str, torch.Tensor]:
    """Copies that cross the process boundary by value (a tensor's storage would be shared
    with a process that is gone), once the priority schedule's all-gathers have landed."""
    model.flush()
    return {n: local(p).detach().numpy().copy() for n, p in model.named_parameters()}


def train_islands(plan: Plan, steps: int, lr: float = LR) -> list[IslandReport]:
    """Every rank's report of ``plan`` trained with SGD (no clipping) on CPU ranks."""
    return run_local(_train, plan.devices, (plan, steps, lr), timeout_s=120)
