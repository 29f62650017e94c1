"""Heterogeneity-aware plan search.

The search walks a structured space and scores every candidate with the one
cost model:

1. for each recomputation mode and micro-batch size,
2. for each subset of node groups forming a *family* of identical pipelines
   (a family may mix GPU types along its pipelines), each stage order, TP
   degree per group, replica count and unit layout, split the blocks over the
   stages in proportion to stage speed under memory limits
   (:mod:`potluck.planner.families`) and keep the best few;
3. for each way to use a subset of the groups as one or more families side by
   side, split the micro-batches over all pipelines in proportion to their
   speed (:mod:`potluck.planner.partition`) and rank by a quick estimate;
4. with ``pp`` and ``dp`` pinned, or when no family holds a pinned layout, add that
   layout built directly (:mod:`potluck.planner.pinned`: its pipelines may span
   GPU types and need not be identical);
5. with ``Placement.RANK_ORDER`` (how Megatron-LM and DeepSpeed place ranks), only
   layouts in the framework's rank order with an even split
   (:mod:`potluck.planner.rank_order`) replace steps 2-4;
6. build the best candidates as Plans, give every stage its own memory choices
   (:mod:`potluck.planner.memory.refine`: the fewest recomputed or swapped blocks that fit,
   peer, host or hybrid swaps, optimizer offload) and rank them with the full cost
   model (network cards shared, every gradient ring priced), dropping those over a
   device's or a machine's host memory.

All of it runs at one *memory level* after the other (:func:`memory_levels`: no
sharding, ZeRO-1, 2, 3, then each with the optimizer offloaded), stopping at the first
that yields plans: sharding and offload cost time, so they are used only where the
levels before them do not fit; swapping and per-stage recomputation are chosen inside
every level where they pay. On clusters of up to 64 GPUs the search goes on through the
ZeRO stages (never on to offload) while its best plan pays time for memory or the last
stage improved it (:func:`_seeks_sharded_layouts`): sharded states may fit a faster
layout. Families may also assume every stage swaps its blocks'
activations (``FamilySetting.swap``), which lays out plans that fit only so.

Groups left out of every family, and pipelines that get no micro-batch, are
devices the plan does not use: the search leaves a device out when that is
faster. Any dimension can be pinned; ``partition=uniform`` forces the
Megatron-style baseline: every device used, one TP degree, layers and batch
split evenly.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

from potluck.cluster.spec import ClusterSpec, NodeGroup
from potluck.cluster.topology import Cluster
from potluck.errors import InfeasibleError
from potluck.model import counts
from potluck.model.counts import Recompute
from potluck.model.spec import ModelSpec
from potluck.planner.checks import check_request, explain_infeasible
from potluck.planner.comm.refine import refine_comm
from potluck.planner.cost import CostModel, StageShape
from potluck.planner.families import FamilyEvaluator, FamilyOption, FamilySetting
from potluck.planner.formulas import NOT_SHARDED, StateSharding
from potluck.planner.grouping import (
    EXHAUSTIVE_GROUPINGS,
    Grouping,
    all_groupings,
    canonical,
    greedy_seed,
    grouping_count,
    local_search,
    memoized,
)
from potluck.planner.memory.refine import refine_memory
from potluck.planner.options import Partition, SearchOptions, micro_batch_sizes
from potluck.planner.partition import PipelineSlot, split_micro_batches
from potluck.planner.pinned import arrangements, pinned_families, pinned_refusal, pinned_shapes
from potluck.planner.rank_order import (
    launch_orders,
    rank_order_pipelines,
    rank_order_refusal,
    rank_order_shapes,
)
from potluck.planner.space import (
    Unit,
    UnitLayout,
    Wrap,
    dp_candidates,
    machine_subsets,
    stage_orders,
    tp_options,
)
from potluck.plans import (
    Pipeline,
    Placement,
    Plan,
    Stage,
    TrainingShape,
    expert_parallel_problem,
    zero3_problem,
)
from potluck.plans.feasibility import zero3_schedule_problem
from potluck.plans.memory import Offload, Swap
from potluck.schedules import schedule_for

log = logging.getLogger(__name__)

TP_CHOICES_IN_PAIRS = 2  # TP degrees per group in mixed families of up to three groups (one beyond)
SMALL_CLUSTER_GPUS = 64  # up to this size mixed families try every order of their groups
COMBINED_OPTIONS = 16  # option choices per grouping tried in full by the local search
SEEDED_ROUNDS = 1  # moves around the last memory level's best groupings at the next level


@dataclass(frozen=True)
class SearchResult:
    """The best plans, best first, each with its prediction."""

    plans: tuple[Plan, ...]
    candidates: int
    search_time_s: float
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def best(self) -> Plan:
        return self.plans[0]


@dataclass(frozen=True)
class _Combo:
    """One candidate: families side by side with their micro-batches per pipeline."""

    quick_s: float
    setting: FamilySetting
    families: tuple[FamilyOption, ...]
    shares: tuple[tuple[int, ...], ...]


def search(spec: ClusterSpec, model: ModelSpec, training: TrainingShape,
           options: SearchOptions | None = None,
           progress: Callable[[float], None] | None = None) -> SearchResult:
    """Find the fastest plans for training ``model`` on ``spec`` with ``training``."""
    options = options or SearchOptions()
    started = time.perf_counter()
    cluster = Cluster(spec)
    check_request(cluster, model, training, options)
    cost = CostModel.for_training(cluster, model, training)
    candidates = 0
    found: list[Plan] = []
    groupings: dict[tuple, list[Grouping]] = {}  # the best of the last level with plans
    levels, runs = memory_levels(options), _runs(cluster, model, options)
    families = FamilyEvaluator(cluster, cost)  # one for every level: families recur in each
    for index, level in enumerate(levels):
        if found and level.swap_families:
            continue  # layouts that fit only by swapping: for when nothing else fits
        plans: list[Plan] = []
        for run, pinned in enumerate(runs):
            share = _share(progress, (index * len(runs) + run) / (len(levels) * len(runs)),
                           1 / (len(levels) * len(runs)))
            runner = _Search(cluster, cost, training, pinned, share,
                             groupings.get(_run_key(pinned), []), families)
            plans.extend(runner.run(level))
            candidates += runner.candidates
            if runner.best_groupings:
                groupings[_run_key(pinned)] = runner.best_groupings
        found += plans
        if found and not (_seeks_expert_layouts(found, model, options, level)
                          or _seeks_sharded_layouts(cost, options, level, found, plans)):
            found.sort(key=_rank)
            best = tuple(_distinct(found, options.top_k))
            return SearchResult(best, candidates, time.perf_counter() - started)
    if found:
        found.sort(key=_rank)
        return SearchResult(tuple(_distinct(found, options.top_k)), candidates,
                            time.perf_counter() - started)
    runner = _Search(cluster, cost, training, options, progress)
    reason = runner.refusal()
    raise InfeasibleError(reason or explain_infeasible(cluster, model, training, options))


def _share(progress: Callable[[float], None] | None, start: float, width: float
           ) -> Callable[[float], None] | None:
    """``progress`` for one pass of the search: its fraction ``f`` of the pass reported as
    ``start + f * width`` of every pass the search may run (it stops at the first memory
    level whose plans the next could not better, so the whole is a bound)."""
    if progress is None:
        return None
    return lambda fraction: progress(start + fraction * width)


@dataclass(frozen=True)
class MemoryLevel:
    """How hard a search pass works to fit: the ZeRO stage and whether stages may offload."""

    zero: int
    offload: bool
    swap_families: bool = False  # families laid out as if every stage swapped its blocks


def memory_levels(options: SearchOptions) -> list[MemoryLevel]:
    """The levels the search tries in turn, stopping at the first that yields plans (or
    later: :func:`_seeks_sharded_layouts`, :func:`_seeks_expert_layouts`): no
    sharding, then ZeRO-1, 2 and 3, then each again with the optimizer offloaded (each
    costs time, so it is used only where the levels before it do not fit); a pin keeps
    only its own. Within a level, layouts that fit only if their stages swap come after
    those that fit without (the per-stage refinement swaps in both where it pays)."""
    zeros = [options.zero] if options.zero is not None else [0, 1, 2, 3]
    offloads = ([options.offload is Offload.OPTIMIZER] if options.offload is not None
                else [False, True])
    swaps = {None: [False, True], Swap.NONE: [False]}.get(options.swap, [True])
    return [MemoryLevel(z, o, w) for o in offloads for z in zeros for w in swaps]


def _runs(cluster: Cluster, model: ModelSpec, options: SearchOptions) -> list[SearchOptions]:
    """The uniform baseline is Megatron's layout: one TP degree for every stage."""
    if options.partition is not Partition.UNIFORM or options.tp is not None:
        return [options]
    degrees = sorted({t for g in cluster.spec.nodes for t in tp_options(g, model, None)})
    return [replace(options, tp=t) for t in degrees]


def _run_key(options: SearchOptions) -> tuple:
    return (options.tp,)  # the uniform baseline's runs differ by their TP degree


class _Search:
    def __init__(self, cluster: Cluster, cost: CostModel, training: TrainingShape,
                 options: SearchOptions, progress: Callable[[float], None] | None,
                 seeds: list[Grouping] | None = None,
                 families: FamilyEvaluator | None = None) -> None:
        self.cluster = cluster
        self.cost = cost
        self.training = training
        self.options = options
        self.progress = progress
        self.families = families or FamilyEvaluator(cluster, cost)
        self.groups = tuple(
            g for g in cluster.spec.nodes if options.groups is None or g.name in options.groups
        )
        self.candidates = 0
        # every stage order of a mixed family where that stays cheap: small clusters
        small = cluster.spec.num_gpus <= SMALL_CLUSTER_GPUS
        self._exhaustive_orders = 4 if small else 2
        self._by_machines = small  # families: the best TP choice on each machine subset
        # mixed families (labs): start also at one degree throughout, descend over the degrees
        self._descends = small
        self._best_tps: dict[tuple[str, FamilySetting], list[int]] = {}
        # each group's degree in the last mixed family's descent: where the next one starts
        self._tp_hints: dict[tuple[str, FamilySetting], int] = {}
        self.rank_order = cost.execution.placement is Placement.RANK_ORDER
        # the local search starts from these when given (the previous memory level's best:
        # a further ZeRO stage moves the best groupings little), and records its own
        self.seeds = list(seeds or [])
        self.best_groupings: list[Grouping] = []

    def refusal(self) -> str | None:
        """Why the pins (or the rank order) leave no layout, with numbers; None if unknown."""
        batch = self.training.global_batch
        if self.rank_order:
            orders = launch_orders(self.cluster, self.options, self.cost.compute.achievable_flops)
            return rank_order_refusal(orders, self.cost.model,
                                      self.options, batch)
        return pinned_refusal(self.families, self.groups, batch, self.options)

    def run(self, level: MemoryLevel) -> list[Plan]:
        """Two passes: find promising structures at the smallest micro-batch that fits, then
        score those structures at every micro-batch size and recomputation mode. In rank
        order, only the framework's layouts."""
        heap: list[tuple[float, int, _Combo]] = []
        if self.rank_order:
            self._push_layouts(level, heap, self._rank_order_layouts())
            self._report(0.5)
            return self._plans(heap, level, 0.5)
        structures = self._promising_structures(level)
        recomputes = self._recomputes()
        for index, recompute in enumerate(recomputes):
            for setting in self._settings(level, recompute):
                for structure in structures:
                    combo = self._rebuild(structure, setting)
                    if combo is not None:
                        self._push(heap, combo)
            self._report(0.6 + 0.2 * (index + 1) / len(recomputes))
        if self._fully_pinned() or (not heap and self._pinned_shape()):
            self._push_pinned_layouts(level, heap)
        return self._plans(heap, level, 0.8)

    def _report(self, fraction: float) -> None:
        """This pass's ``fraction`` done, to the progress callback if there is one."""
        if self.progress:
            self.progress(fraction)

    def _plans(self, heap: list, level: MemoryLevel, done: float) -> list[Plan]:
        """The best combos built as plans, each stage given its lightest memory choice
        (:func:`~potluck.planner.memory.refine.refine_memory`) and its communication scheduling
        (:func:`~potluck.planner.comm.refine.refine_comm`), priced by the full cost model; plans
        over a device's or a machine's host memory are dropped. ``done``: the fraction of the
        pass done before (progress)."""
        combos = sorted((item[2] for item in heap), key=lambda c: c.quick_s)
        plans = []
        for index, combo in enumerate(combos):
            self._report(done + (1 - done) * index / len(combos))
            plan = refine_memory(self._build(combo), self.cost, self._refining(combo),
                                 level.offload)
            if plan is None or zero3_problem(plan) or expert_parallel_problem(plan):
                continue  # replicas no longer alike or in lockstep
            plan = refine_comm(plan, self.cost)  # predicted, and None where it cannot fit
            if plan is not None:
                plans.append(plan)
        plans.sort(key=_rank)
        return _distinct(plans, self.options.top_k)

    def _fully_pinned(self) -> bool:
        return bool(self.options.pp and self.options.dp)

    def _pinned_shape(self) -> bool:
        options = self.options
        return any(v is not None for v in (options.tp, options.pp, options.dp,
                                           options.micro_batch_size))

    def _refining(self, combo: _Combo) -> SearchOptions:
        """What the per-stage refinement may choose: everything not pinned, except for the
        frameworks' baselines (``partition=uniform``, rank order), which recompute alike on
        every stage (Megatron-LM's ``--recompute-granularity``) and do not swap unless
        pinned to."""
        if not (self.options.partition is Partition.UNIFORM or self.rank_order):
            return self.options
        return replace(self.options, recompute=self.options.recompute or combo.setting.recompute,
                       swap=self.options.swap or Swap.NONE)

    def _push_pinned_layouts(self, level: MemoryLevel, heap: list) -> None:
        """The pinned layout built directly (:mod:`potluck.planner.pinned`): pipelines the
        families do not hold, such as one spanning two GPU types."""
        if self.options.group_tp:
            return  # TP pinned per group: the families' layouts only
        model = self.cost.model
        layouts = [pipelines
                   for shape in pinned_shapes(self.groups, model, self.options,
                                              self.training.global_batch)
                   for pipelines in arrangements(self.families, self.groups, model, shape)]
        self._push_layouts(level, heap, layouts)

    def _rank_order_layouts(self) -> list[tuple[tuple[Unit, ...], ...]]:
        """Every (tp, pp, dp) the pins allow, laid out in the framework's rank order."""
        layouts = []
        for devices in launch_orders(self.cluster, self.options,
                                     self.cost.compute.achievable_flops):
            shapes = rank_order_shapes(devices, self.cost.model, self.options,
                                       self.training.global_batch)
            layouts += [rank_order_pipelines(devices, shape) for shape in shapes]
        return list(dict.fromkeys(layouts))

    def _push_layouts(self, level: MemoryLevel, heap: list,
                      layouts: list[tuple[tuple[Unit, ...], ...]]) -> None:
        for recompute in self._recomputes():
            for setting in self._settings(level, recompute):
                for pipelines in layouts:
                    for combo in self._pinned_combos(pipelines, setting):
                        self._push(heap, combo)

    def _pinned_combos(self, pipelines: tuple[tuple[Unit, ...], ...],
                       setting: FamilySetting) -> list[_Combo]:
        """The layout with its memory checked for the whole batch in flight (the families'
        bound), and for an even share of it, the split then kept to that share (what
        GPipe, which holds every micro-batch of its pipeline, needs to fit)."""
        even = -(-setting.micro_batches // len(pipelines))
        found = []
        for most in dict.fromkeys((setting.micro_batches, even)):
            families = pinned_families(self.families, pipelines,
                                       replace(setting, micro_batches=most))
            combo = self._combine(setting, families, most) if families else None
            if combo is not None:
                found.append(combo)
        return found

    def _promising_structures(self, level: MemoryLevel) -> list[tuple[tuple, ...]]:
        heap: list[tuple[float, int, _Combo]] = []
        recomputes = self._recomputes()
        for index, recompute in enumerate(recomputes):
            shown: set[int] = set()  # expert-parallel degrees whose structures are shown
            for setting in self._settings(level, recompute):
                if setting.ep not in shown and self._collect(setting, heap) < float("inf"):
                    shown.add(setting.ep)  # the smallest micro-batch that fits shows them
            self._report(0.6 * (index + 1) / len(recomputes))
        structures = {tuple(f.key for f in item[2].families) for item in heap}
        return sorted(structures, key=repr)

    def _rebuild(self, structure: tuple[tuple, ...], setting: FamilySetting) -> _Combo | None:
        families = []
        for order, dp, layout, wrap in structure:
            option = self.families.evaluate(order, dp, layout, setting, wrap)
            if option is None:
                return None
            families.append(option)
        return self._combine(setting, tuple(families))

    def _collect(self, setting: FamilySetting, heap: list) -> float:
        """Score groupings of the node groups (:mod:`potluck.planner.grouping`) into the heap,
        every one on a lab of a few groups, else by local search; the best quick time."""
        names = tuple(g.name for g in self.groups)
        complete = setting.uniform  # the uniform baseline uses every device, as Megatron would
        families: dict[tuple, list[FamilyOption]] = {}
        if grouping_count(len(names)) <= EXHAUSTIVE_GROUPINGS:
            return min((self._score(g, setting, heap, families, None)
                        for g in all_groupings(names, complete)), default=math.inf)
        for name in names:  # each group alone first: mixed families take their best TP degrees
            self._options_of((name,), setting, families)

        @memoized
        def score(grouping: Grouping) -> float:  # mixed families in their first order only
            return self._score(grouping, setting, heap, families, COMBINED_OPTIONS, False)

        seeds = self.seeds or self._seeds(names, score, families, complete)
        found = local_search(names, score, seeds, complete=complete,
                             rounds=SEEDED_ROUNDS if self.seeds else None)
        self.best_groupings += [g for _, g in found if g not in self.best_groupings]
        return min((self._score(g, setting, heap, families, COMBINED_OPTIONS)
                    for _, g in found), default=math.inf)

    def _seeds(self, names: tuple[str, ...], score: Callable[[Grouping], float],
               families: dict, complete: bool) -> list[Grouping]:
        """Where the local search starts: every group in one family, every group a family
        of its own (those that train alone; every group when all must be used), each group
        that trains alone by itself (on slow networks one machine often beats them all),
        and the groups inserted fastest first where they score best."""
        alone = [n for n in names if complete or families[((n,), True)]]
        seeds = [canonical([names]), canonical([(n,) for n in alone])]
        if not complete:
            seeds += [((n,),) for n in alone]
            speed = {g.name: g.num_gpus * self.cost.compute.achievable_flops(
                self.cluster.spec.device_type(g.gpu)) for g in self.groups}
            seeds.append(greedy_seed(tuple(sorted(names, key=lambda n: (-speed[n], n))), score))
        return seeds

    def _options_of(self, family: tuple[str, ...], setting: FamilySetting,
                    families: dict[tuple, list[FamilyOption]], thorough: bool = True
                    ) -> list[FamilyOption]:
        """A family's options (memoized): ``thorough``, every order and a descent over TP
        degrees; else its first order at the starting degrees (how the local search compares
        groupings; the best it finds are then scored thoroughly)."""
        if (family, True) in families:
            return families[(family, True)]
        if (family, thorough) not in families:
            groups = {g.name: g for g in self.groups}
            families[(family, thorough)] = self._family_options(
                tuple(groups[n] for n in family), setting, thorough)
        return families[(family, thorough)]

    def _score(self, grouping: Grouping, setting: FamilySetting, heap: list,
               families: dict[tuple, list[FamilyOption]], limit: int | None,
               thorough: bool = True) -> float:
        """Every combination of the grouping's family options (at most about ``limit``: the
        best of each, and each family's others beside the rest's best) pushed into the heap;
        the best quick time, infinite when none is feasible."""
        lists = [self._options_of(family, setting, families, thorough) for family in grouping]
        best = math.inf
        for chosen in _combinations(lists, limit):
            combo = self._combine(setting, chosen)
            if combo is not None:
                best = min(best, combo.quick_s)
                self._push(heap, combo, self.options.structure_beam)
        return best

    def _push(self, heap: list, combo: _Combo, beam: int | None = None) -> None:
        self.candidates += 1
        item = (-combo.quick_s, self.candidates, combo)
        if len(heap) < (beam or self.options.exact_beam):
            heapq.heappush(heap, item)
        elif combo.quick_s < -heap[0][0]:
            heapq.heapreplace(heap, item)

    def _recomputes(self) -> list[Recompute]:
        """With flash attention, plan-wide selective recomputation is not tried: under fused
        kernels it is what the kernel does anyway (the same plan as none); under eager
        execution it costs the attention module's projections, and the search's memory
        levels (full recomputation of some blocks, swapping) fit tight stages at less cost
        than that in the cases measured (benchmarks/plan_quality.py)."""
        if self.options.recompute:
            return [self.options.recompute]
        if self.cost.flash_attention:
            return [Recompute.NONE, Recompute.FULL]
        return list(Recompute)

    def _settings(self, level: MemoryLevel, recompute: Recompute):
        """Per micro-batch size the families' settings; at a level of swap families, every
        block's activations swappable (recomputation none: swapping stands in for it; or
        the pinned mode)."""
        options, batch = self.options, self.training.global_batch
        sizes = micro_batch_sizes(options, batch)
        virtual = schedule_for(options.pipeline_schedule).chunks(options.virtual_stages)
        uniform = options.partition is Partition.UNIFORM or self.rank_order
        swap = level.swap_families and (recompute is Recompute.NONE or bool(options.recompute))
        if level.swap_families and not swap:
            return  # swapping stands in for recomputation: its families recompute nothing
        least = options.recompute is None and not uniform  # the refinement picks per stage
        for ep in expert_degrees(self.cost.model, options, self.cluster.spec.num_gpus):
            for b in sizes:
                yield FamilySetting(b, recompute, options.pipeline_schedule, virtual, level.zero,
                                    uniform, batch // b, level.offload, swap, ep, least)

    def _family_options(self, family: tuple[NodeGroup, ...], setting: FamilySetting,
                        thorough: bool = True) -> list[FamilyOption]:
        options = self.options
        memory = {g.name: self.cost.cluster.spec.device_type(g.gpu).memory_bytes for g in family}
        speed = {g.name: self.cost.compute.achievable_flops(self.cost.cluster.spec.device_type(g.gpu))
                 for g in family}
        found: list[FamilyOption] = []
        orders = stage_orders(family, memory, speed, self._exhaustive_orders)
        if len(family) == 1 and not setting.uniform:
            orders = [(sub,) for sub in machine_subsets(family[0])]
        elif not thorough:
            orders = orders[:1]
        found = self._over_orders_and_degrees(orders, setting, thorough)
        found.sort(key=lambda f: _family_quick_s(f, setting))
        if len(family) == 1:
            self._best_tps[(family[0].name, setting)] = list(
                dict.fromkeys(tp for f in found for _, tp in f.groups))
        return _beam_with_every_tp(found, options.family_beam, self._by_machines)

    def _over_orders_and_degrees(self, orders: list[tuple[NodeGroup, ...]],
                                 setting: FamilySetting, descend: bool = True
                                 ) -> list[FamilyOption]:
        """A family's layouts: every order at each starting vector of TP degrees
        (:meth:`_tp_vectors`); in a mixed family then, from the best of them, one group's
        degree changed at a time while that makes the family faster, and the vector found
        tried in every order. Wrap-around orders are tried for each order's best vector
        (they move a few units to the far end, not the degrees' balance)."""
        tried: dict[tuple, list[FamilyOption]] = {}

        def layouts(order: tuple[NodeGroup, ...], vector: tuple[int, ...],
                    wraps: bool = False) -> list[FamilyOption]:
            if (order, vector, wraps) not in tried:
                tried[(order, vector, wraps)] = self._family_layouts(
                    tuple(zip(order, vector, strict=True)), setting, wraps)
            return tried[(order, vector, wraps)]

        def quick_s(order: tuple[NodeGroup, ...], vector: tuple[int, ...]) -> float:
            return min((_family_quick_s(f, setting) for f in layouts(order, vector)),
                       default=math.inf)

        allowed = {g.name: tp_options(g, self.cost.model, self._pinned_tp(g)) for g in orders[0]}
        first = orders[0]  # every starting vector in one order, the best two in every order
        starts = self._tp_vectors(first, [allowed[g.name] for g in first], setting)
        if len(first) == 1:  # one group's machine subsets: each its own fastest degree
            for order, vector in itertools.product(orders, starts):
                layouts(order, vector, wraps=True)
            return list({f.key: f for options in tried.values() for f in options}.values())
        ranked = sorted(starts, key=lambda v: quick_s(first, v))[:2]
        if not ranked:
            return []
        names = [g.name for g in first]
        best_of = {}
        for order in orders:
            vectors = [tuple(dict(zip(names, v, strict=True))[g.name] for g in order)
                       for v in ranked]
            best_of[order] = min(vectors, key=lambda v, o=order: quick_s(o, v))
        order = min(best_of, key=lambda o: quick_s(o, best_of[o]))
        if (descend and self._descends and len(order) > 1
                and math.isfinite(quick_s(order, best_of[order]))):
            found = self._descend(best_of[order], [allowed[g.name] for g in order],
                                  lambda vector: quick_s(order, vector))
            by_name = dict(zip((g.name for g in order), found, strict=True))
            self._tp_hints.update({(name, setting): t for name, t in by_name.items()})
            for other in orders:
                layouts(other, tuple(by_name[g.name] for g in other), wraps=True)
        for other, vector in best_of.items():
            layouts(other, vector, wraps=True)
        return list({f.key: f for options in tried.values() for f in options}.values())

    @staticmethod
    def _descend(vector: tuple[int, ...], allowed: list[list[int]],
                 quick_s: Callable[[tuple[int, ...]], float]) -> tuple[int, ...]:
        """From ``vector``, one group's TP degree changed at a time, each change taken as soon
        as it is faster, until a whole round of changes finds none."""
        steps = [(i, t) for i, degrees in enumerate(allowed) for t in degrees]
        unchanged, k = 0, 0
        while unchanged < len(steps):
            i, degree = steps[k % len(steps)]
            k, unchanged = k + 1, unchanged + 1
            if degree != vector[i]:
                step = (*vector[:i], degree, *vector[i + 1:])
                if quick_s(step) < quick_s(vector):
                    vector, unchanged = step, 0
        return vector

    def _tp_vectors(self, order: tuple[NodeGroup, ...], allowed: list[list[int]],
                    setting: FamilySetting) -> list[tuple[int, ...]]:
        """Where a family's TP degrees start: alone, every allowed degree; in mixed families,
        the degrees that served each group best on its own (two each up to three groups, one
        beyond; where a group cannot train alone, all of them up to three groups, its
        smallest beyond), and the family at one degree throughout, each group at the allowed
        degree nearest it (a long pipeline over many groups often runs fastest at tp=1
        where each group alone wants more: the 13B lab of issue 29 planned 48.9 s at
        tp=[1,2] against 42.7 s at tp=1)."""
        if len(order) == 1:
            return [(t,) for t in allowed[0]]
        choices = [self._tp_choices(g, a, setting, len(order)) for g, a in zip(order, allowed,
                                                                                strict=True)]
        vectors = list(itertools.product(*choices))
        if not self._descends:  # large clusters: the degrees each group chose alone
            return list(dict.fromkeys(v for v in vectors if all(v)))
        for degree in sorted({t for degrees in allowed for t in degrees}):
            vectors.append(tuple(_nearest(degrees, degree) for degrees in allowed))
        hinted = [self._tp_hints.get((g.name, setting)) for g in order]
        vectors.append(tuple(h if h in a else (c or [0])[0]
                             for h, a, c in zip(hinted, allowed, choices, strict=True)))
        return list(dict.fromkeys(v for v in vectors if all(v)))

    def _tp_choices(self, group: NodeGroup, allowed: list[int], setting: FamilySetting,
                    family_size: int) -> list[int]:
        """A group's TP degrees in a mixed family (see :meth:`_tp_vectors`)."""
        alone = self._best_tps.get((group.name, setting))
        if not alone:
            return allowed if family_size <= 3 else allowed[:1]
        return alone[:TP_CHOICES_IN_PAIRS if family_size <= 3 else 1]

    def _family_layouts(self, order: tuple[tuple[NodeGroup, int], ...],
                        setting: FamilySetting, wraps: bool = True) -> list[FamilyOption]:
        counts = [len(self.families.units(g, tp)) for g, tp in order]
        found = []
        for dp in dp_candidates(counts, setting.micro_batches):
            if setting.uniform and any(count % dp for count in counts):
                continue
            pp = sum(count // dp for count in counts)
            if pp * setting.virtual_stages > self.cost.model.num_layers:
                continue
            if (self.options.pp and pp != self.options.pp) or (self.options.dp and dp > self.options.dp):
                continue
            layouts = tuple(UnitLayout) if dp > 1 and pp > 1 else (UnitLayout.PIPELINE,)
            ends = self._wraps(len(order)) if pp > 2 and wraps else (Wrap.NONE,)
            options = [self.families.evaluate(order, dp, layout, setting, wrap)
                       for layout, wrap in itertools.product(layouts, ends)]
            feasible = [o for o in options if o is not None]
            if not feasible and not self.options.pp and setting.zero < 2:
                break  # fewer, fuller stages only need more memory (ZeRO-2/3: more replicas
                # hold less each)
            found.extend(feasible)
        return found

    def _pinned_tp(self, group: NodeGroup) -> int | None:
        return dict(self.options.group_tp or ()).get(group.name, self.options.tp)

    def _wraps(self, groups: int) -> tuple[Wrap, ...]:
        """Wrap-around orders worth trying: by group for mixed families; by machine only
        when a tied embedding makes the first and last stage exchange gradients."""
        wraps = [Wrap.NONE]
        if groups > 1:
            wraps.append(Wrap.GROUP)
        if self.cost.model.tied_embeddings:
            wraps.append(Wrap.NODE)
        return tuple(wraps)

    def _combine(self, setting: FamilySetting, families: tuple[FamilyOption, ...],
                 most: int | None = None) -> _Combo | None:
        """Families side by side, micro-batches split over their pipelines (at most ``most``
        each: what their memory was checked for)."""
        pipelines = sum(f.dp for f in families)
        if self.options.dp and pipelines != self.options.dp:
            return None
        sharded = setting.zero >= 3 and pipelines > 1  # FSDP2: replicas alike, in lockstep
        if sharded and zero3_schedule_problem(setting.schedule):
            return None
        even = setting.uniform or sharded
        slots = [PipelineSlot(f.fill_s, f.period_s, f.dp, most) for f in families]
        shares = split_micro_batches(slots, setting.micro_batches, even)
        if self.options.dp and not self._all_run(families, shares, setting):
            # every pinned replica runs: each takes at least what its schedule needs
            least = _least_micro_batches(families, setting, setting.micro_batches // pipelines)
            shares = split_micro_batches(slots, setting.micro_batches, even, least)
            if not self._all_run(families, shares, setting):
                return None
        if not self._accepted(families, shares, setting) or not _lockstep(shares, setting.ep):
            return None
        busy = [(f, s) for f, s in zip(families, shares, strict=True) if max(s) > 0]
        if not busy:
            return None
        used = tuple(f for f, _ in busy)
        quick = (max(f.time_s(max(s)) for f, s in busy) + max(f.dp_quick_s for f in used)
                 + self.families.cross_family_dp_s(used) + max(f.optimizer_s for f in used))
        return _Combo(quick, setting, tuple(f for f, _ in busy), tuple(tuple(s) for _, s in busy))

    def _all_run(self, families: tuple[FamilyOption, ...], shares: list[list[int]] | None,
                 setting: FamilySetting) -> bool:
        """Every pipeline gets micro-batches its schedule runs."""
        return (self._accepted(families, shares, setting)
                and all(m > 0 for share in shares or () for m in share))

    @staticmethod
    def _accepted(families: tuple[FamilyOption, ...], shares: list[list[int]] | None,
                  setting: FamilySetting) -> bool:
        """Whether the schedule runs every busy pipeline with its share (and there is one)."""
        if shares is None:
            return False
        schedule = schedule_for(setting.schedule)
        return all(schedule.accepts(m, f.pp, setting.virtual_stages, mixed_tp=f.mixed_tp)
                   for f, share in zip(families, shares, strict=True) for m in share if m)

    def _build(self, combo: _Combo) -> Plan:
        pipelines = []
        setting = combo.setting
        for family, shares in zip(combo.families, combo.shares, strict=True):
            for units, count in zip(family.pipelines, shares, strict=True):
                if count == 0:
                    continue
                ranges = _layer_ranges(family.layers, setting.virtual_stages)
                stages = tuple(
                    Stage(tuple(d.id for d in unit.devices), ranges[i],
                          comm=self.families.stage_comm(unit, setting))
                    for i, unit in enumerate(units)
                )
                pipelines.append(Pipeline(stages, setting.micro_batch, count))
        used = {d for p in pipelines for d in p.devices}
        unused = tuple(d.id for d in self.cluster.devices if d.id not in used)
        return Plan(
            cluster=self.cluster.spec, model=self.cost.model, training=self.training,
            pipelines=tuple(pipelines), schedule=setting.schedule,
            virtual_stages=setting.virtual_stages, recompute=setting.recompute,
            zero=setting.zero if len(pipelines) > 1 else 0, expert_parallel=setting.ep,
            unused_devices=unused,
            notes=(_launch_notes(self.cluster, pipelines, unused) if self.rank_order
                   else _unused_notes(self.cluster, unused)),
        )


def _seeks_expert_layouts(found: list[Plan], model: ModelSpec, options: SearchOptions,
                          level: MemoryLevel) -> bool:
    """Whether the search goes on to the next memory level although it has plans: for a
    mixture of experts with the degree left to it, until a level yields an expert-parallel
    plan (its replicas often fit only with sharded states, and it may be the faster plan),
    at most up to ZeRO-2."""
    if options.ep is not None or not model.is_moe or level.zero >= 2:
        return False
    return all(plan.ep == 1 for plan in found)


def _seeks_sharded_layouts(cost: CostModel, options: SearchOptions, level: MemoryLevel,
                           found: list[Plan], latest: list[Plan]) -> bool:
    """Whether the search goes on to the next memory level although it has plans: on
    clusters of up to ``SMALL_CLUSTER_GPUS`` GPUs, with the stage left to it, up to ZeRO-3
    while memory shaped the best plan so far (:func:`_memory_shaped`) or it came from the
    ``latest`` level after an earlier one had plans (sharding paid once: a further stage
    may fit a layout with less TP or fewer stages); then, where memory still shaped the
    best or it gathers its parameters (ZeRO-3), to the optimizer offloaded, through its
    ZeRO stages alike. 8 A100s, llama2-13b: dp=2 pp=2 tp=2 swapping to the host
    unsharded, then better at ZeRO-1 and 2, and dp=4 tp=2 at ZeRO-3 8% faster than the
    first; 4 RTX 3090s, llama2-7b: dp=2 tp=2 at ZeRO-2 5% faster than the offloaded
    pipeline. Elsewhere sharding would save only optimizer time, and each level costs a
    whole search pass."""
    if (cost.cluster.spec.num_gpus > SMALL_CLUSTER_GPUS or options.zero is not None
            or not options.sharded_levels):
        return False
    best = min(found, key=_rank)
    improved = len(found) > len(latest) and any(plan is best for plan in latest)
    if level.zero < 3:
        return improved or _memory_shaped(cost, best)
    if level.offload:
        return False
    # every ZeRO stage tried on the device: where memory shaped the best plan, the
    # optimizer's 12 bytes a parameter offloaded may fit a faster layout (issue 29's lab
    # under megatron-lm: ZeRO-3 over 10 Gb/s 244 s, dp=1 offloaded 109 s; sixteen machines:
    # tp=2 pp=17 51.6 s, tp=1 dp=2 offloaded 47.2 s)
    return options.offload is None and (_memory_shaped(cost, best) or best.zero >= 3)


def _memory_shaped(cost: CostModel, plan: Plan) -> bool:
    """Whether memory shaped ``plan``: it pays time for memory (:func:`_pays_for_memory`),
    or, placed in rank order, splits the model (tensor or pipeline parallelism) over
    devices none of which could hold the whole model's weights, gradients and Adam states.
    An even layer split in rank order sizes every stage by its smallest device, so sharded
    or offloaded states may let it split less (the sixteen-machine lab under megatron-lm:
    tp=2 pp=17 51.6 s, tp=1 dp=2 offloaded 47.2 s); potluck's placement already gives
    each device the layers its memory holds, so there only a split that ZeRO-3 over the
    plan's own devices could undo counts (:func:`_sharding_may_unsplit`). A split chosen
    for speed (gpt3-125m at tp=2 on A100s) is not memory's doing either way."""
    if _pays_for_memory(plan):
        return True
    if cost.execution.placement is not Placement.RANK_ORDER:
        return _sharding_may_unsplit(cost, plan)
    splits = {d for p in plan.pipelines if _splits_model(p) for d in p.devices}
    params = counts.total_params(plan.model)
    return any(cost.model_state_bytes(d.type, params, NOT_SHARDED) > d.type.memory_bytes
               for d in cost.cluster.devices if d.id in splits)


def _sharding_may_unsplit(cost: CostModel, plan: Plan) -> bool:
    """Whether ``plan`` splits the model (tensor or pipeline parallelism) over the devices of
    one machine, each of which could hold a whole replica under ZeRO-3 over as many
    replicas as the plan has devices (one micro-batch, every block recomputed): a sharded
    data-parallel layout of the same devices, gathering over the machine's own links, may
    then run without the split's communication. The student lab of
    ``benchmarks/lab_quality.py`` (llama3.2-1b on a 2x3090 box): tp=2 unsharded 9.62 s,
    dp=2 under ZeRO-3 9.30 s. Across machines ZeRO-3 gathers every weight over the network
    each step: on the workstation lab (llama2-7b, 12 GPUs on 1-25 Gb/s) the sharded levels
    found no faster plan and took the search from 1.1 s to 9.9 s of CPU."""
    if not any(_splits_model(p) for p in plan.pipelines):
        return False
    ids = set(plan.devices)
    used = [d for d in cost.cluster.devices if d.id in ids]
    if len({d.node for d in used}) > 1:
        return False
    whole = StageShape(num_layers=plan.model.num_layers, first=True, last=True,
                       recompute=Recompute.FULL, parameter_shards=len(used))
    sharding = StateSharding.of(len(used), 3)
    return all(cost.stage_memory_bytes(d.type, 1, whole, 1.0, sharding) <= d.type.memory_bytes
               for d in used)


def _splits_model(pipeline: Pipeline) -> bool:
    """Whether ``pipeline`` splits the model: several stages, or a stage over TP devices."""
    return pipeline.pp > 1 or any(stage.tp > 1 for stage in pipeline.stages)


def _pays_for_memory(plan: Plan) -> bool:
    """Whether some stage recomputes, swaps its activations or offloads its optimizer."""
    for k, pipeline in enumerate(plan.pipelines):
        for i in range(pipeline.pp):
            memory = plan.stage_memory(k, i).resolved(plan.recompute)
            if memory.recompute is not Recompute.NONE or memory.swaps or \
                    memory.offload is not Offload.NONE:
                return True
    return False


def expert_degrees(model: ModelSpec, options: SearchOptions, num_gpus: int) -> list[int]:
    """The expert-parallel degrees the search tries: the pinned one; else for a mixture of
    experts none and every power of two dividing its experts, up to the devices."""
    if options.ep is not None:
        return [options.ep]
    if not model.is_moe:
        return [1]
    degrees, ep = [1], 2
    while ep <= num_gpus and model.num_experts % ep == 0:
        degrees.append(ep)
        ep *= 2
    return degrees


def _lockstep(shares: list[list[int]] | None, ep: int) -> bool:
    """Whether each group of ``ep`` consecutive pipelines of every family gets the same
    micro-batch count (their token exchanges pair up only then)."""
    if ep == 1 or shares is None:
        return True
    return all(len(set(share[g:g + ep])) == 1 for share in shares
               for g in range(0, len(share), ep))


def _beam_with_every_tp(found: list[FamilyOption], beam: int,
                        by_machines: bool) -> list[FamilyOption]:
    """The ``beam`` best families (``found`` is sorted), and beyond them the best of every TP
    choice and the best of every replica count (not of every pair: on large clusters their
    product crowds the combinations): the ranking is made at one micro-batch size, and a
    larger TP degree or more replicas that lose there can win at the larger micro-batches
    the second pass tries (8 A100s, llama2-7b: tp=4 x dp=2 ranks below three tp=2 families
    at micro-batch 1 and wins at 8; four RTX 4090s: four replicas lose to a four-stage
    pipeline whose transfers overlap at micro-batch 1 and win at 4). With ``by_machines``
    (small clusters) a TP choice counts apart on each number of machines its family spans
    (two machines of 4 A100s over 10 Gb/s, gpt3-125m: the fastest plan, tp=2 x dp=2 on one
    machine, ranks below a tp=2 family on both); on 1024 GPUs that multiplies the
    candidates 7-fold."""
    kept = found[:beam]
    placed = _machines if by_machines else _no_machines
    groups = {(family.groups, placed(family)) for family in kept}
    replicas = {family.dp for family in kept}
    for family in found[beam:]:
        key = (family.groups, placed(family))
        if key not in groups or family.dp not in replicas:
            groups.add(key)
            replicas.add(family.dp)
            kept.append(family)
    return kept


def _machines(family: FamilyOption) -> int:
    return len({unit.node for pipeline in family.pipelines for unit in pipeline})


def _no_machines(family: FamilyOption) -> int:
    return 0


def _least_micro_batches(families: tuple[FamilyOption, ...], setting: FamilySetting,
                         most: int) -> int:
    """The fewest micro-batches the schedule runs on every family's pipelines (1F1B: one
    per stage); ``most`` when none up to it does."""
    schedule = schedule_for(setting.schedule)
    for count in range(1, most + 1):
        if all(schedule.accepts(count, f.pp, setting.virtual_stages, mixed_tp=f.mixed_tp)
               for f in families):
            return count
    return max(1, most)


def _family_quick_s(family: FamilyOption, setting: FamilySetting) -> float:
    """A family's quick time with the whole batch to itself: how its options are ranked."""
    return (family.fill_s + -(-setting.micro_batches // family.dp) * family.period_s
            + family.dp_quick_s)


def _nearest(degrees: list[int], degree: int) -> int:
    """The allowed degree nearest ``degree`` (the smaller of two as near); 0 if none."""
    return min(degrees, key=lambda t: (abs(t - degree), t), default=0)


def _combinations(lists: list[list[FamilyOption]], limit: int | None
                  ) -> Iterator[tuple[FamilyOption, ...]]:
    """Every choice of one option per family (``limit`` None, or their number within it);
    else the best of each, then each family's other options beside the others' best."""
    if any(not options for options in lists):
        return
    if limit is None or math.prod(len(options) for options in lists) <= limit:
        yield from itertools.product(*lists)
        return
    best = tuple(options[0] for options in lists)
    yield best
    for i, options in enumerate(lists):
        for other in options[1:]:
            yield (*best[:i], other, *best[i + 1:])


def _layer_ranges(layers: tuple[int, ...], virtual: int) -> list[tuple[tuple[int, int], ...]]:
    """Blocks per stage, cut into ``virtual`` chunks laid out in virtual-stage order."""
    chunks = [[n // virtual + (1 if c < n % virtual else 0) for c in range(virtual)]
              for n in layers]
    ranges: list[list[tuple[int, int]]] = [[] for _ in layers]
    start = 0
    for c in range(virtual):
        for i, sizes in enumerate(chunks):
            ranges[i].append((start, start + sizes[c]))
            start += sizes[c]
    return [tuple(r) for r in ranges]


def _unused_notes(cluster: Cluster, unused: tuple[str, ...]) -> tuple[str, ...]:
    if not unused:
        return ()
    per_group: dict[str, int] = {}
    for device_id in unused:
        group = cluster.device(device_id).group
        per_group[group] = per_group.get(group, 0) + 1
    return tuple(
        f"{count} of {cluster.groups[group].num_gpus} {cluster.groups[group].gpu} GPUs of "
        f"{group} left out: the plan is faster without them"
        for group, count in per_group.items()
    )


def _launch_notes(cluster: Cluster, pipelines: list[Pipeline],
                  unused: tuple[str, ...]) -> tuple[str, ...]:
    """Which hostfile the framework is launched with, where it is not the cluster file's
    every machine in order: the framework numbers its ranks in hostfile order."""
    launched = sorted({d for p in pipelines for d in p.devices}, key=_rank_of(pipelines))
    groups = list(dict.fromkeys(cluster.device(d).group for d in launched))
    in_file = [g.name for g in cluster.spec.nodes if g.name in groups]
    if not unused and groups == in_file:
        return ()
    left = list(dict.fromkeys(cluster.device(d).group for d in unused))
    return (f"rank order: launch on {len(launched)} devices, hostfile order "
            f"{', '.join(groups)}" + (f"; not launched: {', '.join(left)}" if left else ""),)


def _rank_of(pipelines: list[Pipeline]) -> Callable[[str], int]:
    """A device's rank in the framework's order: replica ``d`` of stage ``s`` at
    ``(s * dp + d) * tp`` on (:mod:`potluck.planner.rank_order`)."""
    dp = len(pipelines)
    ranks = {device: (s * dp + d) * len(stage.devices) + j
             for d, pipeline in enumerate(pipelines) for s, stage in enumerate(pipeline.stages)
             for j, device in enumerate(stage.devices)}
    return lambda device: ranks[device]


def _rank(plan: Plan) -> tuple[float, int]:
    """Fastest first; among equally fast plans, the one that recomputes least."""
    modes = list(Recompute)
    recomputes = sum(modes.index(plan.stage_memory(k, i).recompute or Recompute.NONE)
                     for k, p in enumerate(plan.pipelines) for i in range(p.pp))
    return plan.prediction.iteration_time_s, recomputes


def _distinct(plans: list[Plan], top_k: int) -> list[Plan]:
    seen, result = set(), []
    for plan in plans:
        key = (plan.layout(), plan.pipelines[0].micro_batch_size, plan.recompute,
               len(plan.unused_devices),
               tuple((s.num_layers, s.memory) for p in plan.pipelines for s in p.stages))
        if key not in seen:
            seen.add(key)
            result.append(plan)
        if len(result) == top_k:
            break
    return result
