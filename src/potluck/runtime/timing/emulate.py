"""Emulation: run a plan made for other devices on this machine's CPU, at their speed.

Each rank runs its real computation on CPU (so numerics are exactly those of
a real run) and then sleeps until the op has taken as long as the cost model
predicts for the plan's device, stretched by one global **dilation** factor:
``target = dilation x predicted``. The dilation makes the CPU fast enough
relative to the emulated devices: it is calibrated so that every real op
finishes before its target (largest measured/predicted ratio over all ops of
all ranks, times a margin), so the CPU is never the bottleneck and relative
speeds (an A100 stage against a 3090 stage) are the cost model's. Measured
step times are then compared with ``dilation x`` the predicted step time.

Targets come from the one cost model (:mod:`potluck.planner.cost`): per stage
and micro-batch, forward and backward (TP communication included), plus the
pipeline send to the next stage (forward) or the previous one (backward);
the exposed data-parallel all-reduce and the optimizer step from the plan's
prediction. A rank with several virtual stages splits its stage's times by
layer count; zero-bubble's input and weight backward get half each.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from potluck.ops import OpKind
from potluck.plans import Plan, Prediction
from potluck.runtime.layout import Layout
from potluck.runtime.timing.clock import CommOp, Segment, Waitable

log = logging.getLogger(__name__)
T = TypeVar("T")
CALIBRATION_MARGIN = 1.5


@dataclass(frozen=True)
class OpTargets:
    """Predicted seconds of one micro-batch of one virtual stage on its device."""

    forward_s: float
    backward_s: float


def predict(plan: Plan) -> Prediction:
    """The plan's own prediction, or the cost model's if the plan carries none."""
    if plan.prediction is not None:
        return plan.prediction
    from potluck.planner.evaluate import predict as cost_model_prediction

    return cost_model_prediction(plan)


def stage_targets(plan: Plan, layout: Layout) -> dict[int, OpTargets]:
    """This rank's predicted op times, by virtual stage id."""
    from potluck.planner.evaluate import stage_op_times, stage_send_s

    role = layout.role
    times = stage_op_times(plan)[role.pipeline][role.stage]
    forward_s, backward_s = times.forward_s, times.backward_s
    if role.stage < role.pp - 1:
        forward_s += stage_send_s(plan, role.pipeline, role.stage, role.stage + 1)
    if role.stage > 0:
        backward_s += stage_send_s(plan, role.pipeline, role.stage, role.stage - 1)
    layers = sum(end - start for start, end in role.layer_ranges)
    targets = {}
    for (start, end), stage_id in zip(role.layer_ranges, role.virtual_stage_ids, strict=True):
        share = (end - start) / layers
        targets[stage_id] = OpTargets(forward_s * share, backward_s * share)
    return targets


class EmulationClock:
    """Times each op of this rank and pads it to ``dilation x predicted`` (a
    :class:`~potluck.runtime.timing.clock.Clock`)."""

    def __init__(self, targets: dict[int, OpTargets], dp_sync_s: float, optimizer_s: float,
                 dilation: float | None = None) -> None:
        self.targets = targets
        self.dp_sync_s = dp_sync_s
        self.optimizer_s = optimizer_s
        self.dilation = dilation or 0.0
        self.max_ratio = 0.0
        self.overruns = 0

    @classmethod
    def for_plan(cls, plan: Plan, layout: Layout, dilation: float | None = None
                 ) -> EmulationClock:
        prediction = predict(plan)
        breakdown = prediction.breakdown
        return cls(stage_targets(plan, layout), breakdown.dp_s, breakdown.optimizer_s, dilation)

    def predicted_s(self, kind: OpKind, stage_id: int) -> float:
        if kind is OpKind.DP_ALLREDUCE:
            return self.dp_sync_s
        if kind is OpKind.OPTIMIZER:
            return self.optimizer_s
        target = self.targets.get(stage_id) or OpTargets(  # WHOLE_RANK: all virtual stages
            sum(t.forward_s for t in self.targets.values()),
            sum(t.backward_s for t in self.targets.values()))
        if kind is OpKind.FORWARD:
            return target.forward_s
        if kind is OpKind.BACKWARD:
            return target.backward_s
        return 0.5 * target.backward_s  # backward_input / backward_weight (zero bubble)

    def run(self, kind: OpKind, stage_id: int, fn: Callable[[], T]) -> T:
        """Run ``fn``; then sleep until it has taken ``dilation x`` its predicted time."""
        start_s = time.perf_counter()
        result = fn()
        elapsed_s = time.perf_counter() - start_s
        predicted_s = self.predicted_s(kind, stage_id)
        if predicted_s > 0 and kind not in (OpKind.DP_ALLREDUCE, OpKind.OPTIMIZER):
            self.max_ratio = max(self.max_ratio, elapsed_s / predicted_s)
        target_s = self.dilation * predicted_s
        if self.dilation > 0:
            if elapsed_s > target_s:
                self.overruns += 1
            else:
                time.sleep(target_s - elapsed_s)
        return result

    def tag_p2p(self, ops: list[Any], kind: OpKind, stage_id: int, micro_batch: int
                ) -> list[Any]:
        """Sends and receives are padded inside their compute ops: nothing to tag."""
        return ops

    def start_comm(self, op: CommOp, work: Waitable) -> Waitable:
        return work

    def run_segment(self, segment: Segment, fn: Callable[[], T]) -> T:
        return fn()

    def calibrate(self, margin: float = CALIBRATION_MARGIN) -> float:
        """Set the dilation from the ops measured so far, the same on every rank."""
        ratio = torch.tensor([self.max_ratio], dtype=torch.float64)
        dist.all_reduce(ratio, op=dist.ReduceOp.MAX)
        self.dilation = float(ratio) * margin
        self.overruns = 0
        log.info("emulation: dilation %.1f (slowest op %.1fx its prediction)", self.dilation,
                 float(ratio))
        return self.dilation


def emulate(model: Any, dilation: float | None = None, timing: Plan | None = None
            ) -> EmulationClock:
    """Put a :class:`~potluck.runtime.parallel_model.ParallelModel` on emulated
    time; returns its clock.

    ``timing`` is the plan whose devices and model set the targets (default: the
    plan being run; differs when a stand-in model is computed).
    """
    clock = EmulationClock.for_plan(timing or model.layout.plan, model.layout, dilation)
    model.set_clock(clock)
    return clock
