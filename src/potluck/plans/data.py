"""The plan's data: frozen, versioned dataclasses (pydantic reads and writes them).

A plan says which devices form which pipeline (one per data-parallel replica), which
tensor-parallel group runs which layers in each stage, how the global batch is split
between replicas, the micro-batch size and count, the schedule, the recomputation and
each stage's memory choices (:mod:`potluck.plans.memory`), the islands that synchronize
rarely (:mod:`potluck.plans.islands`), and carries the cluster, the
model and the training shape it was made for. What makes a plan runnable is
:mod:`potluck.plans.feasibility`; reading and writing plan files, :mod:`potluck.plans.files`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Annotated, Any

from pydantic import Field, NonNegativeInt, PositiveInt

from potluck.cluster.execution import Execution
from potluck.cluster.execution import Placement as Placement  # re-exported: plans name it
from potluck.cluster.execution import TiedGradSync as TiedGradSync  # re-exported
from potluck.cluster.spec import ClusterSpec
from potluck.model.counts import Recompute
from potluck.model.spec import ModelSpec
from potluck.plans.islands import ONE_ISLAND, Islands
from potluck.plans.memory import KEEP_ALL, StageMemory
from potluck.schedules import Schedule

PLAN_VERSION = 1
ZeroStage = Annotated[int, Field(ge=0, le=3)]


class DType(str, Enum):
    """What training computes in: 16-bit autocast (bf16, fp16) or FP32 storage, whose
    matmuls run on the ordinary FP32 cores (fp32) or on TF32 tensor cores (tf32)."""

    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"
    TF32 = "tf32"  # FP32 weights, gradients and activations; TF32 tensor-core matmuls

    @property
    def bytes(self) -> int:
        """Bytes per activation element (TF32 is an FP32 tensor: only matmuls round)."""
        return 4 if self.is_full_precision else 2

    @property
    def is_full_precision(self) -> bool:
        """FP32 storage and no autocast (fp32, tf32)."""
        return self in (DType.FP32, DType.TF32)


@dataclass(frozen=True)
class TrainingShape:
    """What one iteration trains on, and how the step executes."""

    global_batch: PositiveInt  # sequences per iteration, all replicas together
    seq_len: PositiveInt
    dtype: DType = DType.BF16
    execution: Execution = Execution()


@dataclass(frozen=True)
class StageComm:
    """How one stage schedules its tensor-parallel communication (Oases, Li et al. 2023).

    ``tp_overlap_chunks`` > 1 runs each micro-batch as that many sub-batches through the
    blocks side by side, so one sub-batch's all-reduce overlaps another's compute (the
    blocks then run without sequence parallelism); ``recompute_keeps_comm`` ends each
    recomputed segment at a collective whose result is kept, so the backward pass does not
    communicate again. Both only matter for stages with more than one TP device.
    """

    tp_overlap_chunks: PositiveInt = 1
    recompute_keeps_comm: bool = False


PLAIN_COMM = StageComm()


@dataclass(frozen=True)
class CommSchedule:
    """Plan-wide communication scheduling (TriRace, Li et al. TPDS 2024; docs/execution.md).

    ``split_p2p_channels``: pipeline activations and gradients travel on two one-way
    channels (process groups), sends posted as soon as their data exists;
    ``dp_priority_schedule``: no barrier at the start of a step, so each stage's optimizer
    step and its ZeRO-1/2 parameter all-gather (bucket by bucket, in the order the next
    forward needs them) overlap the next step's forward on the stages before it;
    ``sparse_embedding_grads``: only the embedding rows a replica's batch touched are
    exchanged between replicas (an untied embedding).
    """

    split_p2p_channels: bool = False
    dp_priority_schedule: bool = False
    sparse_embedding_grads: bool = False


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: a tensor-parallel group and the blocks it runs.

    ``layer_ranges`` has one ``(start, end)`` per virtual stage (one for
    non-interleaved schedules); with ``v`` virtual stages, chunk ``c`` of stage
    ``i`` is virtual stage ``c * p + i`` of the pipeline.
    """

    devices: tuple[str, ...]
    layer_ranges: tuple[tuple[NonNegativeInt, NonNegativeInt], ...]
    memory: StageMemory = KEEP_ALL  # recomputation, swapping, offload of this stage
    comm: StageComm = PLAIN_COMM  # tensor-parallel overlap and recomputation of this stage

    @property
    def tp(self) -> int:
        return len(self.devices)

    @property
    def num_layers(self) -> int:
        return sum(end - start for start, end in self.layer_ranges)


@dataclass(frozen=True)
class Pipeline:
    """One data-parallel replica: its stages and its share of the global batch."""

    stages: tuple[Stage, ...]
    micro_batch_size: PositiveInt
    num_micro_batches: PositiveInt

    @property
    def batch_share(self) -> int:
        return self.micro_batch_size * self.num_micro_batches

    @property
    def pp(self) -> int:
        return len(self.stages)

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(d for stage in self.stages for d in stage.devices)


def mixed_tp(pipeline: Pipeline) -> bool:
    """Whether the stages of ``pipeline`` have different tensor-parallel degrees."""
    return len({stage.tp for stage in pipeline.stages}) > 1


@dataclass(frozen=True)
class TimeBreakdown:
    """Where one iteration's time goes on the critical path, in seconds."""

    compute_s: float = 0.0
    bubble_s: float = 0.0
    tp_s: float = 0.0
    pp_s: float = 0.0
    dp_s: float = 0.0
    optimizer_s: float = 0.0
    ep_s: float = 0.0  # expert parallelism's token all-to-alls
    outer_s: float = 0.0  # islands' outer exchange that the step waits for, amortized per step


@dataclass(frozen=True)
class DeviceMemory:
    """Predicted peak memory of one device, in bytes."""

    device: str
    pipeline: int
    stage: int
    weights_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    total_bytes: float  # on the device: its own, ZeRO's working set, peers' stashes
    host_bytes: float = 0.0  # in host memory: offloaded optimizer states, host-swap stash
    swapped_out_bytes: float = 0.0  # its activations stashed off the device at peak
    peer_held_bytes: float = 0.0  # stashes it holds for other devices' peer swaps
    offloaded_bytes: float = 0.0  # the optimizer states and master copy in host memory
    zero_working_bytes: float = 0.0  # ZeRO-2/3's full-size block gradients or weights


@dataclass(frozen=True)
class HostMemory:
    """Predicted host memory of one machine, in bytes."""

    node: str
    used_bytes: float  # what the plan puts there (offload, host swap, CPU ranks)
    reserve_bytes: float  # the OS and the ranks' processes
    capacity_bytes: float

    @property
    def needed_bytes(self) -> float:
        return self.used_bytes + self.reserve_bytes

    @property
    def fits(self) -> bool:
        return self.needed_bytes <= self.capacity_bytes


@dataclass(frozen=True)
class Prediction:
    """What the cost model predicts for a plan."""

    iteration_time_s: float
    tokens_per_s: float
    tflops_per_gpu: float
    mfu: float
    peak_memory_bytes: float
    breakdown: TimeBreakdown
    memory: tuple[DeviceMemory, ...] = ()
    stage_times_s: tuple[tuple[float, ...], ...] = ()
    host_memory: tuple[HostMemory, ...] = ()


@dataclass(frozen=True)
class Plan:
    """Everything needed to run (or simulate) one training layout."""

    cluster: ClusterSpec
    model: ModelSpec
    training: TrainingShape
    pipelines: tuple[Pipeline, ...]
    schedule: Schedule = Schedule.ONE_F_ONE_B
    virtual_stages: PositiveInt = 1
    recompute: Recompute = Recompute.NONE  # of every stage whose memory does not say otherwise
    zero: ZeroStage = 0  # ZeRO stage over each stage's data-parallel replicas (0: none)
    comm: CommSchedule = CommSchedule()  # pipeline and data-parallel communication scheduling
    # routed experts split over this many consecutive replicas (see expert_group)
    expert_parallel: PositiveInt = 1
    # how the pipelines split into islands that synchronize rarely (default: one island)
    islands: Islands = ONE_ISLAND
    unused_devices: tuple[str, ...] = ()
    prediction: Prediction | None = None
    notes: tuple[str, ...] = ()
    version: int = PLAN_VERSION
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def dp(self) -> int:
        return len(self.pipelines)

    @property
    def shards_optimizer(self) -> bool:
        """ZeRO-1 or higher: each replica keeps the optimizer states of its share."""
        return self.zero >= 1

    @property
    def ep(self) -> int:
        """Expert-parallel degree: each group of ``ep`` consecutive replicas splits every
        mixture-of-experts block's routed experts among its members, a token travelling to
        the member that holds its expert and back (all-to-all; GShard, Lepikhin et al. 2021)."""
        return self.expert_parallel

    def expert_group(self, pipeline: int) -> range:
        """The pipelines whose ranks exchange tokens with ``pipeline``'s (itself included)."""
        first = pipeline - pipeline % self.ep
        return range(first, first + self.ep)

    def stage_comm(self, pipeline: int, stage: int) -> StageComm:
        """Stage ``stage`` of pipeline ``pipeline``'s tensor-parallel communication."""
        return self.pipelines[pipeline].stages[stage].comm

    def stage_memory(self, pipeline: int, stage: int) -> StageMemory:
        """Stage ``stage`` of pipeline ``pipeline``'s memory, the plan's recompute filled in."""
        return self.pipelines[pipeline].stages[stage].memory.resolved(self.recompute)

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(d for pipeline in self.pipelines for d in pipeline.devices)

    @property
    def num_gpus(self) -> int:
        return len(self.devices)

    def layout(self) -> str:
        """A short human description, e.g. ``dp=2 pp=4 tp=2`` or ``dp=2 pp=[3,2] tp=[1,2]``."""
        pps = sorted({p.pp for p in self.pipelines})
        tps = sorted({s.tp for p in self.pipelines for s in p.stages})
        pp = str(pps[0]) if len(pps) == 1 else str(pps).replace(" ", "")
        tp = str(tps[0]) if len(tps) == 1 else str(tps).replace(" ", "")
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        islands = self.islands
        sync = (f" islands={islands.count} {islands.sync.value} H={islands.inner_steps}"
                if islands.split else "")
        return f"dp={self.dp} pp={pp} tp={tp}{ep}{sync}"

    def island_share(self, pipeline: int) -> float:
        """The share of the global batch that ``pipeline``'s island trains on (its pipelines'
        rows over all rows; 1 without islands that synchronize rarely)."""
        rows = sum(self.pipelines[p].batch_share for p in self.island_pipelines(pipeline))
        return rows / self.training.global_batch

    def island_pipelines(self, pipeline: int) -> tuple[int, ...]:
        """The pipelines that exchange gradients with ``pipeline`` every step (itself
        included): its island's when the plan's islands synchronize rarely, else all."""
        if not self.islands.split:
            return tuple(range(self.dp))
        return self.islands.members(self.islands.island_of(pipeline), self.dp)
