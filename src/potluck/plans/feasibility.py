"""Can this plan run: every rule a plan must keep, in one place.

The search's filter, the plan loader, the simulator and the runtime all call
:func:`check_plan` (or the one rule they need), so a plan the search returns is a plan the
runtime runs: a rule written in two places would disagree. A rule that only the runtime's
own code can know (a model family's block adapter, a GPU that exists) stays in the
runtime; everything a plan's data decides is here.
"""

from __future__ import annotations

from typing import Any

from potluck.cluster.spec import ClusterSpec
from potluck.errors import ConfigError
from potluck.model.counts import Recompute
from potluck.model.sharding import heads_problem
from potluck.model.spec import ModelSpec
from potluck.plans.data import Pipeline, Plan, Stage, mixed_tp
from potluck.plans.islands import SyncMethod
from potluck.schedules import Schedule, schedule_problem


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
    for problem in (zero3_problem(plan), expert_parallel_problem(plan), islands_problem(plan)):
        if problem:
            raise ConfigError(f"the plan: {problem}")


def shards_parameters(plan: Plan) -> bool:
    """Whether ``plan`` shards its parameters with FSDP2 (ZeRO-3 over more than one
    replica; with one replica there is nothing to shard and the plan runs as ZeRO-2)."""
    return plan.zero >= 3 and plan.dp > 1


ZERO3_UNIFORM = ("zero 3 needs every replica to hold the same layers with the same TP; "
                 "use --zero 2 or a uniform layout")


def zero3_schedule_problem(schedule: Schedule) -> str | None:
    """Why ZeRO-3 over several replicas cannot run under ``schedule``, if it cannot."""
    if schedule is Schedule.ZERO_BUBBLE:
        return ("zero 3 does not run zero bubble's split backward (FSDP2 reduces in the full "
                "backward); use --zero 2 or another schedule")
    return None


def zero3_problem(plan: Plan) -> str | None:
    """Why FSDP2 cannot run ``plan``'s ZeRO-3, if it cannot: it shards each module the same
    way on every replica and gathers it once per micro-batch, so every replica holds each
    stage's layers alike (same splits, same TP) and runs as many micro-batches; and zero
    bubble's weight pass writes gradients outside the hooks FSDP2 reduces in."""
    if not shards_parameters(plan):
        return None
    problem = zero3_schedule_problem(plan.schedule)
    if problem:
        return problem
    shapes = {tuple((s.tp, s.layer_ranges) for s in p.stages) for p in plan.pipelines}
    if len(shapes) > 1:
        return ZERO3_UNIFORM
    if len({p.num_micro_batches for p in plan.pipelines}) > 1:
        return ("zero 3 needs every replica to run the same number of micro-batches (FSDP2 "
                "gathers each block once per micro-batch on every replica); use --zero 2 or "
                "equal micro-batch counts")
    return None


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


def islands_problem(plan: Plan) -> str | None:
    """Why ``plan``'s islands cannot run, if they cannot: they split the pipelines, each
    pipeline in exactly one island; a rare synchronization needs two islands or more and
    says how often (H at least the number of fragments); only ``bounded`` has a staleness;
    ZeRO-3 and expert parallelism stay inside one island (FSDP2 shards a module, and experts
    exchange tokens, every step)."""
    islands = plan.islands
    if not islands.islands:
        return None if islands.sync is SyncMethod.SYNC else (
            f"sync {islands.sync.value} needs islands; list them or use sync")
    listed = sorted(k for island in islands.islands for k in island.pipelines)
    if listed != list(range(plan.dp)):
        return (f"islands must list each of the {plan.dp} pipelines (0-{plan.dp - 1}) exactly "
                f"once, not {listed}")
    if any(not island.pipelines for island in islands.islands):
        return "an island has no pipelines; remove it"
    if islands.sync is SyncMethod.SYNC:
        return ("islands under sync synchronize every step like one island; remove them or "
                "choose diloco or bounded")
    if len(islands.islands) < 2:
        return f"sync {islands.sync.value} needs two islands or more; use sync for one"
    if islands.fragments > islands.inner_steps:
        return (f"{islands.fragments} fragments need at least as many inner steps, not "
                f"{islands.inner_steps}; lower fragments or raise inner_steps")
    if islands.staleness and islands.sync is not SyncMethod.BOUNDED:
        return "staleness applies to sync bounded only; set it to 0"
    if shards_parameters(plan):
        return ("zero 3 does not run across islands (FSDP2 gathers every step); use zero 2 "
                "or fewer with islands")
    if any(islands.island_of(k) != islands.island_of(plan.expert_group(k).start)
           for k in range(plan.dp)):
        return ("an expert-parallel group spans two islands (experts exchange tokens every "
                "step); put each group's pipelines in one island")
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


def runs_explicit_tp(tp: int, overlap_chunks: int, keeps_comm: bool, recomputes: bool) -> bool:
    """The one rule for whether a stage of ``tp`` devices runs its blocks through potluck's
    explicit TP executor (runtime/parallel/tp_overlap.py: sub-batches overlapping their
    all-reduces, recomputed segments that keep their collectives' results) instead of
    DTensor's sequence-parallel styles: with sub-batches (``overlap_chunks`` > 1), or where
    recomputation keeps communication and the stage ``recomputes`` a block at all (with none
    recomputed there is nothing to keep)."""
    return tp > 1 and (overlap_chunks > 1 or (keeps_comm and recomputes))


def stage_recomputes(plan: Plan, pipeline: int, stage: int) -> bool:
    """Whether any block of stage ``stage`` of pipeline ``pipeline`` recomputes."""
    memory = plan.stage_memory(pipeline, stage)
    return memory.recompute is not Recompute.NONE and memory.recompute_blocks != 0


def explicit_tp(plan: Plan, pipeline: int, stage: int) -> bool:
    """Whether stage ``stage`` of pipeline ``pipeline`` runs the explicit TP executor
    (:func:`runs_explicit_tp`)."""
    comm = plan.stage_comm(pipeline, stage)
    return runs_explicit_tp(plan.pipelines[pipeline].stages[stage].tp, comm.tp_overlap_chunks,
                            comm.recompute_keeps_comm, stage_recomputes(plan, pipeline, stage))


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
    elif stage_recomputes(plan, k, j) and not stage.comm.recompute_keeps_comm:
        raise ConfigError(f"{where}: with tp_overlap_chunks {chunks} recomputation always keeps "
                          "its collectives' results; set recompute_keeps_comm true")
    else:
        explicit = True
    problem = _explicit_tp_problem(plan, k, j) if explicit else None
    if problem:
        raise ConfigError(f"{where}: {problem}")


EXPLICIT_TP = "the explicit TP executor (TP overlap, recomputation keeping communication)"
EXPLICIT_TP_OFF = ("make the plan with tp_overlap_chunks 1 and recompute_keeps_comm false in "
                   "the execution section")


def explicit_tp_model_problem(model: ModelSpec) -> str | None:
    """What keeps the explicit TP executor from ``model``'s blocks, if anything: it runs
    LLaMA-style and GPT-2 blocks, without dropout (its partial outputs would be dropped out
    before they are summed)."""
    if not model.runs_explicit_tp:
        return f"{EXPLICIT_TP} runs LLaMA-style and GPT-2 blocks, not {model.family}'s"
    if model.dropout:
        return (f"{EXPLICIT_TP} does not run models with dropout; train {model.name} without "
                "dropout or turn it off")
    return None


def explicit_tp_plan_problem(plan: Plan) -> str | None:
    """What keeps the explicit TP executor from every stage of ``plan``, if anything: the
    model's blocks, ZeRO-3 (FSDP2 gathers a block's weights around the block's forward,
    which the executor runs in parts) and the zero-bubble schedule (it splits each backward
    into input and weight passes, which the executor does not)."""
    problem = explicit_tp_model_problem(plan.model)
    if problem:
        return problem
    if plan.zero >= 3:
        return f"zero 3 does not run with {EXPLICIT_TP}; use zero 2 or turn it off"
    if plan.schedule is Schedule.ZERO_BUBBLE:
        return (f"the zero-bubble schedule splits each backward into input and weight passes, "
                f"which {EXPLICIT_TP} does not; use schedule interleaved or turn it off")
    return None


def _explicit_tp_problem(plan: Plan, k: int, j: int) -> str | None:
    """What the explicit TP executor cannot run on stage ``j`` of pipeline ``k``, if anything.
    Mixed-TP pipelines are fine: the executor takes and gives sequence shards like any TP
    stage."""
    problem = explicit_tp_plan_problem(plan)
    if problem:
        return problem
    if plan.stage_memory(k, j).swaps:
        return (f"{EXPLICIT_TP} does not swap activations; turn swapping off for this stage "
                "or set tp_overlap_chunks 1 and recompute_keeps_comm false")
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
    problem = schedule_problem(schedule, pipeline.num_micro_batches, pipeline.pp,
                               plan.virtual_stages, mixed_tp=mixed_tp(pipeline))
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
    problem = heads_problem(tp, model.num_heads, model.num_kv_heads)
    if problem:
        raise ConfigError(f"pipeline {index}: tensor parallel {tp} {problem}")
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
