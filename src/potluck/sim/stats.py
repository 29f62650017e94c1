"""Per-device figures of a simulated iteration: busy, communicating, idle; the bubble.

*Busy* is time on the compute stream: forward, backward and optimizer math
(``compute_s``) and the blocking tensor-parallel collectives inside them
(``tp_comm_s``). *Transfer* time is when at least one of the device's
pipeline transfers or gradient all-reduces is in flight; it overlaps compute.
*Idle* is the rest of the iteration. The *bubble fraction* is the idle share
of all devices' time until the last forward or backward ends: for identical
stages under GPipe or 1F1B it is ``(p - 1) / (m + p - 1)``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from potluck.sim.result import (
    DeviceStats,
    GradientSync,
    MemoryTrace,
    OptimizerStep,
    PipelineRun,
)
from potluck.sim.workload import PipelineWorkload


@dataclass
class _StageTotals:
    compute_s: float = 0.0
    tp_s: float = 0.0
    transfers: list[tuple[float, float]] = field(default_factory=list)


def pipeline_end_s(run: PipelineRun) -> float:
    """When the pipeline's last forward or backward ends."""
    return max(op.end_s for op in run.ops if op.peer == -1)


def bubble_fraction(workloads: list[PipelineWorkload], runs: list[PipelineRun]) -> float:
    """Idle share of the devices' time until the last forward or backward of any pipeline."""
    end_s = max(pipeline_end_s(run) for run in runs)
    busy_s = total_s = 0.0
    for work, run in zip(workloads, runs, strict=True):
        width = [len(stage.devices) for stage in work.stages]
        busy_s += sum(width[op.stage] * (op.end_s - op.start_s) for op in run.ops if op.peer == -1)
        total_s += sum(width) * end_s
    return 1.0 - busy_s / total_s


def device_stats(workloads: list[PipelineWorkload], runs: list[PipelineRun],
                 syncs: list[GradientSync], steps: list[OptimizerStep],
                 memory: tuple[tuple[MemoryTrace, ...], ...], iteration_s: float
                 ) -> tuple[DeviceStats, ...]:
    """Figures for every device of the plan, in plan order."""
    totals = _stage_totals(runs)
    extra: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    for sync in syncs:
        for member in sync.members:
            extra[member].append((sync.start_s, sync.end_s))
    optimizer = {(s.pipeline, s.stage): s.end_s - s.start_s for s in steps}
    result = []
    for k, work in enumerate(workloads):
        for i, stage in enumerate(work.stages):
            t = totals[runs[k].twin_of][i]
            compute = t.compute_s + optimizer[(k, i)]
            transfer = _union_s(t.transfers + extra[(k, i)])
            peak = memory[k][i].peak_bytes
            for device in stage.devices:
                result.append(DeviceStats(device.id, k, i, compute, t.tp_s, transfer,
                                          max(0.0, iteration_s - compute - t.tp_s), peak))
    return tuple(result)


def _stage_totals(runs: list[PipelineRun]) -> dict[int, dict[int, _StageTotals]]:
    """Sums per stage of each simulated pipeline (twins share them)."""
    totals: dict[int, dict[int, _StageTotals]] = {}
    for run in runs:
        if run.twin_of in totals:
            continue
        stages: dict[int, _StageTotals] = defaultdict(_StageTotals)
        for op in run.ops:
            if not op.kind.is_comm:
                stages[op.stage].compute_s += op.end_s - op.start_s - op.tp_s
                stages[op.stage].tp_s += op.tp_s
            else:
                stages[op.stage].transfers.append((op.start_s, op.end_s))
                stages[op.peer].transfers.append((op.start_s, op.end_s))
        totals[run.twin_of] = stages
    return totals


def _union_s(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of ``intervals``."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total
