"""Exhaustive plan enumeration for small clusters: the reference the search is judged by.

Every way to pick tensor-parallel units (any TP degree per node group), leave
any of them out, group the rest into any number of pipelines and order each
pipeline's stages, for every micro-batch size and recomputation mode. The
layer split of each pipeline and the micro-batch split over pipelines are
solved exactly (min-max, :mod:`potluck.planner.partition`, itself tested
against brute force); every resulting plan is scored by the full cost model.
Pipelines here need not be identical, which the search's families assume:
that is what this reference checks. The count grows like the ordered set
partitions of the units, so keep to about eight units.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from dataclasses import replace

from potluck.cluster.spec import ClusterSpec
from potluck.cluster.topology import Cluster
from potluck.model.counts import Recompute
from potluck.model.spec import ModelSpec
from potluck.planner.comm.refine import refine_comm
from potluck.planner.cost import CostModel
from potluck.planner.evaluate import predict
from potluck.planner.families import FamilyEvaluator, FamilyOption, FamilySetting
from potluck.planner.partition import PipelineSlot, split_micro_batches
from potluck.planner.space import Unit, tp_options
from potluck.plans import Pipeline, Plan, Stage, TrainingShape
from potluck.schedules import Schedule, schedule_for

REFINED = 16  # per micro-batch size, the fastest plans without communication scheduling
# that get it (sub-batches need a micro-batch they divide: TP overlap can make a micro-batch
# size win that loses without it)


def arrangements(units: list[Unit]) -> Iterator[tuple[tuple[Unit, ...], ...]]:
    """Every set of non-empty ordered pipelines over a subset of ``units``."""
    def place(index: int, pipelines: list[list[Unit]]) -> Iterator[list[list[Unit]]]:
        if index == len(units):
            yield pipelines
            return
        unit = units[index]
        yield from place(index + 1, pipelines)
        yield from place(index + 1, [*pipelines, [unit]])
        for k, pipeline in enumerate(pipelines):
            for position in range(len(pipeline) + 1):
                changed = [*pipeline[:position], unit, *pipeline[position:]]
                yield from place(index + 1, [*pipelines[:k], changed, *pipelines[k + 1:]])

    for pipelines in place(0, []):
        if pipelines:
            yield tuple(tuple(p) for p in pipelines)


def exhaustive_best(spec: ClusterSpec, model: ModelSpec, training: TrainingShape,
                    micro_batch_sizes: tuple[int, ...] = (1, 2, 4),
                    recomputes: tuple[Recompute, ...] = tuple(Recompute),
                    group_tp: dict[str, int] | None = None) -> Plan | None:
    """The fastest plan over the whole enumerated space, or None if nothing fits.
    ``group_tp`` pins the TP degree of some node groups (to keep the space small). Every
    plan is scored without communication scheduling; the best :data:`REFINED` of each
    micro-batch size are then given it where it pays (:func:`~potluck.planner.comm.refine.refine_comm`, as the
    search does), and the fastest of those is the reference."""
    cluster = Cluster(spec)
    cost = CostModel.for_training(cluster, model, training)
    families = FamilyEvaluator(cluster, cost)
    best: dict[int, list[tuple[float, int, Plan]]] = {}  # per micro-batch size, a max-heap
    for units in _unit_choices(cluster, families, model, group_tp or {}):
        for arrangement in arrangements(units):
            for b, recompute in itertools.product(micro_batch_sizes, recomputes):
                if training.global_batch % b:
                    continue
                plan = _best_plan(cluster, cost, families, training, arrangement, b, recompute)
                if plan is not None:
                    _keep(best.setdefault(b, []), plan)
    refined = [refine_comm(plan, cost) for heap in best.values() for _, _, plan in heap]
    scored = [plan for plan in refined if plan]
    return min(scored, key=lambda plan: plan.prediction.iteration_time_s, default=None)


def _keep(heap: list[tuple[float, int, Plan]], plan: Plan) -> None:
    """Keep ``plan`` in ``heap`` if it is among the :data:`REFINED` fastest."""
    item = (-plan.prediction.iteration_time_s, id(plan), plan)
    if len(heap) < REFINED:
        heapq.heappush(heap, item)
    elif item[0] > heap[0][0]:
        heapq.heapreplace(heap, item)


def fitting_shapes(spec: ClusterSpec, model: ModelSpec, training: TrainingShape,
                   micro_batch_sizes: tuple[int, ...] = (1, 2, 4),
                   recomputes: tuple[Recompute, ...] = tuple(Recompute)) -> set[tuple[int, ...]]:
    """Every ``(tp, pp, dp, micro-batch size)`` that some enumerated plan with one TP degree
    and pipelines of one depth runs in memory: the pinned layouts the search must plan."""
    cluster = Cluster(spec)
    cost = CostModel.for_training(cluster, model, training)
    families = FamilyEvaluator(cluster, cost)
    found: set[tuple[int, ...]] = set()
    for tp in sorted({t for g in spec.nodes for t in tp_options(g, model, None)}):
        units = [u for g in spec.nodes if tp_options(g, model, tp) for u in families.units(g, tp)]
        for arrangement in arrangements(units):
            pp = len(arrangement[0])
            if any(len(p) != pp for p in arrangement):
                continue
            for b in micro_batch_sizes:
                key = (tp, pp, len(arrangement), b)
                if key not in found and training.global_batch % b == 0 and any(
                        _best_plan(cluster, cost, families, training, arrangement, b, recompute)
                        for recompute in recomputes):
                    found.add(key)
    return found


def _unit_choices(cluster: Cluster, families: FamilyEvaluator, model: ModelSpec,
                  group_tp: dict[str, int]) -> Iterator[list[Unit]]:
    groups = cluster.spec.nodes
    for tps in itertools.product(*(tp_options(g, model, group_tp.get(g.name)) for g in groups)):
        yield [u for g, tp in zip(groups, tps, strict=True) for u in families.units(g, tp)]


def _best_plan(cluster: Cluster, cost: CostModel, families: FamilyEvaluator,
               training: TrainingShape, arrangement: tuple[tuple[Unit, ...], ...], b: int,
               recompute: Recompute) -> Plan | None:
    setting = FamilySetting(b, recompute, Schedule.ONE_F_ONE_B, 1, False, False,
                            training.global_batch // b)
    sharing = families.layout_sharing(arrangement)
    options: list[FamilyOption] = []
    for pipeline in arrangement:
        option = families.evaluate_pipelines((pipeline,), sharing, len(arrangement), setting)
        if option is None:
            return None
        options.append(option)
    slots = [PipelineSlot(o.fill_s, o.period_s) for o in options]
    shares = split_micro_batches(slots, setting.micro_batches)
    if shares is None or any(s[0] == 0 for s in shares):
        return None
    schedule = schedule_for(setting.schedule)
    if not all(schedule.accepts(s[0], o.pp) for o, s in zip(options, shares, strict=True)):
        return None
    pipelines = tuple(
        Pipeline(_stages(o), b, share[0]) for o, share in zip(options, shares, strict=True)
    )
    used = {d for p in pipelines for d in p.devices}
    plan = Plan(cluster.spec, cost.model, training, pipelines, recompute=recompute,
                unused_devices=tuple(d.id for d in cluster.devices if d.id not in used))
    return replace(plan, prediction=predict(plan, cost))


def _stages(option: FamilyOption) -> tuple[Stage, ...]:
    stages, start = [], 0
    for unit, layers in zip(option.pipelines[0], option.layers, strict=True):
        stages.append(Stage(tuple(d.id for d in unit.devices), ((start, start + layers),)))
        start += layers
    return tuple(stages)
