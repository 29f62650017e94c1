"""The search's choice of communication scheduling, where it pays.

An execution trait left ``auto`` (None) lets the search decide; a value forces it:

- **per stage** (tensor-parallel stages only): the sub-batches whose all-reduces overlap
  (``tp_overlap_chunks``: 1, 2 or 4, dividing the micro-batch) and whether recomputation
  keeps its collectives' results. Families of pipelines take, per unit of a node group, the
  choice with the least time per block (:func:`choose_stage_comm`); a built plan then
  re-decides each kind of stage with the full cost model (:func:`refine_comm`), since
  overlap also costs memory (no sequence parallelism) and GEMM efficiency (smaller
  sub-batches), and drops what no longer fits;
- **per plan**: split pipeline channels, the data-parallel priority schedule and sparse
  embedding gradients, each turned on where the full cost model predicts a faster step.
"""

from __future__ import annotations

from dataclasses import replace

from potluck.cluster.topology import Device
from potluck.model.counts import Recompute
from potluck.planner.cost import CostModel, StageShape, usable_memory_bytes
from potluck.plans import (
    Execution,
    Pipeline,
    Plan,
    Prediction,
    Schedule,
    StageComm,
    check_plan,
    explicit_tp_model_problem,
    explicit_tp_plan_problem,
    stage_recomputes,
)

OVERLAP_CHUNKS = (1, 2, 4)  # sub-batches the search tries
PLAN_TRAITS = ("split_p2p_channels", "dp_priority_schedule", "sparse_embedding_grads")


def stage_comm_options(execution: Execution, micro_batch: int, recompute: Recompute,
                       schedule: Schedule, explicit: bool = True) -> list[StageComm]:
    """Every TP stage setting the execution allows at this micro-batch size: chunks that
    divide it (1 only under zero bubble, whose split backward the executor does not run, and
    for models the explicit executor does not run: ``explicit`` False), keeping communication
    only where the stage recomputes (always, with sub-batches)."""
    if schedule is Schedule.ZERO_BUBBLE or not explicit:
        return [StageComm()]
    forced_chunks, forced_keeps = execution.tp_overlap_chunks, execution.recompute_keeps_comm
    chunks = [forced_chunks] if forced_chunks is not None else list(OVERLAP_CHUNKS)
    recomputes = recompute is not Recompute.NONE
    options = []
    for c in chunks:
        if micro_batch % c:
            continue
        keeps = [True] if c > 1 and recomputes else [False, True] if recomputes else [False]
        if forced_keeps is not None:
            keeps = [k for k in keeps if k == forced_keeps]
        options.extend(StageComm(c, k) for k in keeps)
    return options or [StageComm()]


def choose_stage_comm(cost: CostModel, devices: tuple[Device, ...], shape: StageShape,
                      schedule: Schedule) -> StageComm:
    """The setting with the least time per block for a stage of ``devices`` (a family's
    quick choice; :func:`refine_comm` checks it on the whole plan)."""
    if len(devices) == 1:
        return StageComm()
    options = stage_comm_options(cost.execution, shape.micro_batch, shape.recompute, schedule,
                                 explicit_tp_model_problem(cost.model) is None)
    if len(options) == 1:
        return options[0]

    def per_block_s(comm: StageComm) -> float:
        with_comm = replace(shape, tp_overlap_chunks=comm.tp_overlap_chunks,
                            keeps_comm=comm.recompute_keeps_comm)
        one = cost.stage_time(devices, with_comm.with_layers(1)).work.total_s
        two = cost.stage_time(devices, with_comm.with_layers(2)).work.total_s
        return two - one

    return min(options, key=per_block_s)


def refine_comm(plan: Plan, cost: CostModel) -> Plan | None:
    """``plan`` with each kind of TP stage's setting and each plan-wide method chosen by the
    full cost model (see the module docstring), and its prediction; None where what the
    execution forces cannot apply (sub-batches that do not divide the micro-batch) or the
    plan does not fit."""
    return cost.remembered(("refine_comm", plan), lambda: _refined(plan, cost))


def _refined(plan: Plan, cost: CostModel) -> Plan | None:
    best = _consistent(plan, cost.execution)
    explicit = explicit_tp_plan_problem(best) is None
    predicted = _fitting_prediction(best, cost)
    if predicted is None:
        return None
    trials = [(signature, comm) for signature in _signatures(best, cost)
              for comm in stage_comm_options(cost.execution, signature[3], signature[6],
                                             best.schedule, explicit)]
    for signature, comm in trials:
        trial = _with_stage_comm(best, cost, signature, comm)
        best, predicted = _faster(best, predicted, trial, cost)
    for name in PLAN_TRAITS:
        if getattr(cost.execution, name) is None and _applies(best, name):
            trial = replace(best, comm=replace(best.comm, **{name: True}))
            best, predicted = _faster(best, predicted, trial, cost)
    return replace(best, prediction=predicted)


def _faster(best: Plan, predicted: Prediction, trial: Plan, cost: CostModel
            ) -> tuple[Plan, Prediction]:
    """``trial`` and its prediction where it fits and is faster, else ``best`` and its."""
    trial_predicted = _fitting_prediction(trial, cost)
    if (trial_predicted is not None
            and trial_predicted.iteration_time_s < predicted.iteration_time_s * (1 - 1e-6)):
        return trial, trial_predicted
    return best, predicted


def _consistent(plan: Plan, execution: Execution) -> Plan:
    """The plan-wide methods as the execution forces them, and every stage's setting one
    the plan checks accept (a stage that recomputes with sub-batches keeps communication;
    single-device stages, and every stage of a plan the explicit TP executor cannot run,
    :func:`~potluck.plans.explicit_tp_plan_problem`, none)."""
    forced = {name: getattr(execution, name) for name in PLAN_TRAITS
              if getattr(execution, name) is not None}
    plan = replace(plan, comm=replace(plan.comm, **forced)) if forced else plan
    pipelines = []
    explicit = explicit_tp_plan_problem(plan) is None
    for k, pipeline in enumerate(plan.pipelines):
        stages = []
        for j, stage in enumerate(pipeline.stages):
            comm = stage.comm if stage.tp > 1 and explicit else StageComm()
            if (comm.tp_overlap_chunks > 1 and stage_recomputes(plan, k, j)
                    and not comm.recompute_keeps_comm):
                comm = replace(comm, recompute_keeps_comm=True)
            stages.append(replace(stage, comm=comm))
        pipelines.append(replace(pipeline, stages=tuple(stages)))
    return replace(plan, pipelines=tuple(pipelines))


Signature = tuple[str, int, int, int, bool, bool, Recompute]


def _signatures(plan: Plan, cost: CostModel) -> list[Signature]:
    """The kinds of TP stage: same device type, TP degree, blocks, micro-batch, ends and
    recomputation (replicas of one stage are alike, so they are decided together)."""
    found: dict[Signature, None] = {}
    for k, pipeline in enumerate(plan.pipelines):
        for j, stage in enumerate(pipeline.stages):
            if stage.tp > 1:
                found[_signature(plan, cost, k, j)] = None
    return list(found)


def _signature(plan: Plan, cost: CostModel, k: int, j: int) -> Signature:
    pipeline = plan.pipelines[k]
    stage = pipeline.stages[j]
    device_type = cost.cluster.device(stage.devices[0]).type.name
    return (device_type, stage.tp, stage.num_layers, pipeline.micro_batch_size, j == 0,
            j == pipeline.pp - 1, plan.stage_memory(k, j).recompute or Recompute.NONE)


def _with_stage_comm(plan: Plan, cost: CostModel, signature: Signature, comm: StageComm
                     ) -> Plan:
    pipelines = []
    for k, pipeline in enumerate(plan.pipelines):
        stages = tuple(replace(stage, comm=comm) if stage.tp > 1
                       and _signature(plan, cost, k, j) == signature else stage
                       for j, stage in enumerate(pipeline.stages))
        pipelines.append(Pipeline(stages, pipeline.micro_batch_size, pipeline.num_micro_batches))
    return replace(plan, pipelines=tuple(pipelines))


def _applies(plan: Plan, name: str) -> bool:
    """Whether a plan-wide method can change anything: channels need a pipeline, the
    priority schedule replicas or stages, sparse rows an untied embedding held by replicas
    whose gradients are not sharded per micro-batch."""
    if name == "split_p2p_channels":
        return any(p.pp > 1 for p in plan.pipelines)
    if name == "dp_priority_schedule":
        return plan.dp > 1 or any(p.pp > 1 for p in plan.pipelines)
    return plan.dp > 1 and not plan.model.tied_embeddings and plan.zero <= 1


def _fitting_prediction(plan: Plan, cost: CostModel) -> Prediction | None:
    """The plan's prediction, or None if it is not one the checks accept or it overfills a
    device (remembered: half the trials are a plan already predicted, a setting that
    changes nothing or another candidate's refinement at the same point)."""
    return cost.remembered(("fitting_prediction", plan), lambda: _new_prediction(plan, cost))


def _new_prediction(plan: Plan, cost: CostModel) -> Prediction | None:
    from potluck.errors import ConfigError
    from potluck.planner.evaluate import host_memory_problem, predict

    try:
        check_plan(plan)
        prediction = predict(plan, cost)
    except ConfigError:
        return None
    for used in prediction.memory:
        device = cost.cluster.device(used.device)
        if used.total_bytes > usable_memory_bytes(device.type) * (1 + 1e-9):
            return None
    if host_memory_problem(prediction) is not None:
        return None
    return prediction
