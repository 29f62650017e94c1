"""Whole-plan evaluation: every pipeline, every gradient ring, every device's memory.

:class:`PlanEvaluation` composes the per-stage costs of
:class:`~potluck.planner.cost.CostModel` into a :class:`~potluck.plans.Prediction`:
pipeline times per replica (unequal stages, the plan's schedule), the data-parallel
all-reduce of each stage's gradients over the ring of replicas holding the same layers
(network cards shared by the rings that cross them, overlapped with the last backward
pass), the tied-embedding exchange, the optimizer step, the critical-path breakdown and
per-device memory.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from potluck.cluster.topology import Device
from potluck.model import counts
from potluck.planner import formulas
from potluck.planner.cost import CostModel, StageCost, pipeline_nic_sharing, stage_devices
from potluck.planner.formulas import PipelineTime
from potluck.plans import DeviceMemory, Plan, Prediction, Stage, TimeBreakdown


@dataclass
class DpGroup:
    """Replicas of one stage's parameters that all-reduce their gradients together."""

    members: list[tuple[int, int]]  # (pipeline, stage)
    rings: list[list[Device]]  # one ring per tensor-parallel rank
    grad_bytes: float
    scatter: bool = False  # ZeRO-1: reduce-scattered to the owners, half an all-reduce

    def sync_s(self, cost: CostModel, ring: list[Device], sharing: dict[str, int]) -> float:
        """One ring's gradient collective: an all-reduce, or (``scatter``) a reduce-scatter."""
        per_ring_bytes = self.grad_bytes / len(self.rings)
        if not self.scatter:
            return cost.allreduce_s(per_ring_bytes, ring, sharing)
        bandwidth, latency = cost.ring_bandwidth(ring, sharing)
        return formulas.ring_allgather_time_s(per_ring_bytes, len(ring), bandwidth, latency)


class PlanEvaluation:
    """One evaluation of a whole plan; split out to keep each step short."""

    def __init__(self, cost: CostModel, plan: Plan) -> None:
        self.cost = cost
        self.plan = plan
        self.devices = stage_devices(cost, plan)

    def prediction(self) -> Prediction:
        pp_sharing = self._pp_nic_sharing()
        costs = [self._pipeline_stage_costs(k, pp_sharing) for k in range(len(self.devices))]
        times = [
            formulas.pipeline_time([c.work for c in costs[k]], p.num_micro_batches,
                                   self.plan.schedule.value, self.plan.virtual_stages,
                                   self.cost.execution.overlap_p2p)
            for k, p in enumerate(self.plan.pipelines)
        ]
        groups = self._dp_groups(costs)
        dp_end_s = self._dp_end_s(groups, costs, times)
        pipe_end_s = max(t.total_s for t in times)
        optimizer_s = self._optimizer_s(costs, groups)
        iteration_s = max(pipe_end_s, dp_end_s) + optimizer_s
        breakdown = self._breakdown(costs, times, max(0.0, dp_end_s - pipe_end_s), optimizer_s)
        memory = self._memory(costs, groups)
        return self._summary(iteration_s, breakdown, memory, costs)

    def _pipeline_stage_costs(self, k: int, pp_sharing: dict[str, int]) -> list[StageCost]:
        pipeline, plan = self.plan.pipelines[k], self.plan
        stages = self.devices[k]
        pp, b = len(stages), pipeline.micro_batch_size
        result = []
        for i, devices in enumerate(stages):
            first, last = i == 0, i == pp - 1
            stage = pipeline.stages[i]
            send = 0.0 if last else self.cost.send_s(devices, stages[i + 1], b, pp_sharing)
            work, compute = self.cost.stage_work(devices, stage.num_layers, first, last, b,
                                                 plan.recompute, send)
            in_flight = formulas.in_flight_micro_batches(
                plan.schedule.value, i, pp, pipeline.num_micro_batches, plan.virtual_stages)
            activations = self.cost.stage_peak_activation_bytes(
                devices[0].type, stage.num_layers, first, last, len(devices), b,
                plan.recompute, in_flight)
            params = self.cost.stage_params(stage.num_layers, first, last, pp, len(devices))
            result.append(StageCost(work, compute, params, activations))
        return result

    def _pp_nic_sharing(self) -> dict[str, int]:
        return pipeline_nic_sharing(self.devices)

    def _dp_groups(self, costs: list[list[StageCost]]) -> list[DpGroup]:
        """Group each stage of the longest pipeline with the stages of the other pipelines
        that hold the most of the same layers; add the tied-embedding groups."""
        pipelines = self.plan.pipelines
        lead = max(range(len(pipelines)), key=lambda k: pipelines[k].pp)
        others = [k for k in range(len(pipelines)) if k != lead]
        groups = []
        for i, stage in enumerate(pipelines[lead].stages):
            members = [(lead, i)] + [(k, _best_overlap(pipelines[k].stages, stage)) for k in others]
            group = self._group(members, costs[lead][i].params * len(self.devices[lead][i]))
            aligned = len({len(self.devices[k][j]) for k, j in members}) == 1
            group.scatter = self.plan.zero1 and aligned
            groups.append(group)
        if self.cost.model.tied_embeddings:
            groups.extend(self._embedding_groups())
        return groups

    def _group(self, members: list[tuple[int, int]], full_params: float) -> DpGroup:
        tp = min(len(self.devices[k][j]) for k, j in members)
        rings = [[self.devices[k][j][r] for k, j in members] for r in range(tp)]
        element = self.cost.grad_bytes(self.devices[members[0][0]][members[0][1]][0].type)
        return DpGroup(members, rings, element * full_params)

    def _embedding_groups(self) -> list[DpGroup]:
        """With pipeline parallelism a tied embedding lives on the first and the last stage;
        their gradients are summed after the backward pass (Megatron's embedding group)."""
        m = self.cost.model
        groups = []
        for k, stages in enumerate(self.devices):
            if len(stages) > 1:
                members = [(k, 0), (k, len(stages) - 1)]
                groups.append(self._group(members, m.vocab_size * m.hidden_size))
        return groups

    def _dp_end_s(self, groups: list[DpGroup], costs: list[list[StageCost]],
                  times: list[PipelineTime]) -> float:
        """When the last gradient all-reduce ends; each starts when all its replicas are done
        and overlaps with the last micro-batch's backward of the slowest replica."""
        sharing = self._dp_nic_sharing(groups)
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

    def _dp_nic_sharing(self, groups: list[DpGroup]) -> dict[str, int]:
        sharing: dict[str, int] = defaultdict(int)
        for group in groups:
            for ring in group.rings:
                nodes = {d.node for d in ring}
                if len(nodes) > 1:
                    for node in nodes:
                        sharing[node] += 1
        return sharing

    def _optimizer_s(self, costs: list[list[StageCost]], groups: list[DpGroup]) -> float:
        dp = len(self.plan.pipelines)
        step = max(
            self.cost.optimizer_step_s(self.devices[k][j][0].type, c.params, dp, self.plan.zero1)
            for k, stage_costs in enumerate(costs) for j, c in enumerate(stage_costs)
        )
        return step + (self._zero1_gather_s(groups) if self.plan.zero1 and dp > 1 else 0.0)

    def _zero1_gather_s(self, groups: list[DpGroup]) -> float:
        """ZeRO-1: each owner's updated parameters are all-gathered over its replicas
        after the optimizer step (half a ring all-reduce of the stage's parameters)."""
        sharing = self._dp_nic_sharing(groups)
        slowest = 0.0
        for group in groups:
            if len(group.members) <= 1:
                continue
            per_ring_bytes = group.grad_bytes / len(group.rings)
            for ring in group.rings:
                bandwidth, latency = self.cost.ring_bandwidth(ring, sharing)
                slowest = max(slowest, formulas.ring_allgather_time_s(
                    per_ring_bytes, len(ring), bandwidth, latency))
        return slowest

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

    def _memory(self, costs: list[list[StageCost]], groups: list[DpGroup]) -> list[DeviceMemory]:
        dp = len(self.plan.pipelines)
        memory = []
        for k, stage_costs in enumerate(costs):
            for j, c in enumerate(stage_costs):
                for device in self.devices[k][j]:
                    memory.append(self._device_memory(device, k, j, c, dp))
        return memory

    def _device_memory(self, device: Device, k: int, j: int, c: StageCost,
                       dp: int) -> DeviceMemory:
        layout = self.cost.state_layout(device.type)
        states = self.cost.model_state_bytes(device.type, c.params, dp, self.plan.zero1)
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
        peak_flops = sum(d.type.tflops for d in used) * 1e12
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


def _best_overlap(stages: tuple[Stage, ...], target: Stage) -> int:
    """The stage of another pipeline that shares the most layers with ``target``."""
    wanted = {layer for start, end in target.layer_ranges for layer in range(start, end)}
    return max(
        range(len(stages)),
        key=lambda j: len(wanted & {x for s, e in stages[j].layer_ranges for x in range(s, e)}),
    )


def gradient_groups(cost: CostModel, plan: Plan) -> list[DpGroup]:
    """The gradient all-reduce groups of ``plan`` (stage replicas, tied embeddings)."""
    evaluation = PlanEvaluation(cost, plan)
    costs = [evaluation._pipeline_stage_costs(k, {}) for k in range(len(plan.pipelines))]
    return evaluation._dp_groups(costs)
