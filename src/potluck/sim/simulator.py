"""Simulate one training iteration of a plan, in two phases.

1. **Pipelines.** Each pipeline's forwards, backwards and stage-to-stage
   transfers run on the engine. Pipelines whose transfers cross a common link
   run together (they contend); a set of pipelines identical to one already
   run (same work per chunk, same transfers over links of the same speeds,
   shared in the same pattern) reuses its twin's timings: this is what makes
   a 1024-GPU plan simulate in well under a second.
2. **Gradients and optimizer.** Every gradient group of the cost model
   (stage replicas, tied embeddings) all-reduces over its rings, in the cost
   model's phases (:func:`potluck.planner.evaluate.gradient_phases`: the tied
   embedding's pairs after the stages' rings under ``pipeline-ends``); in the
   first phase an all-reduce starts when the last of its members starts its
   last backward (buckets overlap that backward, as DDP does) or, for the tied
   weight, once their backward passes are over; in a later phase, once its
   members' earlier groups have ended. It ends no earlier than the members'
   gradients are complete. All-reduces of one phase share links with each
   other; they are assumed not to meet the pipelines' own transfers (they
   overlap only the final backward). Each stage then runs its optimizer step.
   ZeRO-2/3 reduce-scatter after every micro-batch's backward: one collective per
   backward, released at its end (the last at the last backward's start, as above);
   an offloaded optimizer's step (its host step from the cost model) starts once its
   stage's gradients are reduced, and ZeRO-3 has no parameter all-gather after it.
3. **State transfers.** Each swapping chunk's activations go out on their lane from
   the start of each forward and come back from the start of each backward, each
   taking the cost model's one-pass transfer (what does not fit under the pass is
   already in its duration); ZeRO-3's all-gathers are drawn from the start of each
   pass on the stage's ring. They are drawn, not re-timed: the pass durations carry
   their exposed part, as the cost model charges it.
4. **Outer cycle.** Islands that synchronize rarely add their outer exchange to the
   iteration as the amortized part a step waits for
   (:func:`potluck.planner.islands.exchange.outer_exchange`), and draw one outer period of
   H such iterations with each fragment's or push's exchange laid out on the link between
   the islands (:mod:`potluck.sim.outer`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import NamedTuple

from potluck.ops import OpKind
from potluck.placement import StageRef
from potluck.planner.comm.step_overlap import gathered_forward_delay_s, next_step_bound_s
from potluck.planner.cost import CostModel
from potluck.planner.evaluate import GradientGroup, gradient_groups, gradient_phases, predict
from potluck.planner.islands.exchange import outer_exchange
from potluck.plans import Plan, check_pipeline_schedule, check_plan
from potluck.schedules import PipelineSchedule, Schedule, schedule_for
from potluck.sim import engine, program
from potluck.sim.critical import critical_path
from potluck.sim.memory import stage_memory
from potluck.sim.network import Network
from potluck.sim.outer import outer_cycle
from potluck.sim.result import (
    GradientSync,
    MemoryTrace,
    OpRecord,
    OptimizerStep,
    PipelineRun,
    SimulationResult,
    StateTransfer,
    StateTransferKind,
)
from potluck.sim.stats import bubble_fraction, device_stats, pipeline_end_s
from potluck.sim.workload import PipelineWorkload, plan_workloads


def simulate(plan: Plan, schedule: Schedule | str | None = None) -> SimulationResult:
    """Simulate one iteration of ``plan`` (under ``schedule``, default the plan's own)."""
    check_plan(plan)
    name = Schedule(schedule) if schedule is not None else plan.schedule
    pipeline_schedule = schedule_for(name)
    if name is not plan.schedule:  # check_plan has checked the plan's own
        _check_override(plan, pipeline_schedule)
    cost = CostModel.for_plan(plan)
    network = Network(cost.cluster)
    workloads = plan_workloads(plan, cost)
    runs, simulated = run_pipelines(workloads, pipeline_schedule, plan.virtual_stages, network,
                                    overlap_p2p=plan.training.execution.overlap_p2p,
                                    split_channels=plan.comm.split_p2p_channels)
    syncs, steps, phase = _gradients_and_steps(plan, cost, network, workloads, runs)
    memory = _memory(runs, workloads, pipeline_schedule.frees_activations_after)
    transfers = state_transfers(runs, workloads)
    iteration_s = max(step.end_s for step in steps)
    if plan.comm.dp_priority_schedule:
        iteration_s = _next_step_bound_s(plan, runs, steps, phase)
    devices = device_stats(workloads, runs, syncs, steps, memory, iteration_s)
    exchange = outer_exchange(cost.cluster, plan, iteration_s)
    outer_s = exchange.exposed_per_step_s
    return SimulationResult(
        plan=plan, schedule=name, iteration_time_s=iteration_s + outer_s, outer_s=outer_s,
        outer_cycle=outer_cycle(plan.islands, exchange, iteration_s),
        pipeline_time_s=max(pipeline_end_s(run) for run in runs),
        bubble_fraction=bubble_fraction(workloads, runs),
        pipelines=tuple(runs), gradient_syncs=tuple(syncs), optimizer_steps=tuple(steps),
        memory=memory, devices=devices,
        predicted_time_s=predict(plan, cost).iteration_time_s, simulated_pipelines=simulated,
        state_transfers=transfers,
    )


def state_transfers(runs: list[PipelineRun], workloads: list[PipelineWorkload]
                    ) -> tuple[StateTransfer, ...]:
    """Every swap out and back, and every ZeRO-3 all-gather, of the executed passes."""
    drawn = []
    for run in runs:
        stages = workloads[run.index].stages
        for op in run.ops:
            if op.peer != -1 or not op.kind.is_pipeline_compute \
                    or op.kind is OpKind.BACKWARD_WEIGHT:
                continue
            stage = stages[op.stage]
            chunk = stage.chunks[op.chunk]
            forward = op.kind is OpKind.FORWARD
            if chunk.swap_s > 0.0:
                kind = StateTransferKind.SWAP_OUT if forward else StateTransferKind.SWAP_IN
                drawn.append(StateTransfer(kind, run.index, op.stage, op.chunk, op.micro_batch,
                                           stage.swap_lane, op.start_s, op.start_s + chunk.swap_s))
            if chunk.gather_s > 0.0:
                drawn.append(StateTransfer(StateTransferKind.PARAM_ALLGATHER, run.index, op.stage,
                                           op.chunk, op.micro_batch, "dp ring", op.start_s,
                                           op.start_s + chunk.gather_s))
    return tuple(drawn)


def _check_override(plan: Plan, schedule: PipelineSchedule) -> None:
    """One ConfigError unless ``schedule`` runs every pipeline of ``plan`` as laid out (the
    plan's virtual stages included), naming the schedules that do."""
    for index in range(plan.dp):
        check_pipeline_schedule(plan, index, schedule.name)


def _memory(runs: list[PipelineRun], workloads: list[PipelineWorkload],
            frees_on: OpKind) -> tuple[tuple[MemoryTrace, ...], ...]:
    """Memory over time of every stage; twins share their traces."""
    traces: dict[int, tuple[MemoryTrace, ...]] = {}
    for run in runs:
        if run.twin_of not in traces:
            by_stage: dict[int, list[OpRecord]] = defaultdict(list)
            for op in run.ops:
                by_stage[op.stage].append(op)
            stages = workloads[run.twin_of].stages
            traces[run.twin_of] = tuple(
                stage_memory(by_stage[i], i, work, frees_on) for i, work in enumerate(stages))
    return tuple(traces[run.twin_of] for run in runs)


def run_pipelines(workloads: list[PipelineWorkload], schedule: PipelineSchedule, virtual: int,
                  network: Network, *, overlap_p2p: bool = True, split_channels: bool = False
                  ) -> tuple[list[PipelineRun], int]:
    """Phase 1: every pipeline's ops with their times, and how many pipelines actually ran.

    Pipelines that share links run together, once per distinct set (same work, same links
    shared the same way); the twins of a set that ran share its result.
    """
    flows = [program.boundary_flows(w, virtual, network, serial_pairs=not split_channels
                                    and not program.runs_torch_calls(
                                        schedule, len(w.stages), w.micro_batches, split_channels))
             for w in workloads]
    runs: dict[int, PipelineRun] = {}
    done: dict[tuple, list[int]] = {}
    simulated = 0
    for members in _coupled_sets(flows):
        local: dict = {}  # links renamed by first use, shared by the set's members
        key = tuple(_signature(workloads[k], flows[k], network, local) for k in members)
        if key in done:
            for k, twin in zip(members, done[key], strict=True):
                runs[k] = PipelineRun(k, runs[twin].ops, runs[twin].twin_of,
                                      runs[twin].critical_path)
            continue
        built = program.build([workloads[k] for k in members], schedule, virtual, network,
                              overlap_p2p=overlap_p2p, split_channels=split_channels)
        timings = engine.run(built.program, network.capacity)
        ops: list[list[OpRecord]] = [[] for _ in members]
        for op, info in enumerate(built.info):
            if info.kind is program.MARKER:
                continue
            ops[built.owner[op]].append(OpRecord(
                info.kind, info.stage, info.chunk, info.micro_batch,
                timings.start_s[op], timings.end_s[op], info.tp_s, info.peer))
        for position, k in enumerate(members):
            ordered = tuple(sorted(ops[position], key=lambda r: (r.start_s, r.stage)))
            path = critical_path(built.info, built.owner, timings, position)
            runs[k] = PipelineRun(k, ordered, k, path)
        simulated += len(members)
        done[key] = members
    return [runs[k] for k in range(len(workloads))], simulated


def _coupled_sets(flows: list[dict]) -> list[list[int]]:
    """Pipelines grouped by the links their transfers share (union-find over resources)."""
    parent = list(range(len(flows)))

    def root(k: int) -> int:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    owner: dict = {}
    for k, pipeline_flows in enumerate(flows):
        for flow in pipeline_flows.values():
            for resource, _ in flow.resources:
                other = owner.setdefault(resource, k)
                parent[root(other)] = root(k)
    sets: dict[int, list[int]] = defaultdict(list)
    for k in range(len(flows)):
        sets[root(k)].append(k)
    return sorted(sets.values())


def _signature(work: PipelineWorkload, flows: dict, network: Network, local: dict) -> tuple:
    """Everything a pipeline's timings depend on, with links renamed by first use in ``local``
    (so a set of pipelines that share links is identical to another with the same pattern)."""
    links = []
    for pair, flow in sorted(flows.items()):
        resources = tuple(
            (local.setdefault(r, len(local)), n, network.capacity[r]) for r, n in flow.resources)
        links.append((pair, flow.lane_bytes, flow.latency_s, flow.cap_bytes_per_s, resources))
    stages = tuple((s.chunks, len(s.devices)) for s in work.stages)
    return stages, work.micro_batches, tuple(links)


def _gradients_and_steps(plan: Plan, cost: CostModel, network: Network,
                         workloads: list[PipelineWorkload], runs: list[PipelineRun]
                         ) -> tuple[list[GradientSync], list[OptimizerStep], StepEnd]:
    """Phase 2: the gradient reductions, then each stage's optimizer step and, under ZeRO-1/2,
    the parameter all-gather, which ends the step, or, under the priority schedule, runs
    into the next step's forward (:class:`StepEnd`)."""
    ready, window = _gradient_ready(runs)
    backward_ends = _backward_ends(runs)
    if not plan.training.execution.overlap_grad_reduce:
        window = ready  # the all-reduce waits for the whole backward pass
    groups = gradient_groups(cost, plan)
    syncs, done_s = [], dict(ready)
    for index, phase in enumerate(gradient_phases(groups)):  # a later phase hides behind none
        syncs += _reduce_phase(phase, network, window if index == 0 else done_s, done_s,
                               backward_ends if index == 0 else {})
    priority = plan.comm.dp_priority_schedule
    norm_s = max(done_s.values())  # the global gradient norm: every gradient reduced
    steps = []
    for k, work in enumerate(workloads):
        for i, stage in enumerate(work.stages):
            start = done_s[(k, i)] if stage.offloaded else norm_s
            steps.append(OptimizerStep(k, i, start, start + stage.optimizer_s))
    gathers: dict[StageRef, float] = {}
    if plan.shards_optimizer:
        gathering = [g for g in groups if g.gathers and len(g.members) > 1]
        gathered = _with_parameter_gather(gathering, network, steps)
        if priority:
            gathers = {(s.pipeline, s.stage): g.end_s - s.end_s
                       for s, g in zip(steps, gathered, strict=True)}
        else:
            steps = gathered
    return syncs, steps, StepEnd(norm_s, gathers)


class StepEnd(NamedTuple):
    """When the global norm is known, and each stage's ZeRO parameter all-gather left for
    the next step's forward (the priority schedule)."""

    norm_s: float
    gathers_s: dict[StageRef, float]


def _next_step_bound_s(plan: Plan, runs: list[PipelineRun], steps: list[OptimizerStep],
                       phase: StepEnd) -> float:
    """The priority schedule's steady-state step (:mod:`potluck.planner.comm.step_overlap`):
    over every stage, when it is ready for the next step (its optimizer step over, an
    offloaded one no earlier than the norm, and the part of its parameter all-gather its
    first forward does not hide) less when the next step's first forward reaches it."""
    end = {(s.pipeline, s.stage): max(s.end_s, phase.norm_s) for s in steps}
    ready, starts = [], []
    for run in runs:
        firsts = _first_forwards(run)
        origin = firsts[0].start_s
        starts.append([op.start_s - origin for op in firsts])
        ready.append([end[(run.index, i)] + gathered_forward_delay_s(
            phase.gathers_s.get((run.index, i), 0.0), op.end_s - op.start_s,
            plan.pipelines[run.index].stages[i].num_layers) for i, op in enumerate(firsts)])
    return next_step_bound_s(ready, starts)


def _first_forwards(run: PipelineRun) -> list[OpRecord]:
    """Each stage's first forward of the step, in stage order."""
    first: dict[int, OpRecord] = {}
    for op in run.ops:  # in start order
        if op.kind is OpKind.FORWARD and op.peer == -1:
            first.setdefault(op.stage, op)
    return [first[i] for i in sorted(first)]


def _reduce_phase(phase: list[GradientGroup], network: Network, window: dict[StageRef, float],
                  done_s: dict[StageRef, float],
                  backward_ends: dict[StageRef, list[float]]) -> list[GradientSync]:
    """One phase of gradient collectives, run together on the engine (they share links).

    A group starts once its members are ready: ``done_s`` (their gradients complete, or
    their earlier phases over), or, overlapping the backward, when its last backward
    started (``window``); it ends no earlier than ``done_s``. A group of ``rounds``
    (ZeRO-2/3) also reduce-scatters after each earlier backward (``backward_ends``).
    Updates ``done_s``."""
    program_ = engine.Program()
    ops: list[list[int]] = []
    for group in phase:
        release = max(done_s[m] if group.after_backward else window[m] for m in group.members)
        flow = network.ring_flow(group.rings, group.bytes_per_ring, group.scatter)
        ids = [program_.add_transfer(flow, [], release_s=release)]
        for round_ in range(group.rounds - 1):
            early = max(_nth(backward_ends.get(m, []), round_, release) for m in group.members)
            ids.append(program_.add_transfer(flow, [], release_s=min(early, release)))
        ops.append(ids)
    timings = engine.run(program_, network.capacity)
    syncs = []
    for ids, group in zip(ops, phase, strict=True):
        end = max(max(timings.end_s[op] for op in ids), max(done_s[m] for m in group.members))
        syncs.append(GradientSync(tuple(group.members), min(timings.start_s[op] for op in ids),
                                  end, tuple(done_s[m] for m in group.members)))
    for sync in syncs:
        for member in sync.members:
            done_s[member] = max(done_s[member], sync.end_s)
    return syncs


def _with_parameter_gather(groups: list[GradientGroup], network: Network, steps: list[OptimizerStep]
                           ) -> list[OptimizerStep]:
    """ZeRO-1: each group all-gathers its owners' updated parameters once all its members
    have stepped (the traffic of a reduce-scatter); a step ends with its gather."""
    end_of = {(s.pipeline, s.stage): s.end_s for s in steps}
    phase = engine.Program()
    for group in groups:
        flow = network.ring_flow(group.rings, group.bytes_per_ring, scatter=True)
        phase.add_transfer(flow, [], release_s=max(end_of[m] for m in group.members))
    timings = engine.run(phase, network.capacity)
    for op, group in enumerate(groups):
        for member in group.members:
            end_of[member] = max(end_of[member], timings.end_s[op])
    return [OptimizerStep(s.pipeline, s.stage, s.start_s, end_of[(s.pipeline, s.stage)])
            for s in steps]


def _nth(values: list[float], index: int, default: float) -> float:
    return values[index] if index < len(values) else default


def _backward_ends(runs: list[PipelineRun]) -> dict[StageRef, list[float]]:
    """Per stage, when each of its backward passes (all but the last) ends, in order."""
    ends: dict[StageRef, list[float]] = defaultdict(list)
    for run in runs:
        for op in run.ops:
            if op.kind in (OpKind.BACKWARD, OpKind.BACKWARD_INPUT) and op.peer == -1:
                ends[(run.index, op.stage)].append(op.end_s)
    return {key: sorted(values)[:-1] for key, values in ends.items()}


def _gradient_ready(runs: list[PipelineRun]
                    ) -> tuple[dict[tuple[int, int], float], dict[tuple[int, int], float]]:
    """Per stage: when its gradients are complete, and when its last gradient op started."""
    ready: dict[tuple[int, int], float] = {}
    window: dict[tuple[int, int], float] = {}
    for run in runs:
        for op in run.ops:
            if op.kind in (OpKind.BACKWARD, OpKind.BACKWARD_WEIGHT):
                key = (run.index, op.stage)
                if op.end_s >= ready.get(key, -1.0):
                    ready[key], window[key] = op.end_s, op.start_s
    return ready, window


def rerank(plans: Sequence[Plan]) -> list[SimulationResult]:
    """Simulate the planner's top candidates; fastest simulated iteration first.

    Where the cost model and the simulator disagree (slow links under 1F1B, shared
    network cards, zero bubble), the simulator is the reference.
    """
    return sorted((simulate(plan) for plan in plans), key=lambda r: r.iteration_time_s)
