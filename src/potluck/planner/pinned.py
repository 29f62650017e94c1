"""Pinned layouts built directly: ``dp`` pipelines of ``pp`` stages of ``tp`` GPUs each.

The family search (:mod:`potluck.planner.families`) lays identical pipelines over
whole node groups and keeps the fastest few per family; a pinned layout may need
pipelines no family holds (a pipeline that spans two GPU types, or families whose
replica counts only add up to the pinned ``--dp`` with options the beam dropped).
This module builds the pinned layout itself: tensor-parallel units taken machine
by machine, the groups ordered by speed (or by memory), dealt pipeline-major, so
that consecutive units of a machine form one pipeline; pipelines with the same
stage types form one family, whose layers are split over the stages in
proportion to speed under memory limits, as everywhere else in the search.

It also says why a pinned layout cannot run (:func:`pinned_refusal`): a schedule
constraint, or the stage that does not fit in memory, with the bytes it needs and
the bytes its device has.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from potluck.cluster.spec import NodeGroup
from potluck.model.counts import Recompute
from potluck.model.spec import ModelSpec
from potluck.planner.cost import StageShape, usable_memory_bytes
from potluck.planner.families import FamilyEvaluator, FamilyOption, FamilySetting
from potluck.planner.formulas import StateSharding
from potluck.planner.options import SearchOptions
from potluck.planner.space import MAX_TP, Unit, tp_options
from potluck.plans.memory import Offload, Swap
from potluck.schedules import schedule_for

GIB = 2**30


@dataclass(frozen=True)
class PinnedShape:
    """One layout the pins allow: ``dp`` pipelines of ``pp`` stages of ``tp`` GPUs."""

    tp: int
    pp: int
    dp: int


def pinned_shapes(groups: tuple[NodeGroup, ...], model: ModelSpec, options: SearchOptions,
                  global_batch: int) -> list[PinnedShape]:
    """Every (tp, pp, dp) the pins allow and the cluster's units hold; an unpinned ``pp``
    takes every depth the model allows, an unpinned ``dp`` as many replicas as the units
    hold and the schedule runs with their share of the batch."""
    schedule = schedule_for(options.pipeline_schedule)
    virtual = schedule.chunks(options.virtual_stages)
    micro_batches = global_batch // (options.micro_batch_size or 1)
    shapes = []
    for tp in _tp_degrees(groups, model, options):
        units = unit_count(groups, model, tp)
        depths = [options.pp] if options.pp else range(1, model.num_layers // virtual + 1)
        for pp in depths:
            widest = min(units // pp, micro_batches)
            runnable = (d for d in range(widest, 0, -1)
                        if schedule.problem(micro_batches // d, pp, virtual) is None)
            dp = options.dp or next(runnable, widest)
            if dp >= 1 and pp * dp <= units:
                shapes.append(PinnedShape(tp, pp, dp))
    return shapes


def _tp_degrees(groups: tuple[NodeGroup, ...], model: ModelSpec,
                options: SearchOptions) -> list[int]:
    if options.tp:
        return [options.tp]
    return sorted({t for g in groups for t in tp_options(g, model, None)})


def unit_count(groups: tuple[NodeGroup, ...], model: ModelSpec, tp: int) -> int:
    """Units of ``tp`` GPUs inside one machine that the groups hold."""
    return sum(g.count * (g.gpus_per_node // tp) for g in groups if tp_options(g, model, tp))


def arrangements(evaluator: FamilyEvaluator, groups: tuple[NodeGroup, ...], model: ModelSpec,
                 shape: PinnedShape) -> list[tuple[tuple[Unit, ...], ...]]:
    """The shape's pipelines over the units, groups ordered fastest first or largest memory
    first (the first stages hold the most activations), machine by machine."""
    spec = evaluator.cluster.spec
    found = []
    speed = evaluator.cost.compute.achievable_flops  # in the dtype each type computes in
    for key in (lambda g: speed(spec.device_type(g.gpu)),
                lambda g: spec.device_type(g.gpu).memory_bytes):
        ordered = sorted(groups, key=lambda g, key=key: (-key(g), g.name))
        units = [u for g in ordered if tp_options(g, model, shape.tp)
                 for u in evaluator.units(g, shape.tp)]
        if len(units) < shape.pp * shape.dp:
            continue
        pipelines = tuple(tuple(units[j * shape.pp:(j + 1) * shape.pp]) for j in range(shape.dp))
        if pipelines not in found:
            found.append(pipelines)
    return found


def pinned_families(evaluator: FamilyEvaluator, pipelines: tuple[tuple[Unit, ...], ...],
                    setting: FamilySetting) -> tuple[FamilyOption, ...] | None:
    """Consecutive pipelines with the same stage types as one family each; None when a
    stage cannot hold its layers in memory."""
    sharing = evaluator.layout_sharing(pipelines)
    families = []
    for _, members in itertools.groupby(pipelines, key=_stage_types):
        same = tuple(members)
        # every pipeline holds each block once: ZeRO-1 shards its states over all of them
        option = evaluator.evaluate_pipelines(same, sharing, len(pipelines), setting,
                                              groups=_stage_types(same[0]), layout="pinned")
        if option is None:
            return None
        families.append(option)
    return tuple(families)


def _stage_types(pipeline: tuple[Unit, ...]) -> tuple[tuple[str, int], ...]:
    return tuple((u.group, u.tp) for u in pipeline)


def pinned_refusal(evaluator: FamilyEvaluator, groups: tuple[NodeGroup, ...],
                   global_batch: int, options: SearchOptions) -> str | None:
    """Why no pinned layout runs, with numbers; None when the pins are not the reason."""
    if options.tp is None and options.pp is None and options.dp is None:
        return None
    cost = evaluator.cost
    schedule = schedule_for(options.pipeline_schedule)
    virtual = schedule.chunks(options.virtual_stages)
    shapes = pinned_shapes(groups, cost.model, options, global_batch)
    if not shapes:
        return None
    memory, schedule_reasons = [], []
    for shape in sorted(shapes, key=lambda s: (-s.pp, -s.tp)):  # most memory to spare first
        problem = _schedule_problem(shape, cost.model.num_layers, global_batch, options, virtual)
        if problem:
            schedule_reasons.append(problem)
            continue
        found = [_memory_problem(evaluator, pipelines, shape, global_batch, options, virtual)
                 for pipelines in arrangements(evaluator, groups, cost.model, shape)]
        if not found or not all(found):
            return None  # a layout that fits: the pins are not the reason
        memory.append(found[0])
    reasons = memory or schedule_reasons[-1:]
    return f"{_pins(options)}: {reasons[0]}" if reasons else None


def _schedule_problem(shape: PinnedShape, num_layers: int, global_batch: int,
                      options: SearchOptions, virtual: int) -> str | None:
    schedule = schedule_for(options.pipeline_schedule)
    micro_batch = options.micro_batch_size or 1
    if shape.pp * virtual > num_layers:
        return (f"schedule {schedule.name.value} runs {virtual} chunks per stage, and "
                f"{shape.pp} stages x {virtual} chunks is more than the model's {num_layers} "
                "layers; pin fewer stages or use schedule 1f1b")
    per_pipeline = global_batch // (shape.dp * micro_batch)
    problem = schedule.problem(per_pipeline, shape.pp, virtual)
    if problem is None:
        return None
    return (f"global batch {global_batch} over {shape.dp} pipelines of micro-batch {micro_batch} "
            f"leaves {per_pipeline} micro-batches per pipeline, and {problem}")


def _memory_problem(evaluator: FamilyEvaluator, pipelines: tuple[tuple[Unit, ...], ...],
                    shape: PinnedShape, global_batch: int, options: SearchOptions,
                    virtual: int) -> str | None:
    """The stage furthest over its memory in an even layer split, in the most frugal
    setting the pins allow (smallest micro-batch, full recomputation, ZeRO-1)."""
    cost = evaluator.cost
    micro_batch = options.micro_batch_size or 1
    recompute = options.recompute or Recompute.FULL
    zero1 = options.zero >= 1 if options.zero is not None else shape.dp > 1
    zero = options.zero if options.zero is not None else int(zero1)
    sharding = StateSharding.of(shape.dp, zero, options.offload is Offload.OPTIMIZER)
    micro_batches = max(1, global_batch // (shape.dp * micro_batch))
    layers = _even_split(cost.model.num_layers, shape.pp)
    worst: tuple[float, str] | None = None
    for pipeline in dict.fromkeys(_stage_types(p) for p in pipelines):
        units = next(p for p in pipelines if _stage_types(p) == pipeline)
        for i, unit in enumerate(units):
            device_type = unit.devices[0].type
            stage = StageShape(layers[i], i == 0, i == shape.pp - 1, shape.pp, micro_batch,
                               recompute)
            in_flight = schedule_for(options.pipeline_schedule).in_flight(i, shape.pp, micro_batches,
                                                                 virtual)
            needed = cost.stage_memory_bytes(device_type, unit.tp, stage, in_flight, sharding)
            usable = usable_memory_bytes(device_type)
            if needed > usable and (worst is None or needed / usable > worst[0]):
                stage_text = (f"stage {i + 1} of {shape.pp} ({_plural(layers[i], 'layer')}, "
                              f"tp {shape.tp}) on {device_type.name}")
                worst = (needed / usable, stage_text, needed, usable, device_type.name)
    if worst is None:
        return None
    _, stage_text, needed, usable, device = worst
    sharded = f", states sharded (ZeRO-{sharding.zero})" if sharding.zero else ""
    sharded += ", optimizer offloaded" if sharding.offload else ""
    hints = [hint for hint, useful in (
        ("more stages (--pp)", shape.pp * virtual < cost.model.num_layers),
        ("a smaller --micro-batch-size", micro_batch > 1),
        ("a larger --tp", shape.tp < MAX_TP),
        ("--zero 1", not zero1 and shape.dp > 1),
        ("--zero 3", (options.zero or 0) < 3 and shape.dp > 1),
        ("--offload optimizer", options.offload is not Offload.OPTIMIZER),
        ("--swap host", options.swap in (None, Swap.NONE) and shape.pp > 1)) if useful]
    return (f"{stage_text} needs {needed / GIB:.1f} GiB at micro-batch {micro_batch} with "
            f"recompute {recompute.value}{sharded}, {device} has {usable / GIB:.1f} GiB usable; "
            "pin "
            f"{', '.join([*hints, 'or drop the pins']) if hints else 'nothing smaller: drop the pins'}")


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _even_split(num_layers: int, pp: int) -> list[int]:
    base, extra = divmod(num_layers, pp)
    return [base + (1 if i < extra else 0) for i in range(pp)]


def _pins(options: SearchOptions) -> str:
    pins = [f"--{name.replace('_', '-')} {getattr(options, name)}"
            for name in ("tp", "pp", "dp", "micro_batch_size") if getattr(options, name)]
    return " ".join(pins)
