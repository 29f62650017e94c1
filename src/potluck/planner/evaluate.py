"""Whole-plan evaluation: every pipeline, every gradient ring, every device's memory.

:func:`predict` composes the per-stage costs of
:class:`~potluck.planner.cost.CostModel` into a :class:`~potluck.plans.Prediction`:
pipeline times per replica (unequal stages, under the plan's schedule,
:mod:`potluck.schedules`), the data-parallel reduction of each stage's
gradients over the ring of replicas holding the same layers
(:func:`potluck.placement.replica_stages`; network cards shared by the rings
that cross them, overlapped with the last backward pass), the tied-embedding
exchange, the optimizer step (with ZeRO-1's parameter all-gather), the
critical-path breakdown and per-device memory.

The per-stage figures the emulator and calibration need for a plan
(:func:`stage_op_times`, :func:`stage_send_s`) and the gradient groups the
simulator replays (:func:`gradient_groups`) come from here too, so they are
the very ones the prediction adds up.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from potluck import placement
from potluck.cluster.topology import Device
from potluck.model import counts
from potluck.placement import StageRef
from potluck.planner import compute
from potluck.planner.cost import CostModel, StageShape
from potluck.planner.formulas import StateSharding
from potluck.planner.network import NicSharing
from potluck.plans import DeviceMemory, Plan, Prediction, TimeBreakdown
from potluck.schedules import PipelineTime, StageWork, schedule_for

StageDevices = list[list[tuple[Device, ...]]]  # per pipeline, per stage: its TP group


@dataclass
class GradientGroup:
    """Replicas of one stage's parameters that reduce their gradients together."""

    members: list[StageRef]
    rings: list[list[Device]]  # one ring per tensor-parallel rank
    grad_bytes: float
    scatter: bool = False  # ZeRO-1: reduce-scattered to the owners, half an all-reduce

    @property
    def bytes_per_ring(self) -> float:
        return self.grad_bytes / len(self.rings)

    def sync_s(self, cost: CostModel, ring: list[Device], sharing: NicSharing) -> float:
        """One ring's gradient collective: an all-reduce, or (``scatter``) a reduce-scatter."""
        if not self.scatter:
            return cost.network.allreduce_s(self.bytes_per_ring, ring, sharing)
        return cost.network.reduce_scatter_s(self.bytes_per_ring, ring, sharing)

    def gather_s(self, cost: CostModel, sharing: NicSharing) -> float:
        """ZeRO-1: the owners' updated parameters all-gathered over the slowest ring."""
        return max(cost.network.reduce_scatter_s(self.bytes_per_ring, ring, sharing)
                   for ring in self.rings)


@dataclass(frozen=True)
class StageCost:
    """A stage's work per micro-batch, its parameters and its memory at peak."""

    work: StageWork
    compute_s: float  # forward + backward compute, without TP communication
    params: float  # parameters held by each device of the stage
    activations_bytes: float  # peak activation bytes on each device


def predict(plan: Plan, cost: CostModel | None = None) -> Prediction:
    """Predict iteration time, throughput and per-device memory of ``plan`` (with the plan's
    own cost model unless ``cost`` is given)."""
    return PlanEvaluation(cost or CostModel.for_plan(plan), plan).prediction()


def stage_devices(cost: CostModel, plan: Plan) -> StageDevices:
    """Per pipeline, per stage: the stage's devices."""
    return [[tuple(cost.cluster.device(d) for d in stage.devices) for stage in pipeline.stages]
            for pipeline in plan.pipelines]


def stage_shape(plan: Plan, pipeline: int, stage: int) -> StageShape:
    """Stage ``stage`` of pipeline ``pipeline`` as the cost model sees it."""
    p = plan.pipelines[pipeline]
    return StageShape(p.stages[stage].num_layers, stage == 0, stage == p.pp - 1, p.pp,
                      p.micro_batch_size, plan.recompute)


def stage_sharding(plan: Plan) -> StateSharding:
    """How the plan shards its model states over the replicas."""
    return StateSharding.zero1(plan.dp, plan.zero1)


def gradient_groups(cost: CostModel, plan: Plan) -> list[GradientGroup]:
    """The gradient groups of ``plan`` (stage replicas, tied embeddings) :func:`predict` prices."""
    evaluation = PlanEvaluation(cost, plan)
    return evaluation.gradient_groups([evaluation.stage_params(k) for k in range(plan.dp)])


def stage_send_s(plan: Plan, pipeline: int, sender: int, receiver: int,
                 cost: CostModel | None = None) -> float:
    """One micro-batch's transfer from stage ``sender`` to stage ``receiver`` of
    ``pipeline``, as the plan's evaluation charges it: pipelines whose transfers leave a
    machine share its network card (:meth:`NicSharing.of_pipelines`). ``cost``: the plan's
    cost model, when the caller has it."""
    cost = cost or CostModel.for_plan(plan)
    devices = stage_devices(cost, plan)
    stages = devices[pipeline]
    return cost.send_s(stages[sender], stages[receiver], plan.pipelines[pipeline].micro_batch_size,
                       NicSharing.of_pipelines(devices))


def stage_op_times(plan: Plan) -> tuple[tuple[StageWork, ...], ...]:
    """Predicted forward and backward time of one micro-batch on every stage of ``plan``
    (TP communication included, no transfer), for the emulator and calibration."""
    cost = CostModel.for_plan(plan)
    devices = stage_devices(cost, plan)
    return tuple(
        tuple(cost.stage_time(devices[k][i], stage_shape(plan, k, i)).work
              for i in range(pipeline.pp))
        for k, pipeline in enumerate(plan.pipelines)
    )


@dataclass
class PlanEvaluation:
    """One evaluation of a whole plan; split out to keep each step short."""

    cost: CostModel
    plan: Plan
    devices: StageDevices = field(init=False)

    def __post_init__(self) -> None:
        self.devices = stage_devices(self.cost, self.plan)

    def prediction(self) -> Prediction:
        schedule = schedule_for(self.plan.schedule)
        pp_sharing = NicSharing.of_pipelines(self.devices)
        costs = [self._pipeline_stage_costs(k, pp_sharing) for k in range(len(self.devices))]
        times = [
            schedule.pipeline_time([c.work for c in costs[k]], p.num_micro_batches,
                                   self.plan.virtual_stages,
                                   overlap_p2p=self.cost.execution.overlap_p2p)
            for k, p in enumerate(self.plan.pipelines)
        ]
        groups = self.gradient_groups([[c.params for c in stage_costs] for stage_costs in costs])
        rings_sharing = NicSharing.of_rings(ring for group in groups for ring in group.rings)
        dp_end_s = self._dp_end_s(groups, costs, times, rings_sharing)
        pipe_end_s = max(t.total_s for t in times)
        optimizer_s = self._optimizer_s(costs, groups, rings_sharing)
        iteration_s = max(pipe_end_s, dp_end_s) + optimizer_s
        breakdown = self._breakdown(costs, times, max(0.0, dp_end_s - pipe_end_s), optimizer_s)
        return self._summary(iteration_s, breakdown, self._memory(costs), costs)

    def _pipeline_stage_costs(self, k: int, pp_sharing: NicSharing) -> list[StageCost]:
        pipeline, plan = self.plan.pipelines[k], self.plan
        schedule = schedule_for(plan.schedule)
        stages = self.devices[k]
        pp, b = len(stages), pipeline.micro_batch_size
        result = []
        for i, devices in enumerate(stages):
            shape = stage_shape(plan, k, i)
            send = 0.0 if shape.last else self.cost.send_s(devices, stages[i + 1], b, pp_sharing)
            timing = self.cost.stage_time(devices, shape, send)
            in_flight = schedule.in_flight(i, pp, pipeline.num_micro_batches, plan.virtual_stages)
            activations = self.cost.stage_peak_activation_bytes(
                devices[0].type, len(devices), shape, in_flight)
            params = self.cost.stage_params(shape, len(devices))
            result.append(StageCost(timing.work, timing.compute_s, params, activations))
        return result

    def stage_params(self, k: int) -> list[float]:
        """Parameters each device of every stage of pipeline ``k`` holds."""
        return [self.cost.stage_params(stage_shape(self.plan, k, i), len(devices))
                for i, devices in enumerate(self.devices[k])]

    def gradient_groups(self, params: list[list[float]]) -> list[GradientGroup]:
        """Each stage of the longest pipeline with its replicas in the other pipelines
        (:func:`potluck.placement.replica_stages`), then the tied-embedding groups."""
        groups = []
        for members in placement.replica_stages(self.plan):
            lead, i = members[0]
            group = self._group(list(members), params[lead][i] * len(self.devices[lead][i]))
            aligned = len({len(self.devices[k][j]) for k, j in members}) == 1
            group.scatter = self.plan.zero1 and aligned
            groups.append(group)
        m = self.cost.model
        for first, last in placement.tied_ends(self.plan):
            groups.append(self._group([first, last], m.vocab_size * m.hidden_size))
        return groups

    def _group(self, members: list[StageRef], full_params: float) -> GradientGroup:
        tp = min(len(self.devices[k][j]) for k, j in members)
        rings = [[self.devices[k][j][r] for k, j in members] for r in range(tp)]
        element = self.cost.grad_bytes(self.devices[members[0][0]][members[0][1]][0].type)
        return GradientGroup(members, rings, element * full_params)

    def _dp_end_s(self, groups: list[GradientGroup], costs: list[list[StageCost]],
                  times: list[PipelineTime], sharing: NicSharing) -> float:
        """When the last gradient reduction ends; each starts when all its replicas are done
        and overlaps with the last micro-batch's backward of the slowest replica."""
        end = 0.0
        for group in groups:
            if len(group.members) <= 1:
                continue
            allreduce = max(group.sync_s(self.cost, ring, sharing) for ring in group.rings)
            ready = max(times[k].finish_s[j] for k, j in group.members)
            window = min(costs[k][j].work.backward_s for k, j in group.members)
            if not self.cost.execution.overlap_grad_reduce:
                window = 0.0
            end = max(end, ready + max(0.0, allreduce - window))
        return end

    def _optimizer_s(self, costs: list[list[StageCost]], groups: list[GradientGroup],
                     sharing: NicSharing) -> float:
        sharding = stage_sharding(self.plan)
        step = max(
            self.cost.optimizer_step_s(self.devices[k][j][0].type, c.params, sharding)
            for k, stage_costs in enumerate(costs) for j, c in enumerate(stage_costs)
        )
        if not (self.plan.zero1 and self.plan.dp > 1):
            return step
        gathers = [g.gather_s(self.cost, sharing) for g in groups if len(g.members) > 1]
        return step + max(gathers, default=0.0)

    def _breakdown(self, costs: list[list[StageCost]], times: list[PipelineTime],
                   dp_s: float, optimizer_s: float) -> TimeBreakdown:
        slowest = max(range(len(times)), key=lambda k: times[k].total_s)
        t, m = times[slowest], self.plan.pipelines[slowest].num_micro_batches
        stage = costs[slowest][t.bottleneck_stage]
        compute = m * stage.compute_s
        tp = max(0.0, m * (stage.work.total_s - stage.compute_s))
        pp = max(0.0, m * (t.period_s - stage.work.total_s)) + t.fill_transfer_s
        bubble = max(0.0, t.total_s - compute - tp - pp)
        return TimeBreakdown(compute, bubble, tp, pp, dp_s, optimizer_s)

    def _memory(self, costs: list[list[StageCost]]) -> list[DeviceMemory]:
        return [self._device_memory(device, k, j, c)
                for k, stage_costs in enumerate(costs)
                for j, c in enumerate(stage_costs)
                for device in self.devices[k][j]]

    def _device_memory(self, device: Device, k: int, j: int, c: StageCost) -> DeviceMemory:
        layout = self.cost.state_layout(device.type)
        states = self.cost.model_state_bytes(device.type, c.params, stage_sharding(self.plan))
        weights = layout.weights * c.params
        grads = layout.grads * c.params
        optimizer = states - weights - grads
        overhead = self.cost.overhead_bytes(device.type)
        total = states + c.activations_bytes + overhead
        return DeviceMemory(device.id, k, j, weights, grads, optimizer, c.activations_bytes, total)

    def _summary(self, iteration_s: float, breakdown: TimeBreakdown,
                 memory: list[DeviceMemory], costs: list[list[StageCost]]) -> Prediction:
        plan, model = self.plan, self.cost.model
        tokens = plan.training.global_batch * plan.training.seq_len
        tokens_per_s = tokens / iteration_s
        flops_per_s = counts.model_flops_per_token(model, plan.training.seq_len) * tokens_per_s
        used = [d for stages in self.devices for stage in stages for d in stage]
        # MFU against the peak of the dtype each device computes in (TF32, FP32 or 16-bit)
        peak_flops = sum(compute.peak_flops(d.type, plan.training.dtype) for d in used)
        return Prediction(
            iteration_time_s=iteration_s,
            tokens_per_s=tokens_per_s,
            tflops_per_gpu=flops_per_s / len(used) / 1e12,
            mfu=flops_per_s / peak_flops,
            peak_memory_bytes=max(m.total_bytes for m in memory),
            breakdown=breakdown,
            memory=tuple(memory),
            stage_times_s=tuple(tuple(c.work.total_s for c in s) for s in costs),
        )

