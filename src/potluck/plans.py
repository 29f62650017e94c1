"""The Plan: the contract between the planner, the simulator and the runtime.

A plan is frozen, versioned data. It says which devices form which pipeline
(one per data-parallel replica), which tensor-parallel group runs which
layers in each stage, how the global batch is split between replicas (shares
may differ: faster replicas take more), the micro-batch size and count, the
schedule and the recomputation. It carries the cluster, the model and the
training shape it was made for, so a plan file alone says everything the
runtime and the simulator need. An uneven, heterogeneous plan is just
different data; nothing downstream re-decides strategy.

Layers are numbered over the transformer blocks, ``[start, end)``; the first
stage of every pipeline also holds the embedding and the last one the final
norm, the output projection and the loss.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from enum import Enum
from functools import cache
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, NonNegativeInt, PositiveInt, TypeAdapter, ValidationError

from potluck.cluster.execution import Execution
from potluck.cluster.execution import Placement as Placement  # re-exported: plans name it
from potluck.cluster.execution import TiedGradSync as TiedGradSync  # re-exported
from potluck.cluster.spec import ClusterSpec, check_spec
from potluck.errors import ConfigError
from potluck.model.counts import Recompute
from potluck.model.memory import KEEP_ALL, StageMemory
from potluck.model.spec import ModelSpec
from potluck.schedules import Schedule, schedule_for
from potluck.yamlio import parse_json

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
        return f"dp={self.dp} pp={pp} tp={tp}{ep}"


@cache
def _adapter() -> TypeAdapter:
    return TypeAdapter(Plan)


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    return _adapter().dump_python(plan, mode="json")


def plan_to_json(plan: Plan, indent: int | None = 2) -> str:
    return json.dumps(plan_to_dict(plan), indent=indent)


def plan_from_dict(data: Any, label: str = "plan") -> Plan:
    """A plan from its JSON form, validated as a file from someone else: a known version,
    every field of its type, every number finite (counts and sizes at least 1), every name
    as a cluster file allows it (:func:`potluck.cluster.spec.check_spec`)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{label}: a plan must be a JSON object")
    _check_version(data, label)
    data = _upgraded(data)
    where = _non_finite(data)
    if where is not None:
        raise ConfigError(f"{label}: {where}: is not a finite number; make the plan again "
                          "with `potluck plan`")
    try:
        plan = _adapter().validate_python(data)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise ConfigError(f"{label}: {where}: {first['msg']}; fix it or make the plan again "
                          "with `potluck plan`") from None
    except ConfigError as err:  # a dataclass's own check (e.g. ModelSpec's shape)
        raise ConfigError(f"{label}: {err}") from None
    try:
        check_spec(plan.cluster)
    except ConfigError as err:
        raise ConfigError(f"{label}: cluster: {err}") from None
    return plan


def _upgraded(data: dict[str, Any]) -> dict[str, Any]:
    """A plan written before ZeRO had stages: ``zero1: true`` is ``zero: 1``."""
    if "zero1" not in data:
        return data
    upgraded = {key: value for key, value in data.items() if key != "zero1"}
    upgraded.setdefault("zero", 1 if data["zero1"] is True else 0)
    return upgraded


def _check_version(data: dict[str, Any], label: str) -> None:
    if "version" not in data:
        raise ConfigError(f"{label}: the plan has no 'version' (this potluck reads version "
                          f"{PLAN_VERSION}); make the plan again with `potluck plan`")
    version = data["version"]
    if isinstance(version, bool) or version != PLAN_VERSION:
        raise ConfigError(
            f"{label}: plan version {version!r} is not supported (this potluck reads "
            f"version {PLAN_VERSION}); make the plan again with `potluck plan`"
        )


def _non_finite(value: Any, where: str = "") -> str | None:
    """The path (``cluster.nodes.0.inter_bandwidth_bytes_per_s``) of the first NaN or
    infinite number in a JSON value, None when every number is finite."""
    if isinstance(value, float) and not math.isfinite(value):
        return where or "(top level)"
    items = value.items() if isinstance(value, dict) else (
        enumerate(value) if isinstance(value, list) else ())
    for key, item in items:
        found = _non_finite(item, f"{where}.{key}" if where else str(key))
        if found is not None:
            return found
    return None


def load_plan(path: str | Path) -> Plan:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"plan file {str(path)!r} not found; make one with `potluck plan -o`")
    data = parse_json(path, "plan file")
    return plan_from_dict(data, str(path))


def save_plan(plan: Plan, path: str | Path) -> None:
    Path(path).write_text(plan_to_json(plan) + "\n")


def plan_json_schema() -> dict[str, Any]:
    """The JSON schema of a plan file (documented in the README)."""
    return _adapter().json_schema()


def check_plan(plan: Plan) -> None:
    """Raise a one-line ConfigError if the plan is inconsistent with itself or its cluster."""
    from potluck.cluster.topology import Cluster

    cluster = Cluster(plan.cluster)
    seen: set[str] = set()
    for device_id in plan.devices:
        cluster.device(device_id)
        if device_id in seen:
            raise ConfigError(f"plan uses device {device_id!r} twice")
        seen.add(device_id)
    if not plan.pipelines:
        raise ConfigError("plan has no pipelines")
    total = sum(p.batch_share for p in plan.pipelines)
    if total != plan.training.global_batch:
        raise ConfigError(
            f"plan batch shares add up to {total}, not the global batch {plan.training.global_batch}"
        )
    for index, pipeline in enumerate(plan.pipelines):
        _check_pipeline(plan, index, pipeline, cluster)
    _check_comm(plan)
    problem = expert_parallel_problem(plan)
    if problem:
        raise ConfigError(f"the plan: {problem}")


def expert_parallel_problem(plan: Plan) -> str | None:
    """Why ``plan``'s expert parallelism cannot run, if it cannot: it needs routed experts
    that divide evenly, whole groups of replicas, and the members of each group in lockstep
    (their token exchanges pair up only if they run the same blocks, stage by stage, with
    the same micro-batch count and recomputation), each stage on one device."""
    ep, model = plan.ep, plan.model
    if ep == 1:
        return None
    if not model.is_moe:
        return (f"expert_parallel {ep} needs a mixture-of-experts model and {model.name} has "
                "no routed experts; set expert_parallel to 1")
    if model.num_experts % ep:
        return (f"expert_parallel {ep} does not divide the {model.num_experts} experts of "
                f"{model.name}; use a divisor of {model.num_experts}")
    if plan.dp % ep:
        return (f"expert_parallel {ep} does not divide the {plan.dp} data-parallel replicas; "
                f"use a divisor of {plan.dp}")
    if plan.zero >= 3:
        return ("expert parallelism does not run under zero 3 (FSDP2 would shard the experts "
                "a second way); use zero 2 or fewer")
    for first in range(0, plan.dp, ep):
        problem = _lockstep_problem(plan, range(first, first + ep))
        if problem:
            return problem
    return None


def _lockstep_problem(plan: Plan, group: range) -> str | None:
    def shape(k: int) -> tuple:
        pipeline = plan.pipelines[k]
        stages = tuple((s.layer_ranges, s.tp, plan.stage_memory(k, j))
                       for j, s in enumerate(pipeline.stages))
        return stages, pipeline.num_micro_batches
    shapes = {shape(k) for k in group}
    if len(shapes) > 1:
        return (f"pipelines {group.start}-{group.stop - 1} exchange tokens (expert_parallel "
                f"{plan.ep}) but differ in stages, layers, recomputation or micro-batch count; "
                "give them the same structure or set expert_parallel to 1")
    if any(s.tp > 1 for k in group for s in plan.pipelines[k].stages):
        return ("expert parallelism runs stages of one device each (a mixture of experts is "
                "not tensor-parallel); set tp to 1 or expert_parallel to 1")
    return None


def explicit_tp(plan: Plan, pipeline: int, stage: int) -> bool:
    """Whether stage ``stage`` of pipeline ``pipeline`` runs its blocks through potluck's
    explicit TP executor (sub-batches overlapping their all-reduces, recomputed segments
    that keep their collectives' results) instead of DTensor's sequence-parallel styles."""
    comm = plan.stage_comm(pipeline, stage)
    if plan.pipelines[pipeline].stages[stage].tp == 1:
        return False
    recomputes = plan.stage_memory(pipeline, stage).recompute is not Recompute.NONE
    return comm.tp_overlap_chunks > 1 or (comm.recompute_keeps_comm and recomputes)


def _check_comm(plan: Plan) -> None:
    """Each stage's TP overlap fits its micro-batch and schedule, and every decision is the
    one the plan's execution forces (where it forces one)."""
    forced = plan.training.execution
    for k, pipeline in enumerate(plan.pipelines):
        for j, stage in enumerate(pipeline.stages):
            _check_stage_comm(plan, k, j, stage)
            if stage.tp > 1:
                _check_forced(forced.tp_overlap_chunks, stage.comm.tp_overlap_chunks,
                              "tp_overlap_chunks", f"pipeline {k} stage {j}")
                _check_forced(forced.recompute_keeps_comm, stage.comm.recompute_keeps_comm,
                              "recompute_keeps_comm", f"pipeline {k} stage {j}")
    for name in ("split_p2p_channels", "dp_priority_schedule", "sparse_embedding_grads"):
        _check_forced(getattr(forced, name), getattr(plan.comm, name), name, "the plan")
    _check_sparse_embedding(plan)


def _check_sparse_embedding(plan: Plan) -> None:
    """A sparse embedding gradient needs an untied embedding and whole gradients on every
    replica (ZeRO 0 or 1); holders with different TP degrees exchange it sparsely too."""
    if not plan.comm.sparse_embedding_grads:
        return
    if plan.model.tied_embeddings:
        raise ConfigError("the plan: sparse_embedding_grads needs an untied input embedding "
                          "(a tied head's gradient touches every row); make the plan with "
                          "sparse_embedding_grads false")
    if plan.zero >= 2:
        raise ConfigError(f"the plan: sparse_embedding_grads does not run under zero {plan.zero} "
                          "(the embedding's gradient is sharded as it is computed); use zero 0 "
                          "or 1, or make the plan with sparse_embedding_grads false")


def _check_stage_comm(plan: Plan, k: int, j: int, stage: Stage) -> None:
    chunks, where = stage.comm.tp_overlap_chunks, f"pipeline {k} stage {j}"
    if chunks == 1:
        explicit = explicit_tp(plan, k, j)
    elif stage.tp == 1:
        raise ConfigError(f"{where}: tp_overlap_chunks {chunks} needs a tensor-parallel stage "
                          "(this one has one device); set it to 1")
    elif plan.pipelines[k].micro_batch_size % chunks:
        raise ConfigError(f"{where}: tp_overlap_chunks {chunks} does not divide the micro-batch "
                          f"size {plan.pipelines[k].micro_batch_size}; use a micro-batch size "
                          f"that is a multiple of {chunks}")
    elif (plan.stage_memory(k, j).recompute is not Recompute.NONE
          and not stage.comm.recompute_keeps_comm):
        raise ConfigError(f"{where}: with tp_overlap_chunks {chunks} recomputation always keeps "
                          "its collectives' results; set recompute_keeps_comm true")
    else:
        explicit = True
    problem = _explicit_tp_problem(plan, k, j) if explicit else None
    if problem:
        raise ConfigError(f"{where}: {problem}")


def _explicit_tp_problem(plan: Plan, k: int, j: int) -> str | None:
    """What the explicit TP executor (TP overlap, recomputation keeping communication) cannot
    run on stage ``j`` of pipeline ``k``, if anything. Mixed-TP pipelines are fine: the
    executor takes and gives sequence shards like any TP stage."""
    if plan.schedule is Schedule.ZERO_BUBBLE:
        return ("the zero-bubble schedule splits each backward into input and weight passes, "
                "which the explicit TP executor (TP overlap, recomputation keeping "
                "communication) does not; use schedule interleaved or turn them off")
    if plan.stage_memory(k, j).swaps:
        return ("the explicit TP executor (TP overlap, recomputation keeping communication) "
                "does not swap activations; turn swapping off for this stage or set "
                "tp_overlap_chunks 1 and recompute_keeps_comm false")
    return None


def _check_forced(forced: Any, chosen: Any, name: str, where: str) -> None:
    if forced is not None and forced != chosen:
        raise ConfigError(f"{where}: {name} is {_trait_value(chosen)}, but the plan's execution "
                          f"forces {_trait_value(forced)}; make the plan again with potluck plan")


def _trait_value(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _check_pipeline(plan: Plan, index: int, pipeline: Pipeline, cluster: Any) -> None:
    model = plan.model
    if pipeline.micro_batch_size < 1 or pipeline.num_micro_batches < 1:
        raise ConfigError(f"pipeline {index}: micro-batch size and count must be at least 1")
    check_pipeline_schedule(plan, index, plan.schedule)
    chunks = _virtual_chunks(pipeline, plan.virtual_stages, index)
    expected_start = 0
    for start, end in chunks:
        if start != expected_start or end <= start:
            raise ConfigError(
                f"pipeline {index}: layer ranges must cover blocks 0..{model.num_layers} in order "
                f"without gaps or empty chunks (found [{start}, {end}) after {expected_start})"
            )
        expected_start = end
    if expected_start != model.num_layers:
        raise ConfigError(
            f"pipeline {index}: layers end at {expected_start}, model has {model.num_layers}"
        )
    for stage in pipeline.stages:
        _check_tp(stage, model, index, cluster)


def check_pipeline_schedule(plan: Plan, index: int, schedule: Schedule) -> None:
    """One ConfigError if ``schedule`` cannot run pipeline ``index`` of ``plan`` as laid out."""
    pipeline = plan.pipelines[index]
    problem = schedule_for(schedule).problem(
        pipeline.num_micro_batches, pipeline.pp, plan.virtual_stages, mixed_tp=mixed_tp(pipeline))
    if problem is not None:
        raise ConfigError(f"pipeline {index}: {problem}")


def _virtual_chunks(pipeline: Pipeline, virtual_stages: int, index: int) -> list[tuple[int, int]]:
    for stage in pipeline.stages:
        if len(stage.layer_ranges) != virtual_stages:
            raise ConfigError(
                f"pipeline {index}: every stage needs {virtual_stages} layer range(s), "
                f"one per virtual stage"
            )
    return [
        stage.layer_ranges[chunk]
        for chunk in range(virtual_stages)
        for stage in pipeline.stages
    ]


def _check_tp(stage: Stage, model: ModelSpec, index: int, cluster: Any) -> None:
    tp = stage.tp
    if tp < 1:
        raise ConfigError(f"pipeline {index}: a stage has no devices")
    if tp > 1 and model.tp_refusal:
        raise ConfigError(f"pipeline {index}: a stage of tensor parallel {tp}, but "
                          f"{model.name} cannot be split so ({model.tp_refusal})")
    if model.num_heads % tp or model.num_kv_heads % tp:
        raise ConfigError(
            f"pipeline {index}: tensor parallel {tp} does not divide the model's "
            f"{model.num_heads} heads and {model.num_kv_heads} key/value heads"
        )
    nodes = {cluster.device(d).node for d in stage.devices}
    if len(nodes) > 1:
        raise ConfigError(f"pipeline {index}: a tensor-parallel group spans machines {sorted(nodes)}")


MODEL_SHAPE_FIELDS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_hidden_size",
                      "vocab_size", "mlp", "tied_embeddings")


def check_plan_matches(plan: Plan, cluster: ClusterSpec | None = None,
                       model: ModelSpec | None = None, label: str = "the plan") -> None:
    """One clear error if ``plan`` was made for other devices or another model shape."""
    if cluster is not None:
        _check_same_devices(plan, cluster, label)
    if model is not None:
        different = [f for f in MODEL_SHAPE_FIELDS if getattr(plan.model, f) != getattr(model, f)]
        if different:
            raise ConfigError(
                f"{label} was made for model {plan.model.name!r}, which differs from "
                f"{model.name!r} in {', '.join(different)}; make a new plan with potluck plan"
            )


def _check_same_devices(plan: Plan, cluster: ClusterSpec, label: str) -> None:
    from potluck.cluster.topology import Cluster

    planned, given = Cluster(plan.cluster), Cluster(cluster)
    for device_id in plan.devices:
        device = given.by_id.get(device_id)
        wanted = planned.device(device_id).type.name
        if device is None or device.type.name != wanted:
            found = "missing" if device is None else device.type.name
            raise ConfigError(
                f"{label} puts a {wanted} at {device_id}, but cluster {cluster.name!r} has "
                f"{found} there; make a new plan for this cluster with potluck plan"
            )
