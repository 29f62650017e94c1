"""What a measured trace says about each device, per step: compute, optimizer, all-reduce.

Steps are those the comparison uses (the first traced step left out when
there are several), summarized by their median: a step that another process
on the machine slowed down does not skew it. Compute is the sum of a
device's forward and backward ops (``backward_input`` and
``backward_weight`` under zero bubble) in one step: what the cost model
predicts as ``m x (f + b)`` of its stage. The gradient all-reduce is kept
per step, since a rank's all-reduce also waits for the slowest replica and
only the last one to arrive measures the collective itself.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from potluck.ops import OpKind
from potluck.traces import Trace

BACKWARD_KINDS = tuple(kind for kind in OpKind if kind.is_backward)
COMPUTE_KINDS = tuple(kind for kind in OpKind if kind.is_pipeline_compute)


def kept_steps(trace: Trace) -> list[int]:
    """The steps measurements average over: all but the first, when there are several."""
    steps = sorted({e.step for e in trace.events})
    return steps[1:] if len(steps) > 1 else steps


def _median_per_step(trace: Trace, kinds: tuple[OpKind, ...]) -> dict[str, float]:
    """Per device: the median over the kept steps of its seconds in ``kinds`` ops."""
    steps = kept_steps(trace)
    totals: dict[str, dict[int, float]] = defaultdict(lambda: dict.fromkeys(steps, 0.0))
    for event in trace.events:
        if event.kind in kinds and event.step in steps:
            totals[event.device][event.step] += event.duration_s
    return {device: statistics.median(per_step.values()) for device, per_step in totals.items()}


def compute_s(trace: Trace) -> dict[str, float]:
    """Per device: forward and backward seconds in one step."""
    return _median_per_step(trace, COMPUTE_KINDS)


def op_s(trace: Trace, kinds: tuple[OpKind, ...]) -> dict[str, float]:
    """Per device: seconds in ``kinds`` ops in one step."""
    return _median_per_step(trace, kinds)


def optimizer_s(trace: Trace) -> dict[str, float]:
    """Per device: seconds of its optimizer step."""
    return _median_per_step(trace, (OpKind.OPTIMIZER,))


def allreduce_s(trace: Trace) -> dict[int, dict[str, float]]:
    """Per kept step, per device: seconds in the gradient all-reduce."""
    steps = kept_steps(trace)
    found: dict[int, dict[str, float]] = {step: defaultdict(float) for step in steps}
    for event in trace.events:
        if event.kind == OpKind.DP_ALLREDUCE and event.step in found:
            found[event.step][event.device] += event.duration_s
    return {step: dict(values) for step, values in found.items() if values}
