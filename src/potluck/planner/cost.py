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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from potluck.cluster.catalog import DeviceType
from potluck.cluster.topology import Cluster, Device, Link
from potluck.model import counts
from potluck.model.counts import Recompute
from potluck.model.spec import ModelSpec
from potluck.planner import formulas
from potluck.planner.formulas import StageWork
from potluck.plans import (
    DType,
    Execution,
    Plan,
    Prediction,
    TrainingShape,
)

GPU_RUNTIME_OVERHEAD_BYTES = 1.0e9  # CUDA context, cuBLAS and NCCL workspaces
MEMORY_HEADROOM = 0.95  # plans leave 5% of device memory for allocator fragmentation
OPS_PER_BLOCK_FORWARD = 24  # eager kernels in one block's forward (norms, GEMMs, rotary, ...)
# FlashAttention-2 (Dao 2023): the backward pass does ~2.5x the forward FLOPs (it recomputes
# the scores); on A100 the forward reaches 73% and the backward 63% of peak where large GEMMs
# reach 87% (stas00 MAMF), i.e. 0.84 and 0.72 of GEMM throughput. Causal kernels skip the
# masked half of the scores.
FLASH_BACKWARD_FACTOR = 2.5
FLASH_FORWARD_OF_GEMM = 0.73 / 0.87
FLASH_BACKWARD_OF_GEMM = 0.63 / 0.87
CAUSAL_FRACTION = 0.5


def effective_dtype(device_type: DeviceType, requested: DType) -> DType:
    """CPU ranks train in FP32; devices without BF16 fall back to FP16."""
    if device_type.is_cpu:
        return DType.FP32
    if requested is DType.BF16 and not device_type.bf16:
        return DType.FP16
    return requested


def pipeline_nic_sharing(pipelines: Iterable[Sequence[tuple[Device, ...]]]) -> dict[str, int]:
    """Pipeline flows sharing each machine's network card in one direction.

    Every stage boundary that crosses machines carries one flow per TP lane: activations
    one way, gradients back at other times. A card is shared by the flows leaving it
    (or arriving at it, whichever are more); pipelines crossing the same card share it.
    """
    leaving: dict[str, int] = defaultdict(int)
    arriving: dict[str, int] = defaultdict(int)
    for stages in pipelines:
        for sender, receiver in zip(stages, stages[1:], strict=False):
            for a, b in zip(sender, receiver, strict=False):
                if a.node != b.node:
                    leaving[a.node] += 1
                    arriving[b.node] += 1
    return {node: max(leaving.get(node, 0), arriving.get(node, 0))
            for node in set(leaving) | set(arriving)}


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
                 dtype: DType = DType.BF16, execution: Execution = Execution()) -> None:
        self.cluster = cluster
        self.model = model
        self.seq_len = seq_len
        self.dtype = dtype
        self.execution = execution
        self.fused_kernels = execution.fused_kernels
        self.flash_attention = execution.flash_attention
        self._block_times = lru_cache(maxsize=None)(self._compute_block_times)
        self._head_times = lru_cache(maxsize=None)(self._compute_head_times)
        self._tp_cache: dict[tuple, float] = {}
        self._params_cache: dict[tuple, float] = {}

    @classmethod
    def for_training(cls, cluster: Cluster, model: ModelSpec, training: TrainingShape) -> CostModel:
        return cls(cluster, model, training.seq_len, training.dtype, training.execution)

    @classmethod
    def for_plan(cls, plan: Plan) -> CostModel:
        return cls.for_training(Cluster(plan.cluster), plan.model, plan.training)

    # ---- compute -------------------------------------------------------------------------

    def element_bytes(self, device_type: DeviceType) -> int:
        return effective_dtype(device_type, self.dtype).bytes

    def state_layout(self, device_type: DeviceType) -> formulas.StateBytes:
        """Bytes per parameter of weights, gradients and optimizer states on a device."""
        if device_type.is_cpu:
            return formulas.FP32
        if self.execution.fp32_params:
            return formulas.FP32_PARAMS_AUTOCAST
        return formulas.MIXED_PRECISION_MASTER

    def model_state_bytes(self, device_type: DeviceType, params: float, dp: int,
                          zero1: bool) -> float:
        return formulas.model_state_bytes(params, dp, zero1, self.state_layout(device_type))

    def grad_bytes(self, device_type: DeviceType) -> int:
        """Bytes per gradient element in the data-parallel all-reduce."""
        return max(self.execution.grad_reduce_bytes, self.element_bytes(device_type))

    def block_times(self, device_type: DeviceType, tp: int, micro_batch: int,
                    recompute: Recompute) -> BlockTimes:
        return self._block_times(device_type, tp, micro_batch, recompute)

    def _compute_block_times(self, device: DeviceType, tp: int, b: int,
                             recompute: Recompute) -> BlockTimes:
        m, s = self.model, self.seq_len
        gemms = self._block_gemms_s(device, tp, b)
        attention = self._attention_s(device, tp, b)
        elementwise = (counts.block_elementwise_bytes(m, b, s, self.fused_kernels) / tp
                       * self._element_scale(device))
        elementwise_s = formulas.roofline_time_s(
            0.0, elementwise, device.achievable_flops, device.memory_bandwidth_bytes_per_s
        )
        forward = gemms + attention.forward_s + elementwise_s
        backward = 2.0 * gemms + attention.backward_s + 2.0 * elementwise_s
        if recompute is Recompute.FULL:
            backward += forward
        elif recompute is Recompute.SELECTIVE and not self.flash_attention:
            backward += attention.forward_s  # flash kernels recompute the scores anyway
        dispatch = OPS_PER_BLOCK_FORWARD * formulas.KERNEL_DISPATCH_S
        forward_total = max(forward, dispatch)
        backward_total = max(backward, 2.0 * dispatch)
        return BlockTimes(forward_total, backward_total, weight_grad_s=gemms)

    def _attention_s(self, device: DeviceType, tp: int, b: int) -> BlockTimes:
        if self.flash_attention:
            forward = self._flash_attention_s(device, tp, b)
            backward = forward * FLASH_BACKWARD_FACTOR * FLASH_FORWARD_OF_GEMM / FLASH_BACKWARD_OF_GEMM
            return BlockTimes(forward, backward, 0.0)
        forward = self._materialized_attention_s(device, tp, b)
        return BlockTimes(forward, 2.0 * forward, 0.0)

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
                                    device.memory_bandwidth_bytes_per_s, self.element_bytes(device),
                                    device.sm_count)

    def _flash_attention_s(self, device: DeviceType, tp: int, b: int) -> float:
        """FlashAttention: causal scores never leave the chip; Q, K, V read, output written."""
        m, s = self.model, self.seq_len
        flops = counts.attention_core_forward_flops(m, b, s) * CAUSAL_FRACTION / tp
        traffic = (4 * s * b * m.hidden_size + 4 * s * b * m.kv_hidden_size) / tp
        traffic *= self._element_scale(device)
        return formulas.roofline_time_s(flops, traffic, device.achievable_flops * FLASH_FORWARD_OF_GEMM,
                                        device.memory_bandwidth_bytes_per_s)

    def _materialized_attention_s(self, device: DeviceType, tp: int, b: int) -> float:
        """Scores in memory (Megatron before FlashAttention, eager attention): two batched
        GEMMs over every head plus a fused scale-mask-softmax that reads and writes the
        ``b*a*s^2`` scores, and a dropout on them when the model has one (5 bytes each)."""
        m, s = self.model, self.seq_len
        heads = b * m.num_heads // tp
        scale = self._element_scale(device)
        scores = self._gemm_s(device, heads * s, m.head_dim, s)
        values = self._gemm_s(device, heads * s, s, m.head_dim)
        softmax_bytes = (4.0 + (5.0 if m.dropout else 0.0)) * heads * s * s * scale
        softmax = formulas.roofline_time_s(0.0, softmax_bytes, device.achievable_flops,
                                           device.memory_bandwidth_bytes_per_s)
        return scores + values + softmax

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
        """Parameters each device of a stage holds."""
        key = (num_layers, first, last, pp > 1, tp)
        cached = self._params_cache.get(key)
        if cached is None:
            cached = self._params_cache[key] = self._stage_params(num_layers, first, last, pp, tp)
        return cached

    def _stage_params(self, num_layers: int, first: bool, last: bool, pp: int, tp: int) -> float:
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
        per_block = counts.block_activation_bytes(m, b, s, tp, recompute, self.flash_attention)
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
            held += counts.block_activation_bytes(m, b, s, tp, Recompute.NONE,
                                                  self.flash_attention) * scale
        return held

    def overhead_bytes(self, device_type: DeviceType) -> float:
        return 0.0 if device_type.is_cpu else GPU_RUNTIME_OVERHEAD_BYTES

    def stage_memory_bytes(self, device_type: DeviceType, num_layers: int, first: bool,
                           last: bool, pp: int, tp: int, micro_batch: int, recompute: Recompute,
                           in_flight: float, dp: int, zero1: bool) -> float:
        """Peak bytes on one device of a stage: model states, activations, runtime overhead."""
        params = self.stage_params(num_layers, first, last, pp, tp)
        states = self.model_state_bytes(device_type, params, dp, zero1)
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
        from potluck.planner.evaluate import PlanEvaluation

        return PlanEvaluation(self, plan).prediction()

    def gradient_groups(self, plan: Plan) -> list:
        """The gradient all-reduce groups :meth:`evaluate` prices (DP and tied embeddings),
        as :class:`potluck.planner.evaluate.DpGroup`."""
        from potluck.planner.evaluate import gradient_groups

        return gradient_groups(self, plan)


def link_between(cluster: Cluster, a: str, b: str) -> Link:
    return cluster.link(cluster.device(a), cluster.device(b))


@dataclass(frozen=True)
class StageOpTimes:
    """Per-micro-batch op times of one stage, for the emulator."""

    forward_s: float
    backward_s: float


def stage_devices(cost: CostModel, plan: Plan) -> list[list[tuple[Device, ...]]]:
    """Per pipeline, per stage: the stage's devices."""
    return [[tuple(cost.cluster.device(d) for d in stage.devices) for stage in pipeline.stages]
            for pipeline in plan.pipelines]


def stage_send_s(plan: Plan, pipeline: int, sender: int, receiver: int,
                 cost: CostModel | None = None) -> float:
    """One micro-batch's transfer from stage ``sender`` to stage ``receiver`` of
    ``pipeline``, as the plan's evaluation charges it: pipelines whose transfers leave a
    machine share its network card (:func:`pipeline_nic_sharing`). ``cost``: the plan's
    cost model, when the caller has it."""
    cost = cost or CostModel.for_plan(plan)
    devices = stage_devices(cost, plan)
    stages = devices[pipeline]
    return cost.send_s(stages[sender], stages[receiver], plan.pipelines[pipeline].micro_batch_size,
                       pipeline_nic_sharing(devices))


def stage_op_times(plan: Plan) -> tuple[tuple[StageOpTimes, ...], ...]:
    """Predicted forward/backward time of one micro-batch on every stage of ``plan``."""
    cost = CostModel.for_plan(plan)
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
