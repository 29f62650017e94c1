"""Whole-plan evaluation: every pipeline, every gradient ring, every device's memory.

:func:`predict` composes the per-stage costs of
:class:`~potluck.planner.cost.CostModel` into a :class:`~potluck.plans.Prediction`:
pipeline times per replica (unequal stages, under the plan's schedule,
:mod:`potluck.schedules`), the data-parallel reduction of each stage's
gradients over the ring of replicas holding the same layers
(:func:`potluck.placement.replica_stages`; overlapped with the last backward
pass), the tied embedding's sum (:class:`potluck.plans.TiedGradSync`: with the
stages' rings over all its holders, or after them between each pipeline's
ends), network cards shared by the rings that cross them while they run
(:func:`shared_ends`), the optimizer step (with ZeRO-1's parameter
all-gather), the critical-path breakdown and per-device memory.

The per-stage figures the emulator and calibration need for a plan
(:func:`stage_op_times`, :func:`stage_send_s`) and the gradient groups the
simulator replays (:func:`gradient_groups`) come from here too, so they are
the very ones the prediction adds up.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace

from potluck import placement
from potluck.cluster.topology import Device, spans_vendors
from potluck.errors import ConfigError
from potluck.model import counts
from potluck.placement import StageRef
from potluck.planner import formulas, gemm
from potluck.planner.comm.sparse import expected_unique_tokens, sparse_exchange_bytes
from potluck.planner.comm.step_overlap import (
    first_forward_starts_s,
    gathered_forward_delay_s,
    next_step_bound_s,
)
from potluck.planner.cost import CostModel, StageShape
from potluck.planner.formulas import StateSharding
from potluck.planner.islands.exchange import outer_exchange
from potluck.planner.network import NicSharing, RingHops
from potluck.plans import (
    DeviceMemory,
    HostMemory,
    Plan,
    Prediction,
    TiedGradSync,
    TimeBreakdown,
    zero3_problem,
)
from potluck.plans.memory import Offload
from potluck.schedules import PipelineTime, StageWork, schedule_for

# Host memory a machine keeps for its OS and the ranks' processes, outside what plans
# place there: 4 GB for the OS (Ubuntu Desktop's documented minimum system memory) and,
# per rank, a CUDA process's host footprint (the CUDA context, the torch and NCCL
# libraries mapped, pinned staging buffers), 3 GB (PyTorch forums and NVIDIA developer
# forum reports of 2-3 GB resident per CUDA process before any tensor).
HOST_OS_RESERVE_BYTES = 4e9
HOST_RANK_RESERVE_BYTES = 3e9

StageDevices = list[list[tuple[Device, ...]]]  # per pipeline, per stage: its TP group


@dataclass
class GradientGroup:
    """Replicas of one stage's parameters (or of the tied embedding) that reduce their
    gradients together.

    Groups of one ``phase`` run at once and share the machines' network cards; a stage
    starts its part in a later phase once its groups of the earlier phases have ended
    (:attr:`potluck.plans.TiedGradSync.PIPELINE_ENDS`: the tied embedding's exchange after
    the data-parallel reduction)."""

    members: list[StageRef]
    rings: list[list[Device]]  # one ring per tensor-parallel rank
    grad_bytes: float
    scatter: bool = False  # ZeRO-1: reduce-scattered to the owners, half an all-reduce
    phase: int = 0
    # the tied embedding's sum starts only once the members' backward passes are over
    # (the embedding's gradient is the last one a backward pass completes; frameworks sum
    # it after the schedule): it hides behind no backward
    after_backward: bool = False
    gathers: bool = True  # ZeRO-1: the owners' updated parameters all-gathered to the group
    rounds: int = 1  # ZeRO-2/3: one reduce-scatter after every micro-batch's backward

    @property
    def bytes_per_ring(self) -> float:
        return self.grad_bytes / len(self.rings)

    def terms(self, cost: CostModel) -> tuple[float, float]:
        """The collective's latency (its slowest ring's) and the bytes each hop carries: the
        two terms of a ring collective (:func:`formulas.ring_terms`), an all-reduce or
        (``scatter``) a reduce-scatter, over its ``rounds``."""
        passes = formulas.HALF_RING_PASSES if self.scatter else formulas.ALLREDUCE_PASSES
        latency_s, hop_bytes = self._ring_terms(cost, passes)
        return latency_s, self.rounds * hop_bytes

    def gather_terms(self, cost: CostModel) -> tuple[float, float]:
        """ZeRO-1/2: the owners' updated parameters all-gathered, as :meth:`terms` gives a
        collective: its latency (the slowest ring's) and the bytes each hop carries."""
        return self._ring_terms(cost, formulas.HALF_RING_PASSES)

    def _ring_terms(self, cost: CostModel, passes: float) -> tuple[float, float]:
        """One collective of ``passes`` over the rings: its latency and each hop's bytes."""
        latency_s = max(cost.network.ring_link(ring).latency_s for ring in self.rings)
        hop_bytes, latencies = formulas.ring_terms(self.bytes_per_ring, len(self.rings[0]),
                                                   passes)
        return latencies * latency_s, hop_bytes


@dataclass(frozen=True)
class Collective:
    """One gradient group's collective in its phase, as :func:`shared_ends` runs it."""

    rings: list[list[Device]]
    begin_s: float  # its bytes start to move (after its latency)
    work_bytes: float  # bytes each hop carries
    ready_s: float  # it ends no earlier (its members' gradients are complete)


def shared_ends(cost: CostModel, collectives: list[Collective]) -> list[float]:
    """When each collective of one phase ends, its rings sharing every machine's network card
    equally with the rings running at the same moment (:meth:`NicSharing.of_rings`), the
    shares divided again whenever a collective starts or ends: the fluid form of the
    simulator's fair sharing (:mod:`potluck.sim.network`). Collectives that all run from start
    to end together take what ``NicSharing.of_rings`` over all of them gives."""
    left = [c.work_bytes for c in collectives]
    ends: list[float | None] = [c.begin_s if c.work_bytes <= 0 else None for c in collectives]
    hops = [RingHops(cost.cluster, c.rings) for c in collectives]
    t = min((c.begin_s for c in collectives), default=0.0)
    while any(end is None for end in ends):
        waiting = [c.begin_s for c, end in zip(collectives, ends, strict=True)
                   if end is None and c.begin_s > t]
        active = [i for i, c in enumerate(collectives) if ends[i] is None and c.begin_s <= t]
        if not active:
            t = min(waiting)
            continue
        flows: dict[str, int] = defaultdict(int)
        for i in active:
            for node, count in hops[i].flows.items():
                flows[node] += count
        rate = {i: hops[i].bandwidth_bytes_per_s(flows) for i in active}
        step = min([left[i] / rate[i] for i in active] + [w - t for w in waiting])
        t += step
        for i in active:
            if left[i] <= rate[i] * step * (1 + 1e-12):
                ends[i] = t
            left[i] -= rate[i] * step
    return [max(end, c.ready_s) for end, c in zip(ends, collectives, strict=True)]


def gradient_phases(groups: list[GradientGroup]) -> list[list[GradientGroup]]:
    """The groups that exchange anything (more than one member), phase by phase."""
    phases = sorted({g.phase for g in groups})
    return [[g for g in groups if g.phase == phase and len(g.members) > 1] for phase in phases]


@dataclass(frozen=True)
class StageCost:
    """A stage's work per micro-batch, its parameters and its memory at peak."""

    work: StageWork
    compute_s: float  # forward + backward compute, without TP communication
    params: float  # parameters held by each device of the stage
    activations_bytes: float  # peak activation bytes on each device
    shape: StageShape = StageShape(0)
    swapped_out_bytes: float = 0.0  # the stash it keeps off the device at peak
    host_swap_bytes: float = 0.0
    peer_swap_bytes: float = 0.0  # held on its swap_peer
    exchange_s: float = 0.0  # expert parallelism's all-to-alls per micro-batch, both passes


def predict(plan: Plan, cost: CostModel | None = None) -> Prediction:
    """Predict iteration time, throughput and per-device memory of ``plan`` (with the plan's
    own cost model unless ``cost`` is given)."""
    return PlanEvaluation(cost or CostModel.for_plan(plan), plan).prediction()


def stage_devices(cost: CostModel, plan: Plan) -> StageDevices:
    """Per pipeline, per stage: the stage's devices."""
    return [[tuple(cost.cluster.device(d) for d in stage.devices) for stage in pipeline.stages]
            for pipeline in plan.pipelines]


def stage_shape(plan: Plan, pipeline: int, stage: int) -> StageShape:
    """Stage ``stage`` of pipeline ``pipeline`` as the cost model sees it, its memory
    choices (:meth:`Plan.stage_memory`) included."""
    p = plan.pipelines[pipeline]
    n = p.stages[stage].num_layers
    memory = plan.stage_memory(pipeline, stage)
    comm = plan.stage_comm(pipeline, stage)
    return StageShape(n, stage == 0, stage == p.pp - 1, p.pp, p.micro_batch_size,
                      memory.recompute or plan.recompute, memory.recompute_blocks, memory.swap,
                      memory.swapped_blocks(n), memory.host_share, memory.swap_peer,
                      memory.offload is Offload.OPTIMIZER, comm.tp_overlap_chunks,
                      comm.recompute_keeps_comm, plan.ep, expert_peers(plan, pipeline, stage),
                      parameter_shards=stage_sharding(plan, pipeline, stage).parameter_shards)


def expert_peers(plan: Plan, pipeline: int, stage: int) -> tuple[str, ...]:
    """The devices that exchange tokens with stage ``stage`` of ``pipeline`` (itself
    included; none without expert parallelism)."""
    if plan.ep == 1:
        return ()
    return tuple(plan.pipelines[k].stages[stage].devices[0] for k in plan.expert_group(pipeline)
                 if stage < plan.pipelines[k].pp)


def stage_sharding(plan: Plan, pipeline: int | None = None, stage: int | None = None
                   ) -> StateSharding:
    """How the plan shards its model states over the replicas; for stage ``stage`` of
    ``pipeline``, with its own optimizer offload and its own share: each holder of a
    stage's parameters keeps a share of their states proportional to its device memory
    (the memory contract; ``1/d`` on equal devices), as a divisor."""
    if pipeline is None or stage is None:
        return StateSharding.of(plan.dp, plan.zero)
    offload = plan.stage_memory(pipeline, stage).offload is Offload.OPTIMIZER
    replicas = len(plan.island_pipelines(pipeline))
    return StateSharding.of(_shard_divisors(plan).get((pipeline, stage), replicas), plan.zero,
                            offload)


_DIVISORS: dict[int, tuple[Plan, dict[StageRef, float]]] = {}


def _shard_divisors(plan: Plan) -> dict[StageRef, float]:
    """Per stage whose replicas' devices differ in memory, its share's divisor:
    ``sum(memory of the holders) / own memory`` (cached for the last few plans)."""
    cached = _DIVISORS.get(id(plan))
    if cached is not None and cached[0] is plan:
        return cached[1]
    from potluck.cluster.topology import Cluster

    cluster = Cluster(plan.cluster)
    divisors: dict[StageRef, float] = {}
    if plan.dp > 1 and plan.zero >= 1:
        for members in placement.replica_stages(plan):
            memory = {m: cluster.device(plan.pipelines[m[0]].stages[m[1]].devices[0]).type
                      .memory_bytes for m in members}
            if len(set(memory.values())) > 1:
                total = sum(memory.values())
                for member, own in memory.items():
                    divisors[member] = total / own
    if len(_DIVISORS) > 8:
        _DIVISORS.clear()
    _DIVISORS[id(plan)] = (plan, divisors)
    return divisors


def gradient_groups(cost: CostModel, plan: Plan) -> list[GradientGroup]:
    """The gradient groups of ``plan`` (stage replicas, tied embeddings) :func:`predict` prices."""
    evaluation = PlanEvaluation(cost, plan)
    return evaluation.gradient_groups([evaluation.stage_params(k) for k in range(plan.dp)])


def stage_send_s(plan: Plan, pipeline: int, sender: int, receiver: int,
                 cost: CostModel | None = None) -> float:
    """One micro-batch's transfer from stage ``sender`` to stage ``receiver`` of
    ``pipeline``, as the plan's evaluation charges it: pipelines whose transfers leave a
    machine share its network card (:meth:`NicSharing.of_pipelines`). ``cost``: the plan's
    cost model, when the caller has it."""
    cost = cost or CostModel.for_plan(plan)
    devices = stage_devices(cost, plan)
    stages = devices[pipeline]
    return cost.send_s(stages[sender], stages[receiver], plan.pipelines[pipeline].micro_batch_size,
                       NicSharing.of_pipelines(devices), spans_vendors(d for s in stages for d in s))


def parameter_gathers_s(cost: CostModel, plan: Plan) -> dict[StageRef, float]:
    """ZeRO-1/2: each stage's parameter all-gather after the step, as :func:`predict`
    prices it (every group's at once, sharing the machines' cards)."""
    evaluation = PlanEvaluation(cost, plan)
    return evaluation.member_gathers_s(
        evaluation.gradient_groups([evaluation.stage_params(k) for k in range(plan.dp)]))


def stage_op_times(plan: Plan) -> tuple[tuple[StageWork, ...], ...]:
    """Predicted forward and backward time of one micro-batch on every stage of ``plan``
    (TP communication included, no transfer), for the emulator and calibration."""
    cost = CostModel.for_plan(plan)
    devices = stage_devices(cost, plan)
    return tuple(
        tuple(cost.stage_time(devices[k][i], stage_shape(plan, k, i)).work
              for i in range(pipeline.pp))
        for k, pipeline in enumerate(plan.pipelines)
    )


@dataclass
class PlanEvaluation:
    """One evaluation of a whole plan; split out to keep each step short."""

    cost: CostModel
    plan: Plan
    devices: StageDevices = field(init=False)

    def __post_init__(self) -> None:
        self.devices = stage_devices(self.cost, self.plan)

    def prediction(self) -> Prediction:
        refusal = zero3_problem(self.plan)
        if refusal:
            raise ConfigError(refusal)
        schedule = schedule_for(self.plan.schedule)
        pp_sharing = NicSharing.of_pipelines(self.devices)
        costs = [self._pipeline_stage_costs(k, pp_sharing) for k in range(len(self.devices))]
        times = [
            schedule.pipeline_time([c.work for c in costs[k]], p.num_micro_batches,
                                   self.plan.virtual_stages,
                                   overlap_p2p=self.cost.execution.overlap_p2p,
                                   split_channels=self.plan.comm.split_p2p_channels)
            for k, p in enumerate(self.plan.pipelines)
        ]
        groups = self.gradient_groups([[c.params for c in stage_costs] for stage_costs in costs])
        done: dict[StageRef, float] = {}
        dp_end_s = self._reduction_end_s(groups, costs, times, done)
        pipe_end_s = max(t.total_s for t in times)
        if self.plan.comm.dp_priority_schedule:
            iteration_s = self._priority_iteration_s(costs, groups, done,
                                                     max(pipe_end_s, dp_end_s))
        else:
            optimizer_s = self._optimizer_s(costs, groups)
            offloaded_end_s = self._offloaded_end_s(costs, done)
            if offloaded_end_s:
                offloaded_end_s += self._parameter_gather_s(groups)
            iteration_s = max(max(pipe_end_s, dp_end_s) + optimizer_s, offloaded_end_s)
        optimizer_s = iteration_s - max(pipe_end_s, dp_end_s)
        breakdown = self._breakdown(costs, times, max(0.0, dp_end_s - pipe_end_s), optimizer_s)
        outer_s = outer_exchange(self.cost.cluster, self.plan, iteration_s).exposed_per_step_s
        breakdown = replace(breakdown, outer_s=outer_s)
        return self._summary(iteration_s + outer_s, breakdown, self._memory(costs), costs)

    def _pipeline_stage_costs(self, k: int, pp_sharing: NicSharing) -> list[StageCost]:
        pipeline, plan = self.plan.pipelines[k], self.plan
        schedule = schedule_for(plan.schedule)
        stages = self.devices[k]
        pp, b = len(stages), pipeline.micro_batch_size
        host = spans_vendors(d for s in stages for d in s)
        result = []
        for i, devices in enumerate(stages):
            shape = stage_shape(plan, k, i)
            send = 0.0 if shape.last else self.cost.send_s(devices, stages[i + 1], b, pp_sharing,
                                                           host)
            neighbours = tuple(d for j in (i - 1, i + 1) if 0 <= j < pp for d in stages[j])
            timing = self.cost.stage_time(devices, shape, send, neighbours,
                                          self._gather_s(k, i, shape))
            in_flight = schedule.in_flight(i, pp, pipeline.num_micro_batches, plan.virtual_stages)
            device_type, tp = devices[0].type, len(devices)
            activations = self.cost.stage_peak_activation_bytes(device_type, tp, shape, in_flight)
            swap = self.cost.swap_bytes(device_type, tp, shape, in_flight)
            params = self.cost.stage_params(shape, tp)
            result.append(StageCost(timing.work, timing.compute_s, params, activations, shape,
                                    swap.host + swap.peer, swap.host, swap.peer,
                                    timing.exchange_s))
        return result

    def _gather_s(self, k: int, i: int, shape: StageShape) -> float:
        """ZeRO-3: one all-gather of stage ``i``'s weights over its replicas (one ring per TP
        rank, the slowest), as one pass needs it."""
        if self.plan.zero < 3 or self.plan.dp <= 1:
            return 0.0
        devices = self.devices[k][i]
        weights = self.cost.stage_params(shape, len(devices)) * self.cost.element_bytes(
            devices[0].type)
        return max(self.cost.network.reduce_scatter_s(
            weights, [self.devices[q][i][r] for q in range(self.plan.dp)])
            for r in range(len(devices)))

    def stage_params(self, k: int) -> list[float]:
        """Parameters each device of every stage of pipeline ``k`` holds."""
        return [self.cost.stage_params(stage_shape(self.plan, k, i), len(devices))
                for i, devices in enumerate(self.devices[k])]

    def gradient_groups(self, params: list[list[float]]) -> list[GradientGroup]:
        """Each stage of the longest pipeline with its replicas in the other pipelines
        (:func:`potluck.placement.replica_stages`), then the tied embedding's groups
        (:meth:`_tied_groups`); a stage's group leaves out a tied weight summed apart."""
        tied = self._tied_groups()
        apart = {m for g in tied for m in g.members} if self._tied_alone() else set()
        sparse = self._sparse_embedding_group()
        groups = []
        for members in placement.replica_stages(self.plan):
            lead, i = members[0]
            full_params = params[lead][i] * len(self.devices[lead][i])
            if (lead, i) in apart:
                full_params -= self._tied_params()
            if sparse is not None and i == 0:
                full_params -= self._tied_params()  # the embedding matrix travels sparse
            experts = self._stage_expert_params(lead, i)
            groups.append(self._sharded(self._group(list(members), full_params - experts)))
            if experts:  # each shard of the experts over its holders in every expert group
                ep = self.plan.ep
                groups += [self._sharded(self._group([m for m in members if m[0] % ep == j],
                                                     experts))
                           for j in range(ep)]
        return groups + tied + ([sparse] if sparse is not None else [])

    def _stage_expert_params(self, k: int, i: int) -> float:
        """The routed experts' parameters a device of stage ``i`` of pipeline ``k`` holds
        under expert parallelism (0 without it: they are then summed with the rest)."""
        if self.plan.ep == 1:
            return 0.0
        blocks = self.plan.pipelines[k].stages[i].num_layers
        return blocks * counts.routed_expert_params(self.cost.model) / self.plan.ep

    def _sharded(self, group: GradientGroup) -> GradientGroup:
        """``group`` reduce-scattered to its owners under ZeRO (aligned groups), every
        micro-batch under ZeRO-2/3."""
        members = group.members
        aligned = len({len(self.devices[k][j]) for k, j in members}) == 1
        group.scatter = self.plan.shards_optimizer and aligned
        if self.plan.zero >= 2 and group.scatter:
            group.rounds = max(self.plan.pipelines[k].num_micro_batches for k, _ in members)
            group.gathers = self.plan.zero < 3  # FSDP2 gathers in the next forward
        return group

    def _sparse_embedding_group(self) -> GradientGroup | None:
        """The untied embedding's rows exchanged sparsely (:mod:`potluck.planner.comm.sparse`):
        an all-gather over its holders of the rows each replica's step touched in each TP
        rank's vocabulary shard, padded to the largest replica's, once the backward is over
        (the embedding's gradient is the last one it completes). With islands, each island
        exchanges over its own holders at once; the largest island's is priced."""
        if not self.plan.comm.sparse_embedding_grads or self.cost.model.tied_embeddings:
            return None
        members = list(max(placement.by_island(self.plan,
                                                placement.holders(self.plan, placement.EMBED)),
                           key=len))
        if len(members) < 2:
            return None
        m, seq_len = self.cost.model, self.plan.training.seq_len
        tokens = max(self.plan.pipelines[k].batch_share for k, _ in members) * seq_len
        group = self._group(members, 0.0)
        tp = len(group.rings)
        rows = expected_unique_tokens(tokens, m.vocab_size) / tp
        element = self.cost.grad_bytes(self.devices[members[0][0]][0][0].type)
        exchanged = sparse_exchange_bytes(rows, m.hidden_size, element, len(members))
        return replace(group, grad_bytes=exchanged * tp, scatter=True, after_backward=True,
                       gathers=False)

    def _tied_params(self) -> float:
        m = self.cost.model
        return m.vocab_size * m.hidden_size

    def _tied_alone(self) -> bool:
        """Whether the tied weight is summed in a group of its own only (potluck's runtime),
        not also in each stage's data-parallel group (Megatron-LM, DeepSpeed)."""
        return self.cost.execution.tied_grad_sync is TiedGradSync.HOLDERS

    def _tied_groups(self) -> list[GradientGroup]:
        """Where a tied embedding's gradient is summed (pipelines of one stage: in the
        stage's own group). ``holders``: one group of every stage that holds it, its ring
        through one machine after the other (NCCL builds rings that enter and leave each
        machine once; NVIDIA/nccl src/graph/search.cc), run with the stages' groups.
        ``pipeline-ends``: per pipeline its first and last stage, after the stages' groups."""
        if not placement.tied_ends(self.plan):
            return []
        weight = self._tied_params()
        if self._tied_alone():
            return [replace(self._group(self._by_machine(list(members)), weight),
                            after_backward=True)
                    for members in placement.by_island(
                        self.plan, placement.holders(self.plan, placement.TIED))]
        return [replace(self._group([first, last], weight), phase=1, after_backward=True,
                        gathers=False)
                for first, last in placement.tied_ends(self.plan)]

    def _by_machine(self, members: list[StageRef]) -> list[StageRef]:
        """``members`` with those on one machine side by side, machines in order of first use."""
        nodes = [self.devices[k][j][0].node for k, j in members]
        first = {node: nodes.index(node) for node in nodes}
        return [m for _, m in sorted(zip(nodes, members, strict=True),
                                     key=lambda pair: first[pair[0]])]

    def _group(self, members: list[StageRef], full_params: float) -> GradientGroup:
        tp = min(len(self.devices[k][j]) for k, j in members)
        rings = [[self.devices[k][j][r] for k, j in members] for r in range(tp)]
        element = self.cost.grad_bytes(self.devices[members[0][0]][members[0][1]][0].type)
        return GradientGroup(members, rings, element * full_params)

    def _reduction_end_s(self, groups: list[GradientGroup], costs: list[list[StageCost]],
                         times: list[PipelineTime], done: dict[StageRef, float]) -> float:
        """When the last gradient reduction ends, phase after phase (:func:`gradient_phases`;
        the rings of one phase share network cards while they run, :func:`shared_ends`). A
        group starts when all its members are ready (their backward passes done; in a later
        phase, their earlier groups ended) and, in the first phase with
        ``overlap_grad_reduce``, hides behind the last micro-batch's backward of its slowest
        member unless ``after_backward`` (ZeRO-2/3: behind its ``rounds`` backward passes).
        Fills ``done``: when each stage's gradients are reduced."""
        done.update({(k, j): t.finish_s[j] for k, t in enumerate(times)
                     for j in range(len(t.finish_s))})
        for index, phase in enumerate(gradient_phases(groups)):
            collectives = []
            for group in phase:
                window = 0.0
                if index == 0 and self.cost.execution.overlap_grad_reduce \
                        and not group.after_backward:
                    window = group.rounds * min(costs[k][j].work.backward_s
                                                for k, j in group.members)
                ready = max(done[m] for m in group.members)
                latency, work = group.terms(self.cost)
                collectives.append(Collective(group.rings, ready - window + latency, work, ready))
            for group, end in zip(phase, shared_ends(self.cost, collectives), strict=True):
                for member in group.members:
                    done[member] = max(done[member], end)
        return max(done.values())

    def _optimizer_s(self, costs: list[list[StageCost]], groups: list[GradientGroup]) -> float:
        """The slowest on-device step after the last reduction, with ZeRO-1/2's parameter
        all-gather (ZeRO-3 gathers in the next forward instead); offloaded stages step on
        the host (:meth:`_offloaded_end_s`)."""
        steps = [self.cost.optimizer_step_s(self.devices[k][j][0].type, c.params,
                                            stage_sharding(self.plan, k, j))
                 for k, stage_costs in enumerate(costs) for j, c in enumerate(stage_costs)
                 if not c.shape.offload]
        return max(steps, default=0.0) + self._parameter_gather_s(groups)

    def _priority_iteration_s(self, costs: list[list[StageCost]], groups: list[GradientGroup],
                              done: dict[StageRef, float], norm_end_s: float) -> float:
        """The steady-state step under the priority schedule
        (:mod:`potluck.planner.comm.step_overlap`): each stage ready after the norm, its own
        optimizer step (an offloaded one from its own reduction) and the part of its
        parameter all-gather that its next first forward does not hide."""
        gathers = self.member_gathers_s(groups)
        offloaded = offloaded_steps_s(self.cost, self.plan)
        chunks = schedule_for(self.plan.schedule).chunks(self.plan.virtual_stages)
        ready, starts = [], []
        for k, stage_costs in enumerate(costs):
            starts.append(first_forward_starts_s([c.work for c in stage_costs], chunks))
            row = []
            for j, c in enumerate(stage_costs):
                if (k, j) in offloaded:
                    stepped = max(norm_end_s, done[(k, j)] + offloaded[(k, j)])
                else:
                    stepped = norm_end_s + self.cost.optimizer_step_s(
                        self.devices[k][j][0].type, c.params, stage_sharding(self.plan, k, j))
                delay = gathered_forward_delay_s(gathers.get((k, j), 0.0),
                                                 c.work.forward_s / chunks, c.shape.num_layers)
                row.append(stepped + delay)
            ready.append(row)
        return next_step_bound_s(ready, starts)

    def member_gathers_s(self, groups: list[GradientGroup]) -> dict[StageRef, float]:
        """ZeRO-1/2: each stage's parameter all-gather, all starting together and sharing
        the machines' cards while they run (:func:`shared_ends`, as the reductions)."""
        if not (self.plan.shards_optimizer and self.plan.dp > 1):
            return {}
        gathering = [g for g in groups if g.gathers and len(g.members) > 1]
        collectives = []
        for group in gathering:
            latency, work = group.gather_terms(self.cost)
            collectives.append(Collective(group.rings, latency, work, 0.0))
        ends = shared_ends(self.cost, collectives)
        return {member: end for group, end in zip(gathering, ends, strict=True)
                for member in group.members}

    def _parameter_gather_s(self, groups: list[GradientGroup]) -> float:
        """ZeRO-1/2: the owners' updated parameters all-gathered after the step."""
        return max(self.member_gathers_s(groups).values(), default=0.0)

    def _offloaded_end_s(self, costs: list[list[StageCost]], done: dict[StageRef, float]
                         ) -> float:
        """When the last offloaded stage's host step ends: each starts once its own stage's
        gradients are reduced (under 1F1B later stages finish first), every offloading rank
        of a machine running Adam in its DRAM at once. Overlap with the next forward would
        need ZeRO-Offload's one-step delayed update, which changes the numerics: not done."""
        steps = offloaded_steps_s(self.cost, self.plan)
        return max((done[ref] + step for ref, step in steps.items()), default=0.0)

    def _breakdown(self, costs: list[list[StageCost]], times: list[PipelineTime],
                   dp_s: float, optimizer_s: float) -> TimeBreakdown:
        slowest = max(range(len(times)), key=lambda k: times[k].total_s)
        t, m = times[slowest], self.plan.pipelines[slowest].num_micro_batches
        stage = costs[slowest][t.bottleneck_stage]
        compute, ep = m * stage.compute_s, m * stage.exchange_s
        tp = max(0.0, m * (stage.work.total_s - stage.compute_s) - ep)
        pp = max(0.0, m * (t.period_s - stage.work.total_s)) + t.fill_transfer_s
        bubble = max(0.0, t.total_s - compute - tp - ep - pp)
        return TimeBreakdown(compute, bubble, tp, pp, dp_s, optimizer_s, ep)

    def _memory(self, costs: list[list[StageCost]]) -> list[DeviceMemory]:
        """Per device its own bytes and the swap stashes it holds for its peers."""
        held: dict[str, float] = {}
        for k, stage_costs in enumerate(costs):
            for j, c in enumerate(stage_costs):
                if c.peer_swap_bytes and c.shape.swap_peer is not None:
                    peer = c.shape.swap_peer  # every TP rank's stash (tp 1: the search's peers)
                    held[peer] = held.get(peer, 0.0) + c.peer_swap_bytes * len(self.devices[k][j])
        return [self._device_memory(device, k, j, c, held.get(device.id, 0.0))
                for k, stage_costs in enumerate(costs)
                for j, c in enumerate(stage_costs)
                for device in self.devices[k][j]]

    def _device_memory(self, device: Device, k: int, j: int, c: StageCost,
                       peer_held: float) -> DeviceMemory:
        sharding = stage_sharding(self.plan, k, j)
        layout = self.cost.state_layout(device.type, sharding)
        states = self.cost.model_state_bytes(device.type, c.params, sharding)
        weights = layout.weights * c.params / sharding.parameter_shards
        grads = layout.grads * c.params / sharding.gradient_shards
        optimizer = states - weights - grads
        working = self.cost.zero_working_bytes(device.type, len(self.devices[k][j]), c.shape,
                                               sharding)
        overhead = self.cost.overhead_bytes(device.type)
        total = states + working + c.activations_bytes + overhead + peer_held
        offloaded = formulas.host_state_bytes(c.params, sharding)
        return DeviceMemory(device.id, k, j, weights, grads, optimizer, c.activations_bytes,
                            total, host_bytes=offloaded + c.host_swap_bytes,
                            swapped_out_bytes=c.swapped_out_bytes, peer_held_bytes=peer_held,
                            offloaded_bytes=offloaded, zero_working_bytes=working)

    def _summary(self, iteration_s: float, breakdown: TimeBreakdown,
                 memory: list[DeviceMemory], costs: list[list[StageCost]]) -> Prediction:
        plan, model = self.plan, self.cost.model
        tokens = plan.training.global_batch * plan.training.seq_len
        tokens_per_s = tokens / iteration_s
        flops_per_s = counts.model_flops_per_token(model, plan.training.seq_len) * tokens_per_s
        used = [d for stages in self.devices for stage in stages for d in stage]
        # MFU against the peak of the dtype each device computes in (TF32, FP32 or 16-bit)
        peak_flops = sum(gemm.peak_flops(d.type, plan.training.dtype) for d in used)
        return Prediction(
            iteration_time_s=iteration_s,
            tokens_per_s=tokens_per_s,
            tflops_per_gpu=flops_per_s / len(used) / 1e12,
            mfu=flops_per_s / peak_flops,
            peak_memory_bytes=max(m.total_bytes for m in memory),
            breakdown=breakdown,
            memory=tuple(memory),
            host_memory=host_memory(self.cost, memory),
            stage_times_s=tuple(tuple(c.work.total_s for c in s) for s in costs),
        )



def offloaded_steps_s(cost: CostModel, plan: Plan) -> dict[StageRef, float]:
    """Per stage that offloads its optimizer, its host step
    (:meth:`CostModel.offloaded_step_s`), every offloading rank of a machine stepping its
    share in the machine's DRAM at once."""
    devices = stage_devices(cost, plan)
    params: dict[StageRef, float] = {}
    on_host: dict[str, float] = {}
    for k, pipeline in enumerate(plan.pipelines):
        for i in range(pipeline.pp):
            shape = stage_shape(plan, k, i)
            if shape.offload:
                params[(k, i)] = cost.stage_params(shape, len(devices[k][i]))
                shards = stage_sharding(plan, k, i).optimizer_shards
                for device in devices[k][i]:
                    on_host[device.node] = on_host.get(device.node, 0.0) + params[(k, i)] / shards
    return {(k, i): cost.offloaded_step_s(devices[k][i][0], p, stage_sharding(plan, k, i),
                                          on_host[devices[k][i][0].node])
            for (k, i), p in params.items()}


def peer_held_bytes(cost: CostModel, plan: Plan) -> dict[str, float]:
    """Per device, the swap stashes it holds for its peers at their peak."""
    schedule = schedule_for(plan.schedule)
    devices = stage_devices(cost, plan)
    held: dict[str, float] = {}
    for k, pipeline in enumerate(plan.pipelines):
        for i in range(pipeline.pp):
            shape = stage_shape(plan, k, i)
            if shape.swap_peer is None or not shape.swapped:
                continue
            tp = len(devices[k][i])
            in_flight = schedule.in_flight(i, pipeline.pp, pipeline.num_micro_batches,
                                           plan.virtual_stages)
            peer = cost.swap_bytes(devices[k][i][0].type, tp, shape, in_flight).peer
            held[shape.swap_peer] = held.get(shape.swap_peer, 0.0) + peer * tp
    return held


def host_memory(cost: CostModel, memory: list[DeviceMemory]) -> tuple[HostMemory, ...]:
    """Per machine a plan uses: the host bytes its ranks place there (offloaded optimizer
    states, host-swapped activations; a CPU rank's whole "device" is host memory too), the
    reserve for the OS and the ranks' processes, and what the machine has."""
    used: dict[str, float] = {}
    ranks: dict[str, int] = {}
    for m in memory:
        device = cost.cluster.device(m.device)
        on_host = m.host_bytes + (m.total_bytes if device.type.is_cpu else 0.0)
        used[device.node] = used.get(device.node, 0.0) + on_host
        ranks[device.node] = ranks.get(device.node, 0) + 1
    return tuple(HostMemory(node, used[node],
                            HOST_OS_RESERVE_BYTES + ranks[node] * HOST_RANK_RESERVE_BYTES,
                            cost.cluster.host_memory_bytes(node))
                 for node in sorted(used))


def host_memory_problem(prediction: Prediction) -> str | None:
    """The first machine whose host memory a predicted plan overfills, in one line."""
    for host in prediction.host_memory:
        if not host.fits:
            return (f"machine {host.node} needs {host.needed_bytes / 1e9:.0f} GB of host memory "
                    f"({host.used_bytes / 1e9:.0f} GB offloaded or swapped, "
                    f"{host.reserve_bytes / 1e9:.0f} GB for the OS and the ranks), it has "
                    f"{host.capacity_bytes / 1e9:.0f} GB; swap or offload less, or set "
                    "host_memory in the cluster file")
    return None
