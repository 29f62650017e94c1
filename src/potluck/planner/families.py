"""Families of identical pipelines: their stages, layer split and timing.

:meth:`FamilyEvaluator.evaluate` lays ``dp`` pipelines over the units of a family's
node groups (pipeline-major: consecutive units of a machine form one
pipeline; data-major: they belong to different replicas), splits the blocks
over the stages in proportion to stage speed under each device's memory,
and reports the family's pipeline time as ``fill + m * period`` for ``m``
micro-batches, plus a quick estimate of its gradient all-reduce. All times
come from :class:`~potluck.planner.cost.CostModel`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from functools import cached_property

from potluck.cluster.spec import NodeGroup
from potluck.cluster.topology import Cluster, Device, spans_vendors
from potluck.model.counts import Recompute
from potluck.planner import formulas
from potluck.planner.comm.refine import choose_stage_comm
from potluck.planner.cost import CostModel, StageShape, usable_memory_bytes
from potluck.planner.formulas import StateSharding
from potluck.planner.network import NicSharing, RingLink
from potluck.planner.partition import StageSlot, split_layers
from potluck.planner.space import Unit, UnitLayout, Wrap, group_units
from potluck.plans import Execution, StageComm
from potluck.schedules import Schedule, StageWork, schedule_for

PATTERN_SAMPLES = 8  # pipelines sampled for link patterns (layouts repeat within a machine)


@dataclass(frozen=True)
class FamilySetting:
    """The knobs shared by every family of one candidate plan."""

    micro_batch: int
    recompute: Recompute
    schedule: Schedule
    virtual_stages: int
    zero: int  # ZeRO stage 0-3 (a bool reads as ZeRO-1 or none)
    uniform: bool
    micro_batches: int  # of the whole batch: an upper bound on what one pipeline holds
    offload: bool = False  # every stage's optimizer in host memory
    swap: bool = False  # every stage may swap all its blocks' saved activations off the device
    ep: int = 1  # expert parallelism over groups of this many of a family's pipelines
    # under full recomputation left to the search: each stage recomputes only the blocks
    # it must to fit, as the per-stage refinement will (priced so in layer splits and times)
    least_recompute: bool = False

    @property
    def per_stage_recompute(self) -> bool:
        return self.least_recompute and self.recompute is Recompute.FULL and not self.swap

    def sharding(self, dp: int) -> StateSharding:
        return StateSharding.of(dp, int(self.zero), self.offload)

    def for_replicas(self, dp: int) -> FamilySetting:
        """The setting as a family of ``dp`` pipelines sees it: one pipeline shards nothing,
        so its layout and times are those of ZeRO stage 0 (what lets the search's memory
        levels share its evaluation)."""
        return self._unsharded if dp == 1 else self

    @cached_property
    def _unsharded(self) -> FamilySetting:
        return replace(self, zero=0) if self.zero else self

    def __hash__(self) -> int:
        return self._hash

    @cached_property
    def _hash(self) -> int:
        """Hashed once: settings key the evaluator's caches, looked up millions of times."""
        return hash(tuple(getattr(self, f.name) for f in fields(self)))

    def __getstate__(self) -> dict:
        """The fields only: a string's hash differs from one process to another."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class FamilyOption:
    """``dp`` identical pipelines over a family's units, with their layer split and timing."""

    groups: tuple[tuple[str, int], ...]  # (node group, tp) in stage order
    layout: str
    pipelines: tuple[tuple[Unit, ...], ...]
    layers: tuple[int, ...]
    works: tuple[StageWork, ...]
    fill_s: float
    period_s: float
    dp_quick_s: float
    optimizer_s: float = 0.0
    key: tuple = ()  # (order, dp, layout, wrap): how to rebuild this family for another setting
    # per stage, its gradient bytes and the backward time that hides their reduction
    # (what the all-reduce between families is estimated from: cross_family_dp_s)
    gradients: tuple[tuple[float, float], ...] = ()

    @property
    def dp(self) -> int:
        return len(self.pipelines)

    @property
    def pp(self) -> int:
        return len(self.layers)

    @cached_property
    def mixed_tp(self) -> bool:
        """Whether its stages have different tensor-parallel degrees."""
        return len({unit.tp for unit in self.pipelines[0]}) > 1

    def time_s(self, micro_batches: int) -> float:
        return self.fill_s + micro_batches * self.period_s


class FamilyEvaluator:
    """Evaluates family layouts for one cluster and model, caching what repeats."""

    def __init__(self, cluster: Cluster, cost: CostModel) -> None:
        self.cluster = cluster
        self.cost = cost
        self._units_cache: dict[tuple[NodeGroup, int], tuple[Unit, ...]] = {}
        self._coefficient_cache: dict[tuple, tuple] = {}
        self._send_cache: dict[tuple, float] = {}
        self._layouts: dict[tuple, tuple | None] = {}
        self._sends_by_layout: dict[tuple, tuple] = {}
        self._works: dict[tuple, StageWork] = {}
        self._rings: dict[int, tuple] = {}
        self._ring_cache: dict[tuple[str, ...], RingLink] = {}
        self._splits: dict[tuple, list[int] | None] = {}
        self._slots: dict[tuple, StageSlot | None] = {}
        self._params_cache: dict[tuple, float] = {}
        self._comm_cache: dict[tuple, StageComm] = {}
        self._options: dict[tuple, FamilyOption | None] = {}
        # quick estimates: every GPU of a machine crosses its card at once
        self._whole_machines = NicSharing.whole_machines(cluster, cluster.devices)

    def units(self, group: NodeGroup, tp: int) -> tuple[Unit, ...]:
        """The TP units of a node group (cached; a dict, so no reference cycle keeps this alive)."""
        key = (group, tp)
        if key not in self._units_cache:
            self._units_cache[key] = tuple(group_units(self.cluster, group, tp))
        return self._units_cache[key]

    def evaluate(self, order: tuple[tuple[NodeGroup, int], ...], dp: int, layout: UnitLayout,
                 setting: FamilySetting, wrap: Wrap = Wrap.NONE) -> FamilyOption | None:
        """``dp`` identical pipelines over the units of ``order``'s groups.

        ``wrap`` puts part of the first units at the far end of each pipeline, so the
        embedding and the head sit on the same kind of device (``group``: the first
        group's units are split between both ends) or the same machine (``node``: the
        first machine's units are), which keeps a tied embedding's gradient exchange
        off the network. Memoized: a search meets a family again in many groupings and at
        every memory level (:meth:`FamilySetting.for_replicas`)."""
        layout_key = (tuple((g.name, g.count, tp) for g, tp in order), dp, layout, wrap)
        key = (layout_key, setting.for_replicas(dp))
        if key not in self._options:
            self._options[key] = self._evaluate(order, dp, layout, setting, wrap, layout_key)
        return self._options[key]

    def _evaluate(self, order: tuple[tuple[NodeGroup, int], ...], dp: int, layout: UnitLayout,
                  setting: FamilySetting, wrap: Wrap, layout_key: tuple) -> FamilyOption | None:
        if layout_key not in self._layouts:
            self._layouts[layout_key] = self._assemble(order, dp, layout, wrap)
        assembled = self._layouts[layout_key]
        if assembled is None:
            return None
        pipelines, sharing = assembled
        groups = tuple((g.name, tp) for g, tp in order)
        name = layout.value if wrap is Wrap.NONE else f"{layout.value}+wrap-{wrap.value}"
        option = self.evaluate_pipelines(pipelines, sharing, dp, setting, groups, name)
        if option is None:
            return None
        return replace(option, key=(order, dp, layout, wrap))

    def layout_sharing(self, pipelines: tuple[tuple[Unit, ...], ...]) -> NicSharing:
        """Pipeline transfers crossing each machine's network card at once."""
        return NicSharing.of_pipelines([u.devices for u in p] for p in pipelines)

    def evaluate_pipelines(self, pipelines: tuple[tuple[Unit, ...], ...], sharing: NicSharing,
                           dp: int, setting: FamilySetting,
                           groups: tuple[tuple[str, int], ...] = (),
                           layout: str = "explicit") -> FamilyOption | None:
        """Split layers over pipelines that share one stage structure; ``dp`` is the size of
        the data-parallel group their states are sharded over (ZeRO-1)."""
        setting = setting.for_replicas(dp)
        pp = len(pipelines[0])
        num_layers = self.cost.model.num_layers
        if pp * setting.virtual_stages > num_layers or dp % setting.ep:
            return None
        layers = self._split(pipelines[0], dp, setting)
        if layers is None:
            return None
        sends = self._sends_cached(pipelines, setting.micro_batch, sharing)
        works = tuple(self._work(pipelines[0][i], layers[i], i, pp, sends[i], setting,
                                 _expert_peers(pipelines, i, setting.ep),
                                 self._recomputed(pipelines[0][i], i, pp, dp, setting, layers[i]))
                      for i in range(pp))
        fill, period = _fill_and_period(list(works), setting, self.cost.execution)
        dp_quick = self._dp_quick_s(pipelines, layers, works, setting.ep)
        optimizer = self._optimizer_s(pipelines[0], layers, setting.sharding(dp), setting.ep)
        return FamilyOption(groups, layout, pipelines, tuple(layers), works, fill, period, dp_quick,
                            optimizer, gradients=self._gradients(pipelines[0], layers, works))

    def _params(self, num_layers: int, i: int, pp: int, tp: int, ep: int = 1) -> float:
        """Parameters each device of stage ``i`` of ``pp`` holds (cached: the search asks often)."""
        key = (num_layers, i, pp, tp, ep)
        params = self._params_cache.get(key)
        if params is None:
            shape = StageShape(num_layers, i == 0, i == pp - 1, pp, ep=ep)
            params = self._params_cache[key] = self.cost.stage_params(shape, tp)
        return params

    def _optimizer_s(self, pipeline: tuple[Unit, ...], layers: list[int],
                     sharding: StateSharding, ep: int = 1) -> float:
        """The slowest stage's optimizer step (offloaded: on the host, every GPU of its machine
        stepping as much at once)."""
        pp = len(layers)
        steps = []
        for i, (unit, n) in enumerate(zip(pipeline, layers, strict=True)):
            device, params = unit.devices[0], self._params(n, i, pp, unit.tp, ep)
            if sharding.offload:
                on_host = params / sharding.optimizer_shards * \
                    self.cluster.groups[device.group].gpus_per_node
                steps.append(self.cost.offloaded_step_s(device, params, sharding, on_host))
            else:
                steps.append(self.cost.optimizer_step_s(device.type, params, sharding))
        return max(steps)

    def _assemble(self, order: tuple[tuple[NodeGroup, int], ...], dp: int, layout: UnitLayout,
                  wrap: Wrap) -> tuple[tuple[tuple[Unit, ...], ...], NicSharing] | None:
        """The family's pipelines and, per machine, the pipeline transfers crossing its
        network card at once (all boundaries are busy in the steady state)."""
        per_group = []
        for group, tp in order:
            units = self.units(group, tp)
            per_pipeline = len(units) // dp
            if per_pipeline == 0:
                return None
            if layout is UnitLayout.PIPELINE:
                chunks = [units[j * per_pipeline:(j + 1) * per_pipeline] for j in range(dp)]
            else:
                chunks = [units[j::dp][:per_pipeline] for j in range(dp)]
            per_group.append(chunks)
        if wrap is Wrap.GROUP:
            if len(per_group) < 2 or len(per_group[0][0]) < 2:
                return None
            front = [c[: (len(c) + 1) // 2] for c in per_group[0]]
            back = [c[(len(c) + 1) // 2:] for c in per_group[0]]
            per_group = [front, *per_group[1:], back]
        pipelines = tuple(tuple(u for chunks in per_group for u in chunks[j]) for j in range(dp))
        if wrap is Wrap.NODE:
            pipelines = tuple(_wrap_first_machine(p) for p in pipelines)
            if any(p is None for p in pipelines):
                return None
        return pipelines, self.layout_sharing(pipelines)

    def _sends_cached(self, pipelines: tuple[tuple[Unit, ...], ...], micro_batch: int,
                      sharing: NicSharing) -> list[float]:
        key = (id(pipelines), micro_batch)
        cached = self._sends_by_layout.get(key)
        if cached is None or cached[0] is not pipelines:
            cached = (pipelines, self._sends(pipelines, micro_batch, sharing))
            self._sends_by_layout[key] = cached
        return cached[1]

    def _sends(self, pipelines: tuple[tuple[Unit, ...], ...], micro_batch: int,
               sharing: NicSharing) -> list[float]:
        """Worst transfer time after each stage over the sampled pipelines."""
        pp = len(pipelines[0])
        sample = _sample(pipelines)
        sends = []
        for i in range(pp - 1):
            sends.append(max(self._send(p[i], p[i + 1], micro_batch, sharing,
                                        spans_vendors(d for u in p for d in u.devices))
                             for p in sample))
        return sends + [0.0]

    def _send(self, a: Unit, b: Unit, micro_batch: int, sharing: NicSharing,
              host_staged: bool) -> float:
        """Cached by what the time depends on: the units' places, not which machines they are;
        ``host_staged``: the pipeline spans vendors."""
        share = 1 if a.node == b.node else sharing.share(a.devices[0], b.devices[0])
        key = (a.group, a.devices[0].local_index, b.group, b.devices[0].local_index,
               a.node == b.node, a.tp, b.tp, micro_batch, share, host_staged)
        if key not in self._send_cache:
            self._send_cache[key] = self.cost.send_s(a.devices, b.devices, micro_batch, sharing,
                                                     host_staged)
        return self._send_cache[key]

    def _split(self, pipeline: tuple[Unit, ...], dp: int, setting: FamilySetting) -> list[int] | None:
        """The layer split depends only on the stages' device types, not on where they sit."""
        key = (tuple((u.group, u.tp) for u in pipeline), dp, setting)
        if key in self._splits:
            return self._splits[key]
        pp = len(pipeline)
        slots = []
        for i in range(pp):
            slot = self._slot(pipeline[i], i, pp, dp, setting)
            if slot is None:
                self._splits[key] = None
                return None
            slots.append(slot)
        layers = split_layers(slots, self.cost.model.num_layers, uniform=setting.uniform,
                              min_layers=setting.virtual_stages)
        self._splits[key] = layers
        return layers

    def _recomputed(self, unit: Unit, i: int, pp: int, dp: int, setting: FamilySetting,
                    layers: int) -> int | None:
        """Blocks of stage ``i`` that recompute (None: all that the mode recomputes)."""
        if not setting.per_stage_recompute:
            return None
        slot = self._slot(unit, i, pp, dp, setting)
        return None if slot is None else slot.recomputed(layers)

    def _slot(self, unit: Unit, i: int, pp: int, dp: int, setting: FamilySetting) -> StageSlot | None:
        key = (unit.group, unit.tp, i, pp, dp, setting)
        if key not in self._slots:
            self._slots[key] = self._new_slot(unit, i, pp, dp, setting)
        return self._slots[key]

    def _new_slot(self, unit: Unit, i: int, pp: int, dp: int, setting: FamilySetting
                  ) -> StageSlot | None:
        first, last = i == 0, i == pp - 1
        coefficients = self._coefficients(unit, first, last, pp, dp, setting)
        per_layer_s, extra_s, fixed, per_layer_states, per_flight, per_layer_act = coefficients
        in_flight = schedule_for(setting.schedule).in_flight(
            i, pp, setting.micro_batches, setting.virtual_stages)
        capacity = usable_memory_bytes(unit.devices[0].type) - fixed - in_flight * per_flight
        # swapping: the blocks' activations of one micro-batch on the device, the rest away
        per_layer = per_layer_states + (min(in_flight, 1.0) if setting.swap else in_flight) \
            * per_layer_act
        if capacity < per_layer * setting.virtual_stages:
            return None
        if not setting.per_stage_recompute:
            return StageSlot(per_layer_s, extra_s, int(math.floor(capacity / per_layer)))
        kept_s, _, _, _, _, kept_act = self._coefficients(
            unit, first, last, pp, dp, replace(setting, recompute=Recompute.NONE))
        return StageSlot(kept_s, extra_s, int(math.floor(capacity / per_layer)),
                         recompute_s=per_layer_s - kept_s, spare_bytes=capacity,
                         kept_bytes=per_layer_states + in_flight * kept_act,
                         freed_bytes=in_flight * (kept_act - per_layer_act))

    def _coefficients(self, unit: Unit, first: bool, last: bool, pp: int, dp: int,
                      setting: FamilySetting) -> tuple[float, float, float, float, float, float]:
        # what the stage's time and memory depend on: of the stage count only whether there
        # are several (StageShape.pp: a tied head's separate copy), of the replicas only how
        # they shard the states (the coefficients recur over every pp, dp and memory level)
        sharding = setting.sharding(dp)
        key = (unit.group, unit.tp, first, last, pp > 1, setting.micro_batch, setting.recompute,
               setting.schedule, setting.ep, sharding)
        coefficients = self._coefficient_cache.get(key)
        if coefficients is None:
            shape = self._with_comm(StageShape(0, first, last, pp, setting.micro_batch,
                                               setting.recompute, ep=setting.ep), unit, setting)
            coefficients = self._slot_coefficients(unit.devices, shape, sharding)
            self._coefficient_cache[key] = coefficients
        return coefficients

    def _slot_coefficients(self, devices: tuple[Device, ...], shape: StageShape,
                           sharding: StateSharding) -> tuple[float, float, float, float, float, float]:
        """Linear coefficients of a stage's time and memory in its block count."""
        cost, tp, device_type = self.cost, len(devices), devices[0].type
        w0 = cost.stage_time(devices, shape.with_layers(0)).work
        w1 = cost.stage_time(devices, shape.with_layers(1)).work

        def memory(layers: int, in_flight: float) -> float:
            return cost.stage_memory_bytes(device_type, tp, shape.with_layers(layers), in_flight,
                                           sharding)

        # affine in the block count from one block on (full recomputation adds one block's
        # working set once, not per block): slopes between one and two blocks
        per_layer_states = memory(2, 0.0) - memory(1, 0.0)
        fixed = memory(1, 0.0) - per_layer_states
        per_layer_activations = (memory(2, 1.0) - memory(2, 0.0)) - (memory(1, 1.0) - memory(1, 0.0))
        per_flight = memory(1, 1.0) - memory(1, 0.0) - per_layer_activations
        return (w1.total_s - w0.total_s, w0.total_s, fixed, per_layer_states, per_flight,
                per_layer_activations)

    def _work(self, unit: Unit, layers: int, i: int, pp: int, send_s: float,
              setting: FamilySetting, peers: tuple[str, ...] = (),
              recomputed: int | None = None) -> StageWork:
        """``peers``: the devices the stage exchanges tokens with (expert parallelism);
        ``recomputed``: its blocks that recompute (None: all the mode recomputes)."""
        key = (unit.group, unit.devices[0].local_index, unit.tp, layers, i == 0, i == pp - 1,
               setting.micro_batch, setting.recompute, send_s, setting.ep, peers, recomputed)
        work = self._works.get(key)
        if work is None:
            shape = self._with_comm(StageShape(layers, i == 0, i == pp - 1, pp,
                                               setting.micro_batch, setting.recompute,
                                               recompute_blocks=recomputed,
                                               ep=setting.ep, expert_peers=peers),
                                    unit, setting)
            work = self._works[key] = self.cost.stage_time(unit.devices, shape, send_s).work
        return work

    def stage_comm(self, unit: Unit, setting: FamilySetting) -> StageComm:
        """The unit's TP communication setting with the least time per block
        (:func:`potluck.planner.comm.refine.choose_stage_comm`; cached)."""
        key = (unit.group, tuple(d.local_index for d in unit.devices), setting.micro_batch,
               setting.recompute, setting.schedule)
        comm = self._comm_cache.get(key)
        if comm is None:
            shape = StageShape(0, micro_batch=setting.micro_batch, recompute=setting.recompute)
            comm = self._comm_cache[key] = choose_stage_comm(self.cost, unit.devices, shape,
                                                             setting.schedule)
        return comm

    def _with_comm(self, shape: StageShape, unit: Unit, setting: FamilySetting) -> StageShape:
        comm = self.stage_comm(unit, setting)
        return replace(shape, tp_overlap_chunks=comm.tp_overlap_chunks,
                       keeps_comm=comm.recompute_keeps_comm)

    def _dp_quick_s(self, pipelines: tuple[tuple[Unit, ...], ...], layers: list[int],
                    works: tuple[StageWork, ...], ep: int = 1) -> float:
        """Exposed gradient all-reduce inside the family, rings sampled, NICs shared by
        every device of a machine that crosses it."""
        dp, pp = len(pipelines), len(layers)
        embedding = self._tied_embedding_s(pipelines)
        if dp <= 1:
            return embedding
        rings = self._ring_links(pipelines)
        exposed, behind = embedding, 0.0
        for i, link in enumerate(rings):
            unit = pipelines[0][i]
            params = self._params(layers[i], i, pp, unit.tp, ep)  # experts: over dp/ep alike
            num_bytes = params * self.cost.grad_bytes(unit.devices[0].type)
            allreduce = formulas.ring_allreduce_time_s(num_bytes, dp, link.bandwidth_bytes_per_s,
                                                       link.latency_s)
            behind += works[i].backward_s if self.cost.execution.overlap_grad_reduce else 0.0
            exposed = max(exposed, allreduce - behind)
        return exposed

    def _ring_links(self, pipelines: tuple[tuple[Unit, ...], ...]) -> list[RingLink]:
        """Per stage, the bottleneck of its gradient ring, every GPU of a machine crossing its
        card (rings sampled; cached per layout)."""
        key = id(pipelines)
        cached = self._rings.get(key)
        if cached is not None and cached[0] is pipelines:
            return cached[1]
        links = []
        for i in range(len(pipelines[0])):
            ring = [p[i].devices[0] for p in _sample(pipelines)] + [pipelines[-1][i].devices[0]]
            ring_key = tuple(d.id for d in ring)  # layouts share most rings: 4k of 176k distinct
            link = self._ring_cache.get(ring_key)
            if link is None:
                link = self._ring_cache[ring_key] = self.cost.network.ring_link(
                    ring, self._whole_machines)
            links.append(link)
        self._rings[key] = (pipelines, links)
        return links

    def _tied_embedding_s(self, pipelines: tuple[tuple[Unit, ...], ...]) -> float:
        """A tied embedding's gradient summed between the first and last stage (pp > 1)."""
        model = self.cost.model
        first, last = pipelines[0][0], pipelines[0][-1]
        if not model.tied_embeddings or len(pipelines[0]) == 1:
            return 0.0
        num_bytes = (model.vocab_size * model.hidden_size / first.tp
                     * self.cost.element_bytes(first.devices[0].type))
        return self.cost.network.allreduce_s(num_bytes, [first.devices[0], last.devices[0]])

    def cross_family_dp_s(self, families: tuple[FamilyOption, ...]) -> float:
        """Quick estimate of the exposed gradient all-reduce between families: the
        largest stage's gradients over a ring through every pipeline, at the bandwidth
        of the slowest link between families, shared by every GPU of a machine."""
        if len(families) <= 1:
            return 0.0
        ring = tuple(f.pipelines[0][0].devices[0] for f in families)
        key = tuple(d.id for d in ring)
        link = self._ring_cache.get(key)
        if link is None:
            link = self._ring_cache[key] = self.cost.network.ring_link(list(ring),
                                                                       self._whole_machines)
        ranks = sum(f.dp for f in families)
        # the ring's time is affine in the bytes: its latencies plus bytes over the bandwidth
        one, two = (formulas.ring_allreduce_time_s(b, ranks, link.bandwidth_bytes_per_s,
                                                   link.latency_s) for b in (1.0, 2.0))
        per_byte, fixed = two - one, 2 * one - two
        worst = max(fixed + per_byte * num_bytes - overlap
                    for family in families for num_bytes, overlap in family.gradients)
        return max(0.0, worst)

    def _gradients(self, pipeline: tuple[Unit, ...], layers: list[int],
                   works: tuple[StageWork, ...]) -> tuple[tuple[float, float], ...]:
        """Per stage, its gradient bytes and the backward time that hides their reduction."""
        pp, overlaps = len(layers), self.cost.execution.overlap_grad_reduce
        return tuple((self._params(layers[i], i, pp, unit.tp)
                      * self.cost.grad_bytes(unit.devices[0].type),
                      works[i].backward_s if overlaps else 0.0)
                     for i, unit in enumerate(pipeline))


def _expert_peers(pipelines: tuple[tuple[Unit, ...], ...], stage: int, ep: int
                  ) -> tuple[str, ...]:
    """Stage ``stage``'s devices in the first expert group of a family's pipelines (its
    groups are alike), which exchange tokens; none without expert parallelism."""
    if ep <= 1:
        return ()
    return tuple(p[stage].devices[0].id for p in pipelines[:ep])


def _wrap_first_machine(pipeline: tuple[Unit, ...]) -> tuple[Unit, ...] | None:
    """Split the first machine's units between both ends of the pipeline."""
    first = [u for u in pipeline if u.node == pipeline[0].node]
    rest = [u for u in pipeline if u.node != pipeline[0].node]
    if len(first) < 2 or not rest:
        return None
    half = (len(first) + 1) // 2
    return (*first[:half], *rest, *first[half:])


def _sample(pipelines: tuple[tuple[Unit, ...], ...]) -> tuple[tuple[Unit, ...], ...]:
    return pipelines[:PATTERN_SAMPLES]




def _fill_and_period(works: list[StageWork], setting: FamilySetting,
                     execution: Execution) -> tuple[float, float]:
    """Pipeline time is linear in the micro-batch count: ``fill + m * period``; split
    channels unless the execution forces them off (they never slow a pipeline down; the
    built plan's :func:`~potluck.planner.comm.refine.refine_comm` decides)."""
    schedule, v = schedule_for(setting.schedule), setting.virtual_stages
    traits = {"overlap_p2p": execution.overlap_p2p,
              "split_channels": execution.split_p2p_channels is not False}
    one = schedule.pipeline_time(works, 1, v, **traits).total_s
    two = schedule.pipeline_time(works, 2, v, **traits).total_s
    period = two - one
    return one - period, period
