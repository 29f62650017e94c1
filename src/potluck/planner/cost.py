"""The cost model: time and memory of a Plan on its cluster.

One object, :class:`CostModel`, turns a plan into a :class:`Prediction`:
per-stage compute from each device's achievable throughput (roofline over the
stage's GEMMs, attention and element-wise ops), tensor-parallel collectives
over the real links of each TP group, pipeline transfers over the link
between consecutive stages, the schedule with unequal stages, the DP gradient
all-reduce over the slowest link of each replica group (overlapped with the
backward pass where the schedule allows, network cards shared by the rings
that cross them), and the optimizer step. Memory per device counts weights,
gradients, optimizer states (optionally ZeRO-1 sharded), activations of the
micro-batches in flight and runtime overhead.

The search, ``potluck plan``, the simulator and the emulator all call this
module; calibration changes its inputs (device efficiency, link bandwidth),
never its shape. Formulas live in :mod:`potluck.planner.formulas` and
:mod:`potluck.model.counts`.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from functools import lru_cache

from potluck.cluster.catalog import DeviceType
from potluck.cluster.topology import Cluster, Device, Link
from potluck.model import counts
from potluck.model.counts import Recompute
from potluck.model.spec import ModelSpec
from potluck.planner import formulas
from potluck.planner.formulas import PipelineTime, StageWork
from potluck.plans import DeviceMemory, DType, Plan, Prediction, Stage, TimeBreakdown

GPU_RUNTIME_OVERHEAD_BYTES = 1.0e9  # CUDA context, cuBLAS and NCCL workspaces
MEMORY_HEADROOM = 0.95  # plans leave 5% of device memory for allocator fragmentation
OPS_PER_BLOCK_FORWARD = 24  # eager kernels in one block's forward (norms, GEMMs, rotary, ...)
FLASH_BACKWARD_FACTOR = 2.5  # FlashAttention-2 backward recomputes scores: ~2.5x forward FLOPs
CAUSAL_FRACTION = 0.5  # causal attention kernels skip the masked half of the scores


def effective_dtype(device_type: DeviceType, requested: DType) -> DType:
    """CPU ranks train in FP32; devices without BF16 fall back to FP16."""
    if device_type.is_cpu:
        return DType.FP32
    if requested is DType.BF16 and not device_type.bf16:
        return DType.FP16
    return requested


def usable_memory_bytes(device_type: DeviceType) -> float:
    """Device memory a plan may fill."""
    return device_type.memory_bytes * MEMORY_HEADROOM


@dataclass(frozen=True)
class BlockTimes:
    """Compute time of one transformer block for one micro-batch on one device (no comms)."""

    forward_s: float
    backward_s: float
    weight_grad_s: float


@dataclass(frozen=True)
class StageCost:
    """A stage's work per micro-batch, its parameters and its memory at peak."""

    work: StageWork
    compute_s: float  # forward + backward compute, without TP communication
    params: float  # parameters held by each device of the stage
    activations_bytes: float  # peak activation bytes on each device


class CostModel:
    """Predicts time and memory for plans of one model on one cluster."""

    def __init__(self, cluster: Cluster, model: ModelSpec, seq_len: int,
                 dtype: DType = DType.BF16) -> None:
        self.cluster = cluster
        self.model = model
        self.seq_len = seq_len
        self.dtype = dtype
        self._block_times = lru_cache(maxsize=None)(self._compute_block_times)
        self._head_times = lru_cache(maxsize=None)(self._compute_head_times)
        self._tp_cache: dict[tuple, float] = {}

    # ---- compute -------------------------------------------------------------------------

    def element_bytes(self, device_type: DeviceType) -> int:
        return effective_dtype(device_type, self.dtype).bytes

    def block_times(self, device_type: DeviceType, tp: int, micro_batch: int,
                    recompute: Recompute) -> BlockTimes:
        return self._block_times(device_type, tp, micro_batch, recompute)

    def _compute_block_times(self, device: DeviceType, tp: int, b: int,
                             recompute: Recompute) -> BlockTimes:
        m, s = self.model, self.seq_len
        gemms = self._block_gemms_s(device, tp, b)
        attention = self._attention_core_s(device, tp, b)
        elementwise = counts.block_elementwise_bytes(m, b, s) / tp * self._element_scale(device)
        elementwise_s = formulas.roofline_time_s(
            0.0, elementwise, device.achievable_flops, device.memory_bandwidth_bytes_per_s
        )
        forward = gemms + attention + elementwise_s
        backward = 2.0 * gemms + FLASH_BACKWARD_FACTOR * attention + 2.0 * elementwise_s
        if recompute is Recompute.FULL:
            backward += forward
        elif recompute is Recompute.SELECTIVE:
            backward += attention
        dispatch = OPS_PER_BLOCK_FORWARD * formulas.KERNEL_DISPATCH_S
        forward_total = max(forward, dispatch)
        backward_total = max(backward, 2.0 * dispatch)
        return BlockTimes(forward_total, backward_total, weight_grad_s=gemms)

    def _element_scale(self, device: DeviceType) -> float:
        """Element-wise traffic is counted in 16-bit elements; FP32 doubles it."""
        return self.element_bytes(device) / 2.0

    def _block_gemms_s(self, device: DeviceType, tp: int, b: int) -> float:
        m = self.model
        rows, h, kv, f = b * self.seq_len, m.hidden_size, m.kv_hidden_size, m.ffn_hidden_size
        up_cols = (2 if m.mlp.value == "swiglu" else 1) * f
        shapes = [(rows, h, (h + 2 * kv) // tp), (rows, h // tp, h),
                  (rows, h, up_cols // tp), (rows, f // tp, h)]
        return sum(self._gemm_s(device, *shape) for shape in shapes)

    def _gemm_s(self, device: DeviceType, rows: int, inner: int, cols: int) -> float:
        return formulas.gemm_time_s(rows, max(1, inner), max(1, cols), device.achievable_flops,
                                    device.memory_bandwidth_bytes_per_s, self.element_bytes(device))

    def _attention_core_s(self, device: DeviceType, tp: int, b: int) -> float:
        m, s = self.model, self.seq_len
        flops = counts.attention_core_forward_flops(m, b, s) * CAUSAL_FRACTION / tp
        traffic = (4 * s * b * m.hidden_size + 4 * s * b * m.kv_hidden_size) / tp
        traffic *= self._element_scale(device)
        return formulas.roofline_time_s(flops, traffic, device.achievable_flops,
                                        device.memory_bandwidth_bytes_per_s)

    def head_times(self, device_type: DeviceType, tp: int, micro_batch: int) -> BlockTimes:
        return self._head_times(device_type, tp, micro_batch)

    def _compute_head_times(self, device: DeviceType, tp: int, b: int) -> BlockTimes:
        m = self.model
        rows = b * self.seq_len
        projection = self._gemm_s(device, rows, m.hidden_size, m.vocab_size // tp)
        # FP32 logits: softmax and cross-entropy read and write them about three times
        loss_traffic = 12.0 * rows * m.vocab_size / tp
        loss = formulas.roofline_time_s(0.0, loss_traffic, device.achievable_flops,
                                        device.memory_bandwidth_bytes_per_s)
        return BlockTimes(projection + loss, 2.0 * projection + loss, weight_grad_s=projection)

    # ---- communication -----------------------------------------------------------------

    def ring_bandwidth(self, ring: list[Device],
                       nic_sharing: dict[str, int] | None = None) -> tuple[float, float]:
        """Bottleneck bandwidth and worst latency of a ring through ``ring`` in order.

        A hop that leaves a machine shares its network card with the other rings
        that cross it at the same time (``nic_sharing``: rings per machine).
        """
        bandwidth, latency = float("inf"), 0.0
        for index, device in enumerate(ring):
            other = ring[(index + 1) % len(ring)]
            link = self.cluster.link(device, other)
            share = 1
            if nic_sharing and device.node != other.node:
                share = max(nic_sharing.get(device.node, 1), nic_sharing.get(other.node, 1))
            bandwidth = min(bandwidth, link.bandwidth_bytes_per_s / share)
            latency = max(latency, link.latency_s)
        return bandwidth, latency

    def allreduce_s(self, num_bytes: float, ring: list[Device],
                    nic_sharing: dict[str, int] | None = None) -> float:
        if len(ring) <= 1:
            return 0.0
        bandwidth, latency = self.ring_bandwidth(ring, nic_sharing)
        return formulas.ring_allreduce_time_s(num_bytes, len(ring), bandwidth, latency)

    def tp_block_comm_s(self, devices: tuple[Device, ...], micro_batch: int) -> float:
        """Forward TP traffic of one block: two all-reduce-equivalents of ``s*b*h`` (SC'21)."""
        if len(devices) <= 1:
            return 0.0
        # links inside a machine depend only on the group and the GPUs' positions
        key = (devices[0].group, tuple(d.local_index for d in devices), micro_batch)
        cached = self._tp_cache.get(key)
        if cached is None:
            cached = self._tp_cache[key] = self._tp_block_comm_s(devices, micro_batch)
        return cached

    def _tp_block_comm_s(self, devices: tuple[Device, ...], micro_batch: int) -> float:
        activation = self.seq_len * micro_batch * self.model.hidden_size
        num_bytes = activation * self.element_bytes(devices[0].type)
        return 2.0 * self.allreduce_s(num_bytes, list(devices))

    def send_bytes(self, device_type: DeviceType, micro_batch: int) -> float:
        """Bytes of one micro-batch's activations (or their gradients) between two stages."""
        activation = self.seq_len * micro_batch * self.model.hidden_size
        return activation * self.element_bytes(device_type)

    def send_s(self, sender: tuple[Device, ...], receiver: tuple[Device, ...], micro_batch: int,
               nic_sharing: dict[str, int] | None = None) -> float:
        """One micro-batch's activations from one stage to the next, TP ranks sending in parallel."""
        flows = min(len(sender), len(receiver))
        num_bytes = self.send_bytes(sender[0].type, micro_batch) / flows
        worst = 0.0
        for rank in range(flows):
            a, b = sender[rank], receiver[rank]
            link = self.cluster.link(a, b)
            share = 1
            if nic_sharing and a.node != b.node:
                share = max(nic_sharing.get(a.node, 1), nic_sharing.get(b.node, 1))
            worst = max(worst, link.latency_s + num_bytes * share / link.bandwidth_bytes_per_s)
        return worst

    # ---- stages ------------------------------------------------------------------------

    def stage_params(self, num_layers: int, first: bool, last: bool, pp: int, tp: int) -> float:
        m = self.model
        params = num_layers * counts.block_params(m)
        if first:
            params += counts.embedding_params(m)
        if last:
            params += counts.head_params(m, separate_from_embedding=pp > 1)
        return params / tp

    def stage_work(self, devices: tuple[Device, ...], num_layers: int, first: bool, last: bool,
                   micro_batch: int, recompute: Recompute, send_s: float) -> tuple[StageWork, float]:
        """Time per micro-batch of a stage (TP comms included) and its pure compute time."""
        device_type, tp = devices[0].type, len(devices)
        block = self.block_times(device_type, tp, micro_batch, recompute)
        tp_comm = self.tp_block_comm_s(devices, micro_batch)
        tp_backward = tp_comm * (2.0 if recompute is Recompute.FULL else 1.0)
        forward = num_layers * (block.forward_s + tp_comm)
        backward = num_layers * (block.backward_s + tp_backward)
        weight_grad = num_layers * block.weight_grad_s
        compute = num_layers * (block.forward_s + block.backward_s)
        if last:
            head = self.head_times(device_type, tp, micro_batch)
            forward += head.forward_s
            backward += head.backward_s
            weight_grad += head.weight_grad_s
            compute += head.forward_s + head.backward_s
        return StageWork(forward, backward, weight_grad, send_s), compute

    def activation_bytes_per_micro_batch(self, device_type: DeviceType, num_layers: int,
                                         first: bool, tp: int, micro_batch: int,
                                         recompute: Recompute) -> float:
        m, s, b = self.model, self.seq_len, micro_batch
        per_block = counts.block_activation_bytes(m, b, s, tp, recompute)
        total = num_layers * per_block
        if first:
            total += counts.embedding_activation_bytes(m, b, s, tp)
        return total * self._element_scale(device_type)

    def stage_peak_activation_bytes(self, device_type: DeviceType, num_layers: int, first: bool,
                                    last: bool, tp: int, micro_batch: int, recompute: Recompute,
                                    in_flight: float) -> float:
        """Activations of the micro-batches in flight, the head's logits and, with full
        recomputation, one block's full activations while it is recomputed."""
        m, s, b = self.model, self.seq_len, micro_batch
        scale = self._element_scale(device_type)
        held = in_flight * self.activation_bytes_per_micro_batch(
            device_type, num_layers, first, tp, b, recompute)
        if last:
            held += counts.head_activation_bytes(m, b, s, tp) * scale
        if recompute is Recompute.FULL and num_layers:
            held += counts.block_activation_bytes(m, b, s, tp, Recompute.NONE) * scale
        return held

    def overhead_bytes(self, device_type: DeviceType) -> float:
        return 0.0 if device_type.is_cpu else GPU_RUNTIME_OVERHEAD_BYTES

    def stage_memory_bytes(self, device_type: DeviceType, num_layers: int, first: bool,
                           last: bool, pp: int, tp: int, micro_batch: int, recompute: Recompute,
                           in_flight: float, dp: int, zero1: bool) -> float:
        """Peak bytes on one device of a stage: model states, activations, runtime overhead."""
        params = self.stage_params(num_layers, first, last, pp, tp)
        states = formulas.model_state_bytes(params, dp, zero1)
        activations = self.stage_peak_activation_bytes(
            device_type, num_layers, first, last, tp, micro_batch, recompute, in_flight)
        return states + activations + self.overhead_bytes(device_type)

    def optimizer_step_s(self, device_type: DeviceType, params: float, dp: int,
                         zero1: bool) -> float:
        """Adam step over a device's ``params``, sharded over ``dp`` replicas with ZeRO-1."""
        shard = dp if (zero1 and dp > 1) else 1
        return formulas.adam_step_time_s(params / shard, device_type.memory_bandwidth_bytes_per_s)

    # ---- whole plans -------------------------------------------------------------------

    def evaluate(self, plan: Plan) -> Prediction:
        """Predict iteration time, throughput and per-device memory of ``plan``."""
        return _PlanEvaluation(self, plan).prediction()

    def gradient_groups(self, plan: Plan) -> list[DpGroup]:
        """The gradient all-reduce groups :meth:`evaluate` prices (DP and tied embeddings)."""
        evaluation = _PlanEvaluation(self, plan)
        costs = [evaluation._pipeline_stage_costs(k, {}) for k in range(len(plan.pipelines))]
        return evaluation._dp_groups(costs)


@dataclass
class DpGroup:
    """Replicas of one stage's parameters that all-reduce their gradients together."""

    members: list[tuple[int, int]]  # (pipeline, stage)
    rings: list[list[Device]]  # one ring per tensor-parallel rank
    grad_bytes: float


class _PlanEvaluation:
    """One evaluation of a whole plan; split out to keep each step short."""

    def __init__(self, cost: CostModel, plan: Plan) -> None:
        self.cost = cost
        self.plan = plan
        self.devices = [
            [tuple(cost.cluster.device(d) for d in stage.devices) for stage in pipeline.stages]
            for pipeline in plan.pipelines
        ]

    def prediction(self) -> Prediction:
        pp_sharing = self._pp_nic_sharing()
        costs = [self._pipeline_stage_costs(k, pp_sharing) for k in range(len(self.devices))]
        times = [
            formulas.pipeline_time([c.work for c in costs[k]], p.num_micro_batches,
                                   self.plan.schedule.value, self.plan.virtual_stages)
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
        """Pipeline transfers leaving each machine at once (all boundaries run in steady state)."""
        sharing: dict[str, int] = defaultdict(int)
        for stages in self.devices:
            for sender, receiver in zip(stages, stages[1:], strict=False):
                for a, b in zip(sender, receiver, strict=False):
                    if a.node != b.node:
                        sharing[a.node] += 1
                        sharing[b.node] += 1
        return sharing

    def _dp_groups(self, costs: list[list[StageCost]]) -> list[DpGroup]:
        """Group each stage of the longest pipeline with the stages of the other pipelines
        that hold the most of the same layers; add the tied-embedding groups."""
        pipelines = self.plan.pipelines
        lead = max(range(len(pipelines)), key=lambda k: pipelines[k].pp)
        others = [k for k in range(len(pipelines)) if k != lead]
        groups = []
        for i, stage in enumerate(pipelines[lead].stages):
            members = [(lead, i)] + [(k, _best_overlap(pipelines[k].stages, stage)) for k in others]
            groups.append(self._group(members, costs[lead][i].params * len(self.devices[lead][i])))
        if self.cost.model.tied_embeddings:
            groups.extend(self._embedding_groups())
        return groups

    def _group(self, members: list[tuple[int, int]], full_params: float) -> DpGroup:
        tp = min(len(self.devices[k][j]) for k, j in members)
        rings = [[self.devices[k][j][r] for k, j in members] for r in range(tp)]
        element = self.cost.element_bytes(self.devices[members[0][0]][members[0][1]][0].type)
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
            per_ring_bytes = group.grad_bytes / len(group.rings)
            allreduce = max(self.cost.allreduce_s(per_ring_bytes, ring, sharing)
                            for ring in group.rings)
            ready = max(times[k].finish_s[j] for k, j in group.members)
            window = min(costs[k][j].work.backward_s for k, j in group.members)
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
        return max(
            self.cost.optimizer_step_s(self.devices[k][j][0].type, c.params, dp, self.plan.zero1)
            for k, stage_costs in enumerate(costs) for j, c in enumerate(stage_costs)
        )

    def _breakdown(self, costs: list[list[StageCost]], times: list[PipelineTime],
                   dp_s: float, optimizer_s: float) -> TimeBreakdown:
        slowest = max(range(len(times)), key=lambda k: times[k].total_s)
        t, m = times[slowest], self.plan.pipelines[slowest].num_micro_batches
        stage = costs[slowest][t.bottleneck_stage]
        compute = m * stage.compute_s
        tp = m * (stage.work.total_s - stage.compute_s)
        pp = m * (t.period_s - stage.work.total_s) + t.fill_transfer_s
        bubble = t.total_s - compute - tp - pp
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
        states = formulas.model_state_bytes(c.params, dp, self.plan.zero1)
        weights = 2.0 * c.params
        grads = 2.0 * c.params
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


def link_between(cluster: Cluster, a: str, b: str) -> Link:
    return cluster.link(cluster.device(a), cluster.device(b))


@dataclass(frozen=True)
class StageOpTimes:
    """Per-micro-batch op times of one stage, for the emulator."""

    forward_s: float
    backward_s: float


def stage_op_times(plan: Plan) -> tuple[tuple[StageOpTimes, ...], ...]:
    """Predicted forward/backward time of one micro-batch on every stage of ``plan``."""
    cost = CostModel(Cluster(plan.cluster), plan.model, plan.training.seq_len, plan.training.dtype)
    result = []
    for pipeline in plan.pipelines:
        stages = []
        pp = len(pipeline.stages)
        for i, stage in enumerate(pipeline.stages):
            devices = tuple(cost.cluster.device(d) for d in stage.devices)
            work, _ = cost.stage_work(devices, stage.num_layers, i == 0, i == pp - 1,
                                      pipeline.micro_batch_size, plan.recompute, 0.0)
            stages.append(StageOpTimes(work.forward_s, work.backward_s))
        result.append(tuple(stages))
    return tuple(result)
