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

A stage's memory choices (its :class:`~potluck.plans.memory.StageMemory`) enter here:

- **recomputation of some blocks** (Korthikanti et al. 2022): the stage's first
  ``recompute_blocks`` blocks keep what their mode keeps and pay its backward, the
  rest keep everything;
- **activation swapping** (Mbapp; BPipe's activation balancing): the first
  ``swapped_blocks`` blocks' saved activations leave the device after each
  micro-batch's forward and come back before its backward, so a stage with
  ``in_flight`` micro-batches holds ``(in_flight - 1) * kept + all`` per the memory
  contract; the stash sits in host memory or on ``swap_peer``. Each byte crosses the
  link once per pass: out during the forward, back during the backward, over the
  device's host link (:meth:`~potluck.cluster.topology.Cluster.host_bandwidth_bytes_per_s`)
  or the device-to-peer link; a hybrid swap splits its bytes over both links at once.
  The transfer streams under the pass's compute and only what does not fit under it is
  exposed. Contention: where the swap's link also carries the stage's TP collectives or
  its PP send (a PCIe lane shared with host traffic and non-NVLink hops, or the very
  NVLink bridge to the peer), that critical-path traffic goes first and the swap fills
  only the compute time; otherwise it also streams while the collectives and sends run;
- **ZeRO-2/3 and optimizer offload**: states divided over the replicas, the full-size
  working set of one or two blocks, the optimizer's share in host memory
  (:func:`~potluck.planner.formulas.model_state_bytes`), ZeRO-3's all-gather of the
  stage's weights in every pass, prefetched one block ahead (FSDP1 and FSDP2), sharing the
  ring with the blocks' reduce-scatters in the backward, and every micro-batch's gradients
  summed into the shard (:func:`~potluck.planner.formulas.zero3_grad_accumulation_bytes`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from potluck.cluster.catalog import DeviceType
from potluck.cluster.nodes import PathKind
from potluck.cluster.topology import Cluster, Device
from potluck.errors import ConfigError
from potluck.model import counts
from potluck.model.counts import Recompute
from potluck.model.spec import ModelSpec
from potluck.planner import formulas
from potluck.planner.compute import BlockTimes, ComputeModel, PartTimes
from potluck.planner.formulas import NOT_SHARDED, StateSharding
from potluck.planner.gemm import effective_dtype
from potluck.planner.network import NO_SHARING, Network, NicSharing
from potluck.plans import DType, Execution, Plan, TrainingShape, runs_explicit_tp
from potluck.plans.memory import Swap
from potluck.schedules import StageWork

T = TypeVar("T")
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
    recompute: Recompute = Recompute.NONE  # the mode of its recomputing blocks
    recompute_blocks: int | None = None  # its first ones recompute (None: all)
    swap: Swap = Swap.NONE
    swapped_blocks: int = 0  # its first ones swap their saved activations
    host_share: float = 0.5  # a hybrid swap's share of bytes straight to host memory
    swap_peer: str | None = None  # the device holding a peer (or hybrid) swap
    offload: bool = False  # optimizer states and step in host memory
    tp_overlap_chunks: int = 1  # sub-batches whose TP all-reduces overlap (explicit executor)
    keeps_comm: bool = False  # recomputation keeps its collectives' results (explicit executor)
    ep: int = 1  # its routed experts split over this many replicas' stages
    expert_peers: tuple[str, ...] = ()  # those stages' devices (itself included): the exchange
    # whether its whole stage recomputes a block, where this shape is a part of the stage
    # (:meth:`with_layers`: a chunk, a coefficient probe); None: the shape is the whole stage
    stage_recomputes: bool | None = None
    # ZeRO-3: the replicas its weights are sharded over (a divisor: formulas.StateSharding);
    # each micro-batch's gradients are reduce-scattered and summed into a 1/shards shard
    parameter_shards: float = 1.0

    def explicit_tp(self, tp: int) -> bool:
        """Whether the stage runs the explicit TP executor on ``tp`` devices: the plans' rule
        (:func:`potluck.plans.runs_explicit_tp`), decided for the whole stage."""
        return runs_explicit_tp(tp, self.tp_overlap_chunks, self.keeps_comm, self.recomputes)

    @property
    def recomputes(self) -> bool:
        """Whether any block of the stage this shape is (or is a part of) recomputes."""
        if self.stage_recomputes is not None:
            return self.stage_recomputes
        return self.recompute is not Recompute.NONE and self.recompute_blocks != 0

    def with_layers(self, num_layers: int, *, first: bool | None = None,
                    last: bool | None = None, offset: int = 0) -> StageShape:
        """The same stage with another block count (a chunk starting ``offset`` blocks into
        the stage, or a coefficient probe), and with or without the embedding and the head
        when ``first``/``last`` are given; recomputed and swapped blocks are the chunk's
        share of the stage's first ones."""
        return replace(self, num_layers=num_layers, stage_recomputes=self.recomputes,
                       first=self.first if first is None else first,
                       last=self.last if last is None else last,
                       recompute_blocks=None if self.recompute_blocks is None else
                       _share(self.recompute_blocks, offset, num_layers),
                       swapped_blocks=_share(self.swapped_blocks, offset, num_layers))

    @property
    def recomputed(self) -> int:
        """Blocks that recompute (``recompute``), the first ones."""
        if self.recompute is Recompute.NONE:
            return 0
        if self.recompute_blocks is None:
            return self.num_layers
        return min(self.num_layers, self.recompute_blocks)

    @property
    def swapped(self) -> int:
        return 0 if self.swap is Swap.NONE else min(self.num_layers, self.swapped_blocks)

    @property
    def full_blocks(self) -> int:
        """Blocks under full recomputation."""
        return self.recomputed if self.recompute is Recompute.FULL else 0


def _share(first_blocks: int, offset: int, num_layers: int) -> int:
    """How many of a chunk's ``num_layers`` blocks, ``offset`` blocks into its stage, are
    among the stage's ``first_blocks``."""
    return max(0, min(num_layers, first_blocks - offset))


@dataclass(frozen=True)
class SwapBytes:
    """A stage device's swap at its peak, in bytes: what leaves per micro-batch, and the
    stash of the in-flight micro-batches held in host memory and on the peer."""

    per_micro_batch: float = 0.0
    host: float = 0.0
    peer: float = 0.0


@dataclass(frozen=True)
class StageTime:
    """A stage's time per micro-batch (TP communication and transfer included) and its compute."""

    work: StageWork
    compute_s: float  # forward + backward compute, without TP communication
    forward_tp_s: float = 0.0  # the TP communication on the forward's critical path
    backward_tp_s: float = 0.0
    exchange_s: float = 0.0  # of the TP figures: expert parallelism's all-to-alls, both passes


@dataclass(frozen=True)
class _Passes:
    """A stage's blocks for one micro-batch: compute of each pass (weight-gradient
    accumulation included in the backward), the TP communication on its critical path,
    the deferrable weight gradients and all compute."""

    forward_compute: float
    backward_compute: float
    forward_tp: float
    backward_tp: float
    weight_grad: float
    compute: float


@dataclass(frozen=True)
class ExplicitTP:
    """An explicit TP stage's pieces for one micro-batch: per block (in layer order) its
    parts' times for one sub-batch, the sub-batches, one sub-batch's all-reduce after each
    part, and one all-gather (or reduce-scatter) of the whole micro-batch at the stage's
    boundary."""

    blocks: tuple[PartTimes, ...]
    chunks: int
    allreduce_s: float
    boundary_s: float

    def forward_parts(self) -> list[float]:
        return [t for p in self.blocks for t in (p.attention.forward_s, p.mlp.forward_s)]

    def backward_parts(self) -> list[float]:
        return [t for p in reversed(self.blocks) for t in (p.mlp.backward_s, p.attention.backward_s)]

    def forward_s(self) -> float:
        """The boundary's all-gather, then the chain of parts (:func:`overlapped_chain_s`)."""
        parts = self.forward_parts()
        return self.boundary_s + formulas.overlapped_chain_s(
            parts, [self.allreduce_s] * len(parts), self.chunks)

    def backward_s(self) -> float:
        """The output slice's all-gather, then the chain in reverse (the input's gradient is
        the same on every rank: the entry only slices it)."""
        parts = self.backward_parts()
        return self.boundary_s + formulas.overlapped_chain_s(
            parts, [self.allreduce_s] * len(parts), self.chunks)


class CostModel:
    """Time and memory of pipeline stages of one model on one cluster."""

    def __init__(self, cluster: Cluster, model: ModelSpec, seq_len: int,
                 dtype: DType = DType.BF16, execution: Execution = Execution()) -> None:
        self.cluster = cluster
        self.model = model
        self.seq_len = seq_len
        self.dtype = dtype
        self.execution = execution
        self.flash_attention = execution.flash_attention and model.sdpa
        self.compute = ComputeModel(model, seq_len, dtype, execution)
        self.network = Network(cluster)
        self._tp_cache: dict[tuple, float] = {}
        self._params_cache: dict[tuple, float] = {}
        self._block_bytes_cache: dict[tuple, float] = {}
        # a search asks for the same stage many times (every memory level, every refinement)
        self._stage_time_cache: dict[tuple, StageTime] = {}
        self._stage_memory_cache: dict[tuple, float] = {}
        self._derived: dict[tuple, Any] = {}

    def remembered(self, key: tuple, compute: Callable[[], T]) -> T:
        """``compute()``, once per ``key``: for what callers derive from this cost model alone
        (the refinements of a candidate plan, which a search builds again at several
        levels); ``key`` holds every other input."""
        if key not in self._derived:
            self._derived[key] = compute()
        return self._derived[key]

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

    def state_layout(self, device_type: DeviceType,
                     sharding: StateSharding = NOT_SHARDED) -> formulas.StateBytes:
        """Bytes per parameter of weights, gradients and optimizer states on a device: plain
        FP32 where it computes in fp32 or tf32 (CPU ranks always); FP32 weights sharded by
        ZeRO-3 and gathered in 16 bits (FSDP2's mixed precision; 16 bytes over ``d`` as
        16-bit shards with FP32 masters); FP32 weights under autocast where the execution
        keeps them; else 16-bit weights with FP32 masters (on the host when the optimizer
        is offloaded: ZeRO-Offload, Ren et al. ATC'21, Sec. 4.1), their gradients summed in
        FP32 or in 16 bits as the execution says."""
        if effective_dtype(device_type, self.dtype).is_full_precision:
            return formulas.FP32
        if sharding.parameter_shards > 1 and not sharding.offload:
            return formulas.FSDP_MIXED_PRECISION
        if self.execution.fp32_params and not sharding.offload:
            return formulas.FP32_PARAMS_AUTOCAST
        if self.execution.fp32_main_grads:
            return formulas.MAIN_GRAD_MASTER
        return formulas.MIXED_PRECISION_MASTER

    def model_state_bytes(self, device_type: DeviceType, params: float,
                          sharding: StateSharding) -> float:
        return formulas.model_state_bytes(params, self.state_layout(device_type, sharding),
                                          sharding)

    def optimizer_step_s(self, device_type: DeviceType, params: float,
                         sharding: StateSharding) -> float:
        """Adam step over the share of a device's ``params`` whose states it keeps, and the
        framework's host time per iteration (``execution.step_overhead_s``)."""
        return self.execution.step_overhead_s + formulas.adam_step_time_s(
            params / sharding.optimizer_shards, device_type.memory_bandwidth_bytes_per_s)

    def grad_accumulation_s(self, device_type: DeviceType, params: float,
                            parameter_shards: float = 1.0) -> float:
        """One micro-batch's weight gradients of a device's ``params`` added into the
        accumulation buffer (``execution.grad_accumulation_bytes`` per parameter); under ZeRO-3
        (``parameter_shards`` > 1) cast to the reduce dtype and summed into the shard
        (:func:`formulas.zero3_grad_accumulation_bytes`)."""
        per_param = self.execution.grad_accumulation_bytes
        if parameter_shards > 1:
            per_param = formulas.zero3_grad_accumulation_bytes(
                self.element_bytes(device_type), self.grad_bytes(device_type), parameter_shards)
        return formulas.grad_accumulation_time_s(params, per_param,
                                                 device_type.memory_bandwidth_bytes_per_s)

    def overhead_bytes(self, device_type: DeviceType) -> float:
        return 0.0 if device_type.is_cpu else GPU_RUNTIME_OVERHEAD_BYTES

    # ---- compute -------------------------------------------------------------------------

    def block_times(self, device_type: DeviceType, tp: int, micro_batch: int,
                    recompute: Recompute, ep: int = 1) -> BlockTimes:
        return self.compute.block_times(device_type, tp, micro_batch, recompute, ep)

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

    def expert_exchange_s(self, shape: StageShape) -> float:
        """One all-to-all of a block's routed tokens over the stage's expert group (the
        dispatch; the return is the same again): each token's ``experts_per_token`` copies of
        its hidden state, ``1/ep`` of them staying on the device (uniform routing)."""
        if shape.ep <= 1 or len(shape.expert_peers) <= 1:
            return 0.0
        key = ("exchange", shape.expert_peers, shape.micro_batch)
        cached = self._tp_cache.get(key)
        if cached is None:
            members = [self.cluster.device(d) for d in shape.expert_peers]
            rows = self.seq_len * shape.micro_batch * self.model.experts_per_token
            num_bytes = rows * self.model.hidden_size * self.element_bytes(members[0].type)
            cached = self._tp_cache[key] = self.network.alltoall_s(num_bytes, members)
        return cached

    def send_bytes(self, device_type: DeviceType, micro_batch: int) -> float:
        """Bytes of one micro-batch's activations (or their gradients) between two stages."""
        activation = self.seq_len * micro_batch * self.model.hidden_size
        return activation * self.element_bytes(device_type)

    def send_s(self, sender: tuple[Device, ...], receiver: tuple[Device, ...], micro_batch: int,
               sharing: NicSharing = NO_SHARING, host_staged: bool = False) -> float:
        """One micro-batch's activations from one stage to the next, TP ranks sending in
        parallel; ``host_staged``: the pipeline spans vendors (:meth:`Network.send_s`)."""
        return self.network.send_s(sender, receiver, self.send_bytes(sender[0].type, micro_batch),
                                   sharing, host_staged)

    # ---- stages ----------------------------------------------------------------------------

    def stage_params(self, shape: StageShape, tp: int) -> float:
        """Parameters each device of a stage holds."""
        key = (shape.num_layers, shape.first, shape.last, shape.pp > 1, tp, shape.ep)
        cached = self._params_cache.get(key)
        if cached is None:
            cached = self._params_cache[key] = self._stage_params(shape, tp)
        return cached

    def _stage_params(self, shape: StageShape, tp: int) -> float:
        m = self.model
        block = counts.block_params(m) - counts.routed_expert_params(m) * (1 - 1 / shape.ep)
        params = shape.num_layers * block
        if shape.first:
            params += counts.embedding_params(m)
        if shape.last:
            params += counts.head_params(m, separate_from_embedding=shape.pp > 1)
        return params / tp

    def stage_time(self, devices: tuple[Device, ...], shape: StageShape,
                   send_s: float = 0.0, neighbours: tuple[Device, ...] = (),
                   gather_s: float = 0.0) -> StageTime:
        """Time per micro-batch of a stage on ``devices`` (its TP group), TP comms included;
        ``send_s``: its transfer to the next stage; ``neighbours``: the adjacent stages'
        devices (whose transfers may share a swap's link); ``gather_s``: one ZeRO-3
        all-gather of the stage's weights over its replicas, once per pass (cached: the
        search asks again for the same stages)."""
        key = (tuple(devices), shape, send_s, tuple(neighbours), gather_s)
        cached = self._stage_time_cache.get(key)
        if cached is None:
            cached = self._stage_time_cache[key] = self._stage_time(*key)
        return cached

    def _stage_time(self, devices: tuple[Device, ...], shape: StageShape, send_s: float,
                    neighbours: tuple[Device, ...], gather_s: float) -> StageTime:
        device_type, tp, b = devices[0].type, len(devices), shape.micro_batch
        n = shape.num_layers
        passes = (self._explicit_passes(devices, shape) if shape.explicit_tp(tp)
                  else self._plain_passes(devices, shape))
        host = 0.5 * self.execution.micro_batch_overhead_s  # half with each pass
        forward_compute, backward_compute = passes.forward_compute, passes.backward_compute
        weight_grad, compute = passes.weight_grad, passes.compute
        if shape.last:
            head = self.head_times(device_type, tp, b)
            forward_compute += head.forward_s
            backward_compute += head.backward_s
            weight_grad += head.weight_grad_s
            compute += head.forward_s + head.backward_s
        forward_compute += _exposed_gather_s(gather_s, n, forward_compute)
        backward_compute += _exposed_gather_s(self.zero3_backward_comm_s(device_type, gather_s),
                                              n, backward_compute)
        exchange_s = 2.0 * self.expert_exchange_s(shape)  # dispatch and return, per block
        forward_tp = passes.forward_tp + n * exchange_s
        backward_tp = passes.backward_tp + (n + shape.full_blocks) * exchange_s
        swap_s = self.swap_transfer_s(devices[0], tp, shape)
        shared = self._swap_shares_link(devices, shape, neighbours)
        forward_window = forward_compute + (0.0 if shared else forward_tp + send_s)
        backward_window = backward_compute + (0.0 if shared else backward_tp)
        if not self.execution.overlap_swap:  # copies on the compute stream: nothing hides them
            forward_window = backward_window = 0.0
        forward = host + forward_compute + forward_tp + max(0.0, swap_s - forward_window)
        backward = host + backward_compute + backward_tp + max(0.0, swap_s - backward_window)
        exchanges = (2 * n + shape.full_blocks) * exchange_s
        return StageTime(StageWork(forward, backward, weight_grad, send_s), compute,
                         forward_tp, backward_tp, exchanges)

    def zero3_backward_comm_s(self, device_type: DeviceType, gather_s: float) -> float:
        """ZeRO-3's communication in one backward pass: each block's weights gathered again
        and, when the reduction overlaps the backward, its gradients reduce-scattered on the
        same ring (FSDP issues both per unit; the collectives of one process group run one
        after the other), ``grad_bytes`` per element where the gather moves 16-bit weights."""
        if gather_s <= 0.0 or not self.execution.overlap_grad_reduce:
            return gather_s
        return gather_s * (1.0 + self.grad_bytes(device_type) / self.element_bytes(device_type))

    def _plain_passes(self, devices: tuple[Device, ...], shape: StageShape) -> _Passes:
        """DTensor's sequence-parallel blocks: each block's collectives between its GEMMs,
        nothing overlapped; full recomputation repeats the forward's collectives."""
        device_type, tp, b = devices[0].type, len(devices), shape.micro_batch
        n, r = shape.num_layers, shape.recomputed
        block = self.block_times(device_type, tp, b, shape.recompute, shape.ep)
        plain = self.block_times(device_type, tp, b, Recompute.NONE, shape.ep) if r < n else block
        tp_comm = self.tp_block_comm_s(devices, b)
        accumulate = self.grad_accumulation_s(device_type, self.stage_params(shape, tp),
                                              shape.parameter_shards)
        forward = r * block.forward_s + (n - r) * plain.forward_s
        backward = r * block.backward_s + (n - r) * plain.backward_s + accumulate
        weight_grad = r * block.weight_grad_s + (n - r) * plain.weight_grad_s + accumulate
        return _Passes(forward, backward, n * tp_comm, tp_comm * (n + shape.full_blocks),
                       weight_grad, forward + backward)

    def explicit_tp_times(self, devices: tuple[Device, ...], shape: StageShape) -> ExplicitTP:
        """What potluck's explicit TP executor runs for one micro-batch of the stage: each
        block's parts for one sub-batch, one sub-batch's all-reduce and the boundary's
        all-gather (the emulator pads each piece to these)."""
        device_type, tp = devices[0].type, len(devices)
        c, n, r = shape.tp_overlap_chunks, shape.num_layers, shape.recomputed
        sub_batch = shape.micro_batch // c
        recomputing = self.compute.part_times(device_type, tp, sub_batch, shape.recompute)
        plain = self.compute.part_times(device_type, tp, sub_batch, Recompute.NONE)
        allreduce = self.network.allreduce_s(self.send_bytes(device_type, sub_batch), devices)
        gather = self.network.reduce_scatter_s(self.send_bytes(device_type, shape.micro_batch),
                                               devices)
        return ExplicitTP(tuple([recomputing] * r + [plain] * (n - r)), c, allreduce, gather)

    def _explicit_passes(self, devices: tuple[Device, ...], shape: StageShape) -> _Passes:
        """potluck's explicit TP executor (Oases): the stage gathers its input whole, then
        runs ``c`` sub-batches side by side through the blocks' parts, each part's all-reduce
        overlapping the other sub-batches' compute (:func:`formulas.overlapped_chain_s`),
        recomputing per part without communicating, and keeps its own sequence slice at the
        end (the backward: the slice's all-gather, then the chain in reverse). Each sub-batch
        adds its weight gradients into the accumulation buffer of the blocks' parameters."""
        device_type, tp = devices[0].type, len(devices)
        times = self.explicit_tp_times(devices, shape)
        c, blocks = times.chunks, times.blocks
        forward_parts, backward_parts = times.forward_parts(), times.backward_parts()
        block_params = shape.num_layers * counts.block_params(self.model) / tp
        accumulate = (self.grad_accumulation_s(device_type, self.stage_params(shape, tp),
                                               shape.parameter_shards)
                      + (c - 1) * self.grad_accumulation_s(device_type, block_params,
                                                           shape.parameter_shards))
        forward, backward = c * sum(forward_parts), c * sum(backward_parts) + accumulate
        weight_grad = c * sum(p.attention.weight_grad_s + p.mlp.weight_grad_s for p in blocks)
        return _Passes(forward, backward, times.forward_s() - forward,
                       times.backward_s() - c * sum(backward_parts),
                       weight_grad + accumulate, forward + backward)

    # ---- swapping ------------------------------------------------------------------------

    def swap_transfer_s(self, device: Device, tp: int, shape: StageShape) -> float:
        """One pass's swap transfer of one micro-batch on ``device`` (out after the forward,
        the same back before the backward): the host share over the device's host link, the
        peer share over its link to ``swap_peer``, both at once for a hybrid swap."""
        moved = self.swapped_bytes_per_micro_batch(device.type, tp, shape)
        if moved <= 0.0:
            return 0.0
        host_bytes, peer_bytes = _split(moved, shape)
        host_s = host_bytes / self.cluster.host_bandwidth_bytes_per_s(device) if host_bytes else 0.0
        peer_s = 0.0
        if peer_bytes:
            link = self.cluster.link(device, self._peer(shape))
            peer_s = link.latency_s + peer_bytes / link.bandwidth_bytes_per_s
        return max(host_s, peer_s)

    def _peer(self, shape: StageShape) -> Device:
        if shape.swap_peer is None:
            raise ConfigError(f"a {shape.swap.value} swap names no swap_peer; set one or make the "
                              "plan again with potluck plan")
        return self.cluster.device(shape.swap_peer)

    def _swap_shares_link(self, devices: tuple[Device, ...], shape: StageShape,
                          neighbours: tuple[Device, ...]) -> bool:
        """Whether the swap's link also carries the stage's TP or PP traffic: the GPU's PCIe
        lane (host traffic, PCIe and network hops) or the NVLink bridge to the peer."""
        if not shape.swapped:
            return False
        device = devices[0]
        hops = [self.cluster.link(device, other) for other in (*devices[1:], *neighbours)]
        over_pcie = any(h.kind not in (PathKind.NVLINK, PathKind.LOCAL) for h in hops)
        if shape.swap.uses_host and over_pcie:
            return True
        if not shape.swap.uses_peer:
            return False
        peer = self._peer(shape)
        if self.cluster.link(device, peer).kind is PathKind.NVLINK:
            return any(other.id == peer.id for other in (*devices[1:], *neighbours))
        return over_pcie

    def swapped_bytes_per_micro_batch(self, device_type: DeviceType, tp: int,
                                      shape: StageShape) -> float:
        """Saved activations of the stage's swapped blocks, one micro-batch, one device."""
        s_blocks = shape.swapped
        if not s_blocks:
            return 0.0
        both = min(s_blocks, shape.recomputed)
        sp = not shape.explicit_tp(tp)
        return (both * self._block_bytes(tp, shape.micro_batch, shape.recompute, sp)
                + (s_blocks - both) * self._block_bytes(tp, shape.micro_batch, Recompute.NONE, sp)
                ) * self.compute.element_scale(device_type)

    def swap_bytes(self, device_type: DeviceType, tp: int, shape: StageShape,
                   in_flight: float) -> SwapBytes:
        """What one device of the stage swaps: per micro-batch, and the stash in host memory
        and on the peer at its peak, every in-flight micro-batch's (when the last warm-up
        forward has swapped out and the first backward has not yet fetched its own back)."""
        moved = self.swapped_bytes_per_micro_batch(device_type, tp, shape)
        stash = in_flight * moved
        host_bytes, peer_bytes = _split(stash, shape)
        return SwapBytes(moved, host_bytes, peer_bytes)

    def _block_bytes(self, tp: int, micro_batch: int, recompute: Recompute,
                     sequence_parallel: bool = True) -> float:
        """One block's saved activations (cached: the search asks very often); without
        sequence parallelism for the explicit TP executor."""
        key = (tp, micro_batch, recompute, sequence_parallel)
        cached = self._block_bytes_cache.get(key)
        if cached is None:
            cached = self._block_bytes_cache[key] = counts.block_activation_bytes(
                self.model, micro_batch, self.seq_len, tp, recompute,
                flash_attention=self.flash_attention, fused=self.execution.fused_kernels,
                sequence_parallel=sequence_parallel)
        return cached

    def activation_bytes_per_micro_batch(self, device_type: DeviceType, tp: int,
                                         shape: StageShape) -> float:
        """Activations one micro-batch leaves on each device of the stage for its backward
        (swapped ones included: they are on the device until the forward pass ends)."""
        m, s, b = self.model, self.seq_len, shape.micro_batch
        r, sp = shape.recomputed, not shape.explicit_tp(tp)
        total = (r * self._block_bytes(tp, b, shape.recompute, sp)
                 + (shape.num_layers - r) * self._block_bytes(tp, b, Recompute.NONE, sp))
        if shape.first:
            total += counts.embedding_activation_bytes(m, b, s, tp,
                                                       fused=self.execution.fused_kernels)
        return total * self.compute.element_scale(device_type)

    def stage_peak_activation_bytes(self, device_type: DeviceType, tp: int, shape: StageShape,
                                    in_flight: float) -> float:
        """Activations of the micro-batches in flight (with swapping, the kept bytes of all
        but one and all bytes of one: the memory contract), the head's logits and, with full
        recomputation, one block's full activations while it is recomputed."""
        m, s, b = self.model, self.seq_len, shape.micro_batch
        scale = self.compute.element_scale(device_type)
        every = self.activation_bytes_per_micro_batch(device_type, tp, shape)
        moved = self.swapped_bytes_per_micro_batch(device_type, tp, shape)
        held = in_flight * every - max(0.0, in_flight - 1.0) * moved
        fused = self.execution.fused_kernels
        head = counts.head_activation_bytes(m, b, s, tp, fused=fused) * scale if shape.last else 0.0
        block = 0.0
        if shape.full_blocks:  # the executor recomputes one sub-batch's part at a time
            explicit = shape.explicit_tp(tp)
            block = (self._block_bytes(tp, b, Recompute.NONE, not explicit) * scale
                     / (shape.tp_overlap_chunks if explicit else 1))
        if head and block:  # the head's backward has freed all but the logits when blocks recompute
            logits = counts.head_logits_bytes(m, b, s, tp) * scale
            return held + logits + max(head - logits, block)
        return held + head + block

    def stage_sharding(self, shape: StageShape, sharding: StateSharding) -> StateSharding:
        """The plan's sharding, with the optimizer offloaded where the stage offloads it."""
        if not shape.offload or sharding.offload:
            return sharding
        return replace(sharding, offload=shape.offload)

    def zero_working_bytes(self, device_type: DeviceType, tp: int, shape: StageShape,
                           sharding: StateSharding) -> float:
        """ZeRO-2/3's full-size working set (formulas.zero_working_bytes): one or two units,
        a block and the larger of a block and the stage's embedding or head unit (TP shards
        each); under ZeRO-3 with a root unit (``execution.zero3_root_unit``) two blocks and
        the embedding and head of a first or last stage, gathered with their full-size
        gradient for the whole step (formulas.root_unit_bytes)."""
        if not shape.num_layers or (sharding.gradient_shards <= 1 and sharding.parameter_shards <= 1):
            return 0.0
        layout = self.state_layout(device_type, sharding)
        block_params = counts.block_params(self.model) / tp
        if sharding.parameter_shards > 1 and self.execution.zero3_root_unit:
            root = self.stage_params(shape, tp) - shape.num_layers * block_params
            return (formulas.zero_working_bytes(block_params, layout, sharding)
                    + formulas.root_unit_bytes(root, layout))
        edge = max(counts.embedding_params(self.model) if shape.first else 0,
                   counts.head_params(self.model, shape.pp > 1) if shape.last else 0)
        return formulas.zero_working_bytes(block_params, layout, sharding, edge / tp)

    def host_bytes(self, device_type: DeviceType, tp: int, shape: StageShape,
                   sharding: StateSharding) -> float:
        """Host bytes of one device's offloaded optimizer (its swap stash: :meth:`swap_bytes`)."""
        return formulas.host_state_bytes(self.stage_params(shape, tp),
                                         self.stage_sharding(shape, sharding))

    def stage_memory_bytes(self, device_type: DeviceType, tp: int, shape: StageShape,
                           in_flight: float, sharding: StateSharding) -> float:
        """Peak bytes on one device of a stage: model states, activations, runtime overhead
        (cached as :meth:`stage_time`)."""
        key = (device_type, tp, shape, in_flight, sharding)
        cached = self._stage_memory_cache.get(key)
        if cached is None:
            cached = self._stage_memory_cache[key] = self._stage_memory_bytes(*key)
        return cached

    def _stage_memory_bytes(self, device_type: DeviceType, tp: int, shape: StageShape,
                            in_flight: float, sharding: StateSharding) -> float:
        params = self.stage_params(shape, tp)
        own = self.stage_sharding(shape, sharding)
        states = self.model_state_bytes(device_type, params, own)
        working = self.zero_working_bytes(device_type, tp, shape, own)
        activations = self.stage_peak_activation_bytes(device_type, tp, shape, in_flight)
        return states + working + activations + self.overhead_bytes(device_type)

    def offloaded_step_s(self, device: Device, params: float, sharding: StateSharding,
                         params_on_host: float) -> float:
        """ZeRO-Offload's step of a device's share of ``params``: gradients to the host, Adam
        over ``params_on_host`` (every offloading rank of its machine at once) in host memory,
        parameters back (formulas.offloaded_step_time_s)."""
        share = params / sharding.optimizer_shards
        return self.execution.step_overhead_s + formulas.offloaded_step_time_s(
            share, self.grad_bytes(device.type), self.element_bytes(device.type),
            self.cluster.host_bandwidth_bytes_per_s(device), params_on_host,
            self.cluster.host_memory_bandwidth_bytes_per_s(device.node))


def _split(num_bytes: float, shape: StageShape) -> tuple[float, float]:
    """``num_bytes`` of a swap as (to host memory, to the peer)."""
    if shape.swap is Swap.HOST:
        return num_bytes, 0.0
    if shape.swap is Swap.PEER:
        return 0.0, num_bytes
    if shape.swap is Swap.HYBRID:
        return num_bytes * shape.host_share, num_bytes * (1.0 - shape.host_share)
    return 0.0, 0.0


def _exposed_gather_s(gather_s: float, num_layers: int, compute_s: float) -> float:
    """ZeRO-3's all-gather of ``num_layers`` blocks' weights in one pass, each block's
    prefetched under the previous block's compute (FSDP2): the first block's gather is
    exposed, and whatever of the rest the other blocks' compute does not cover."""
    if gather_s <= 0.0 or num_layers <= 0:
        return 0.0
    per_block = gather_s / num_layers
    return max(per_block, gather_s - compute_s * (num_layers - 1) / num_layers)
