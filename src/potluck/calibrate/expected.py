"""What the cost model says a device's ops take in a run, as its trace measures them.

In a real run a device's forward and backward are its stage's work in the
cost model (TP traffic included) and its optimizer step is its own. An
emulated run's ops were padded by the emulator (:mod:`potluck.runtime.timing.emulate`)
to other sums: forward and backward also hold the stage's send to the next
(previous) stage, and every rank's optimizer step and gradient sync is the
plan's (the slowest device's optimizer, the exposed all-reduce). Calibration
compares what was measured with these.
"""

from __future__ import annotations

from potluck.planner.cost import CostModel
from potluck.planner.evaluate import predict, stage_devices, stage_send_s, stage_shape, stage_sharding
from potluck.plans import Plan


def stages_of(plan: Plan) -> dict[str, tuple[int, int]]:
    """(pipeline, stage) of every device of the plan."""
    return {device: (k, i) for k, pipeline in enumerate(plan.pipelines)
            for i, stage in enumerate(pipeline.stages) for device in stage.devices}


def backward_s(cost: CostModel, plan: Plan, k: int, i: int) -> float:
    """One micro-batch's backward on stage ``i`` of pipeline ``k`` (TP traffic included)."""
    devices = tuple(cost.cluster.device(d) for d in plan.pipelines[k].stages[i].devices)
    return cost.stage_time(devices, stage_shape(plan, k, i)).work.backward_s


def compute_s(plan: Plan, devices: list[str], emulated: bool = False) -> float:
    """Forward and backward seconds of ``devices`` in one step, summed."""
    cost = CostModel.for_plan(plan)
    where = stages_of(plan)
    placed = stage_devices(cost, plan)
    total = 0.0
    for device in devices:
        k, i = where[device]
        pipeline = plan.pipelines[k]
        work = cost.stage_time(placed[k][i], stage_shape(plan, k, i)).work
        sends = 0.0
        if emulated and not plan.comm.split_p2p_channels:  # padded as the emulator does
            # (runtime.timing.targets.stage_targets; split channels time them apart)
            sends = sum(stage_send_s(plan, k, i, j, cost) for j in (i - 1, i + 1)
                        if 0 <= j < pipeline.pp)
        total += pipeline.num_micro_batches * (work.total_s + sends)
    return total


def optimizer_s(plan: Plan, devices: list[str], emulated: bool = False) -> float:
    """Optimizer seconds of ``devices`` in one step, summed."""
    cost = CostModel.for_plan(plan)
    if emulated and not plan.comm.dp_priority_schedule:  # the plan's, on every rank
        return len(devices) * predict(plan, cost).breakdown.optimizer_s
    where = stages_of(plan)
    total = 0.0
    for device in devices:
        k, i = where[device]
        params = cost.stage_params(stage_shape(plan, k, i), plan.pipelines[k].stages[i].tp)
        total += cost.optimizer_step_s(cost.cluster.device(device).type, params,
                                       stage_sharding(plan))
    return total
