"""Plans whose stages recompute or swap, and the per-rank memory of their runs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from runtime_helpers import LR, STEPS

from potluck.plans import Plan
from potluck.plans.memory import StageMemory
from potluck.runtime.launch.local import run_local
from potluck.runtime.options import TrainOptions
from potluck.runtime.training import train_rank


def with_memory(plan: Plan, memory: Mapping[tuple[int, int], StageMemory]) -> Plan:
    """``plan`` with stage ``(pipeline, stage)``'s memory set as ``memory`` says."""
    pipelines = tuple(
        replace(pipeline, stages=tuple(replace(stage, memory=memory.get((k, j), stage.memory))
                                       for j, stage in enumerate(pipeline.stages)))
        for k, pipeline in enumerate(plan.pipelines))
    return replace(plan, pipelines=pipelines)


def _rank_history(plan: Plan, options: TrainOptions) -> list[tuple[float, tuple]]:
    return [(m.loss, m.memory) for m in train_rank(plan, options)]


def run_with_memory(plan: Plan, steps: int = STEPS, timeout_s: float = 60.0,
                    **options: Any) -> tuple[list[float], list[tuple[dict[str, Any], ...]]]:
    """Rank 0's losses and each step's per-rank memory rows of ``plan`` on CPU ranks."""
    train_options = TrainOptions(steps=steps, lr=LR, seed=0, progress=False,
                                 timeout_s=timeout_s, count_memory=True, **options)
    results = run_local(_rank_history, plan.devices, (plan, train_options),
                        timeout_s=timeout_s * 2)
    history = results[0]
    return [loss for loss, _ in history], [memory for _, memory in history]
