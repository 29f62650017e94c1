"""The cost model of one pipeline stage: its time per micro-batch, its parameters, its memory.

:class:`CostModel` composes, for a stage described by a :class:`StageShape`
on its devices, the compute of its blocks and head
(:mod:`potluck.planner.compute`), the tensor-parallel collectives of each
block over the real links of the TP group and the transfer of its
activations to the next stage (:mod:`potluck.planner.network`), and its
memory at peak: weights, gradients and optimizer states (sharded per
:class:`~potluck.planner.formulas.StateSharding`), the activations of the
micro-batches in flight, the head's logits and the runtime's overhead.

Whole plans (every pipeline under its schedule, the gradient rings, the
optimizer step, the prediction) are :mod:`potluck.planner.evaluate`'s; the
search, ``potluck plan``, the simulator and the emulator all come through
one of the two. Calibration changes the inputs (device efficiency, link
bandwidth), never the shape. Formulas live in :mod:`potluck.planner.formulas`
and :mod:`potluck.model.counts`.
"""

from __future__ import annotations

from dataclasses import dataclass

from potluck.cluster.catalog import DeviceType
from potluck.cluster.topology import Cluster, Device
from potluck.model import counts
from potluck.model.counts import Recompute
from potluck.model.spec import ModelSpec
from potluck.planner import formulas
from potluck.planner.compute import BlockTimes, ComputeModel, effective_dtype
from potluck.planner.formulas import StateSharding
from potluck.planner.network import NO_SHARING, Network, NicSharing
from potluck.plans import DType, Execution, Plan, TrainingShape
from potluck.schedules import StageWork

GPU_RUNTIME_OVERHEAD_BYTES = 1.0e9  # CUDA context, cuBLAS and NCCL workspaces
MEMORY_HEADROOM = 0.95  # plans leave 5% of device memory for allocator fragmentation



def usable_memory_bytes(device_type: DeviceType) -> float:
    """Device memory a plan may fill."""
    return device_type.memory_bytes * MEMORY_HEADROOM


@dataclass(frozen=True)
class StageShape:
    """What a pipeline stage runs, as far as its time and memory on each device depend on it."""

    num_layers: int  # transformer blocks (all its chunks together)
    first: bool = False  # holds the embedding
    last: bool = False  # holds the final norm, the output projection and the loss
    pp: int = 1  # stages of its pipeline (with more than one, a tied head is a separate copy)
    micro_batch: int = 1
    recompute: Recompute = Recompute.NONE

    def with_layers(self, num_layers: int, *, first: bool | None = None,
                    last: bool | None = None) -> StageShape:
        """The same stage with another block count (a chunk, or a coefficient probe), and
        with or without the embedding and the head when ``first``/``last`` are given."""
        return StageShape(num_layers, self.first if first is None else first,
                          self.last if last is None else last, self.pp, self.micro_batch,
                          self.recompute)


@dataclass(frozen=True)
class StageTime:
    """A stage's time per micro-batch (TP communication and transfer included) and its compute."""

    work: StageWork
    compute_s: float  # forward + backward compute, without TP communication


class CostModel:
    """Time and memory of pipeline stages of one model on one cluster."""

    def __init__(self, cluster: Cluster, model: ModelSpec, seq_len: int,
                 dtype: DType = DType.BF16, execution: Execution = Execution()) -> None:
        self.cluster = cluster
        self.model = model
        self.seq_len = seq_len
        self.dtype = dtype
        self.execution = execution
        self.flash_attention = execution.flash_attention
        self.compute = ComputeModel(model, seq_len, dtype, execution)
        self.network = Network(cluster)
        self._tp_cache: dict[tuple, float] = {}
        self._params_cache: dict[tuple, float] = {}

    @classmethod
    def for_training(cls, cluster: Cluster, model: ModelSpec, training: TrainingShape) -> CostModel:
        return cls(cluster, model, training.seq_len, training.dtype, training.execution)

    @classmethod
    def for_plan(cls, plan: Plan) -> CostModel:
        return cls.for_training(Cluster(plan.cluster), plan.model, plan.training)

    # ---- dtypes and states ---------------------------------------------------------------

    def element_bytes(self, device_type: DeviceType) -> int:
        return self.compute.element_bytes(device_type)

    def grad_bytes(self, device_type: DeviceType) -> int:
        """Bytes per gradient element in the data-parallel all-reduce."""
        return max(self.execution.grad_reduce_bytes, self.element_bytes(device_type))

    def state_layout(self, device_type: DeviceType) -> formulas.StateBytes:
        """Bytes per parameter of weights, gradients and optimizer states on a device: plain
        FP32 where it computes in fp32 or tf32 (CPU ranks always), else per the execution."""
        if effective_dtype(device_type, self.dtype).is_full_precision:
            return formulas.FP32
        if self.execution.fp32_params:
            return formulas.FP32_PARAMS_AUTOCAST
        return formulas.MIXED_PRECISION_MASTER

    def model_state_bytes(self, device_type: DeviceType, params: float,
                          sharding: StateSharding) -> float:
        return formulas.model_state_bytes(params, self.state_layout(device_type), sharding)

    def optimizer_step_s(self, device_type: DeviceType, params: float,
                         sharding: StateSharding) -> float:
        """Adam step over the share of a device's ``params`` whose states it keeps, and the
        framework's host time per iteration (``execution.step_overhead_s``)."""
        return self.execution.step_overhead_s + formulas.adam_step_time_s(
            params / sharding.optimizer_shards, device_type.memory_bandwidth_bytes_per_s)

    def grad_accumulation_s(self, device_type: DeviceType, params: float) -> float:
        """One micro-batch's weight gradients of a device's ``params`` added into the
        accumulation buffer (``execution.grad_accumulation_bytes`` per parameter)."""
        return formulas.grad_accumulation_time_s(params, self.execution.grad_accumulation_bytes,
                                                 device_type.memory_bandwidth_bytes_per_s)

    def overhead_bytes(self, device_type: DeviceType) -> float:
        return 0.0 if device_type.is_cpu else GPU_RUNTIME_OVERHEAD_BYTES

    # ---- compute -------------------------------------------------------------------------

    def block_times(self, device_type: DeviceType, tp: int, micro_batch: int,
                    recompute: Recompute) -> BlockTimes:
        return self.compute.block_times(device_type, tp, micro_batch, recompute)

    def head_times(self, device_type: DeviceType, tp: int, micro_batch: int) -> BlockTimes:
        return self.compute.head_times(device_type, tp, micro_batch)

    # ---- communication -------------------------------------------------------------------

    def tp_block_comm_s(self, devices: tuple[Device, ...], micro_batch: int) -> float:
        """Forward TP traffic of one block: two all-reduce-equivalents of ``s*b*h`` (SC'21)."""
        if len(devices) <= 1:
            return 0.0
        # links inside a machine depend only on the group and the GPUs' positions
        key = (devices[0].group, tuple(d.local_index for d in devices), micro_batch)
        cached = self._tp_cache.get(key)
        if cached is None:
            num_bytes = self.send_bytes(devices[0].type, micro_batch)
            cached = self._tp_cache[key] = 2.0 * self.network.allreduce_s(num_bytes, devices)
        return cached

    def send_bytes(self, device_type: DeviceType, micro_batch: int) -> float:
        """Bytes of one micro-batch's activations (or their gradients) between two stages."""
        activation = self.seq_len * micro_batch * self.model.hidden_size
        return activation * self.element_bytes(device_type)

    def send_s(self, sender: tuple[Device, ...], receiver: tuple[Device, ...], micro_batch: int,
               sharing: NicSharing = NO_SHARING) -> float:
        """One micro-batch's activations from one stage to the next, TP ranks sending in parallel."""
        return self.network.send_s(sender, receiver, self.send_bytes(sender[0].type, micro_batch),
                                   sharing)

    # ---- stages ----------------------------------------------------------------------------

    def stage_params(self, shape: StageShape, tp: int) -> float:
        """Parameters each device of a stage holds."""
        key = (shape.num_layers, shape.first, shape.last, shape.pp > 1, tp)
        cached = self._params_cache.get(key)
        if cached is None:
            cached = self._params_cache[key] = self._stage_params(shape, tp)
        return cached

    def _stage_params(self, shape: StageShape, tp: int) -> float:
        m = self.model
        params = shape.num_layers * counts.block_params(m)
        if shape.first:
            params += counts.embedding_params(m)
        if shape.last:
            params += counts.head_params(m, separate_from_embedding=shape.pp > 1)
        return params / tp

    def stage_time(self, devices: tuple[Device, ...], shape: StageShape,
                   send_s: float = 0.0) -> StageTime:
        """Time per micro-batch of a stage on ``devices`` (its TP group), TP comms included;
        ``send_s``: its transfer to the next stage."""
        device_type, tp, b = devices[0].type, len(devices), shape.micro_batch
        block = self.block_times(device_type, tp, b, shape.recompute)
        tp_comm = self.tp_block_comm_s(devices, b)
        tp_backward = tp_comm * (2.0 if shape.recompute is Recompute.FULL else 1.0)
        n = shape.num_layers
        host = 0.5 * self.execution.micro_batch_overhead_s  # half with each pass
        forward = host + n * (block.forward_s + tp_comm)
        backward = host + n * (block.backward_s + tp_backward)
        accumulate = self.grad_accumulation_s(device_type, self.stage_params(shape, tp))
        backward += accumulate
        weight_grad = n * block.weight_grad_s + accumulate
        compute = n * (block.forward_s + block.backward_s) + accumulate
        if shape.last:
            head = self.head_times(device_type, tp, b)
            forward += head.forward_s
            backward += head.backward_s
            weight_grad += head.weight_grad_s
            compute += head.forward_s + head.backward_s
        return StageTime(StageWork(forward, backward, weight_grad, send_s), compute)

    def activation_bytes_per_micro_batch(self, device_type: DeviceType, tp: int,
                                         shape: StageShape) -> float:
        """Activations one micro-batch leaves on each device of the stage for its backward."""
        m, s, b = self.model, self.seq_len, shape.micro_batch
        per_block = counts.block_activation_bytes(m, b, s, tp, shape.recompute,
                                                 flash_attention=self.flash_attention)
        total = shape.num_layers * per_block
        if shape.first:
            total += counts.embedding_activation_bytes(m, b, s, tp)
        return total * self.compute.element_scale(device_type)

    def stage_peak_activation_bytes(self, device_type: DeviceType, tp: int, shape: StageShape,
                                    in_flight: float) -> float:
        """Activations of the micro-batches in flight, the head's logits and, with full
        recomputation, one block's full activations while it is recomputed."""
        m, s, b = self.model, self.seq_len, shape.micro_batch
        scale = self.compute.element_scale(device_type)
        held = in_flight * self.activation_bytes_per_micro_batch(device_type, tp, shape)
        if shape.last:
            held += counts.head_activation_bytes(m, b, s, tp) * scale
        if shape.recompute is Recompute.FULL and shape.num_layers:
            held += counts.block_activation_bytes(m, b, s, tp, Recompute.NONE,
                                                  flash_attention=self.flash_attention) * scale
        return held

    def stage_memory_bytes(self, device_type: DeviceType, tp: int, shape: StageShape,
                           in_flight: float, sharding: StateSharding) -> float:
        """Peak bytes on one device of a stage: model states, activations, runtime overhead."""
        params = self.stage_params(shape, tp)
        states = self.model_state_bytes(device_type, params, sharding)
        activations = self.stage_peak_activation_bytes(device_type, tp, shape, in_flight)
        return states + activations + self.overhead_bytes(device_type)
