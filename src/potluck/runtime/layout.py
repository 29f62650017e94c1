"""Which rank does what, and the process groups that follow from a Plan.

:class:`Layout` is the one owner of the rank-to-device mapping and of every
process group the runtime uses. It is built from the plan and the device id
of each rank (gathered at start-up, so launchers may number ranks as they
like), and answers for this rank:

- its :class:`Role`: pipeline, stage, position in the stage's tensor-parallel
  group (its TP index), the layer ranges of its virtual stages;
- the tensor-parallel mesh of its stage;
- its pipeline lane: the ranks with the same tensor-parallel index in each
  stage of its pipeline (lane ``r`` passes the ``r``-th sequence shard from
  stage to stage); when the stages of a pipeline have different TP degrees,
  only the leaders' lane (TP rank 0) exists and the other ranks follow their
  leader (:mod:`potluck.runtime.parallel.mixed_tp`). When the plan splits its
  P2P channels (``plan.comm.split_p2p_channels``), each lane has a second
  process group over the same ranks for the gradients going back, so
  activations and gradients never queue behind each other on one communicator;
- for every parameter unit (the embedding, each block, the head) the group
  that sums its gradients: the ranks that hold that unit in every pipeline.
  When all holders use the same TP degree, the group is aligned (ranks with
  the same TP index, local shards are summed as they are); otherwise it is a
  full-layout group (every holder rank; shards are summed in the full
  tensor's layout). Heterogeneous plans are just different groups.

**Islands.** When the plan's islands synchronize rarely (``plan.islands.split``), every
per-step group stays inside the rank's island: a unit's holders, its gradient sync group,
ZeRO's owners and the norm's owner are those of the island's pipelines
(``Plan.island_pipelines``), and the island's ranks have a group of their own
(:attr:`Layout.island_group`: its token count, gradient norm and loss). Across islands, a
unit's holders in every pipeline form its cross-island group
(:meth:`Layout.cross_island_group`), which the outer step sums over
(:mod:`potluck.runtime.grads.islands`). Every island's groups are created on every rank.
When some island's transport is ``host`` (``Islands.host_staged``), the cross-island groups
are gloo groups beside the backend's (``dist.new_group(ranks, backend="gloo")``), which take
host tensors (:meth:`Layout.on_host`): the wire stages each payload through host memory.
A pipeline whose stages are of several vendors (:attr:`Layout.lane_on_host`) keeps its lanes
on the gloo world, so its stage-to-stage transfers are host tensors too.

**Rank order.** torchrun numbers ranks machine by machine, so a plan's device
order need not be rank order (a pipeline ``a.0:0 -> b.0:0 -> b.0:1 -> a.0:1``,
which keeps the embedding and head on one machine, runs on ranks 0, 2, 3, 1;
:func:`potluck.runtime.launch.torchrun.torchrun_rank_order`). torch numbers
the members of a process group in ascending global rank (``dist.new_group``
sorts them, a ``DeviceMesh`` built from a group takes that order, a
``PipelineStage`` names its peers by group rank), so every "position in a
group" here is a group rank:

- a rank's TP index is its position among its stage's ranks in ascending rank
  order (:meth:`Layout.stage_ranks`), which is its coordinate in the stage's TP
  mesh; lanes, aligned gradient groups and ZeRO-1's owners pair equal TP
  indices; with ranks numbered in plan order this is the plan's device order;
- a pipeline lane lists its ranks in stage order, and the schedule maps each
  stage to its rank's group rank
  (:func:`potluck.runtime.parallel.pipeline.build_schedule`).

Groups are created collectively in one fixed order on every rank, then
reused. Building a Layout without ``create_groups`` is pure and cheap (used
to validate a plan against a world size before anything starts).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from potluck import placement
from potluck.cluster.topology import Cluster, spans_vendors
from potluck.errors import ConfigError
from potluck.plans import Plan, check_plan, shards_parameters
from potluck.plans.vendors import pipeline_spans_vendors

HOST_BACKEND = "gloo"
"""The backend of host-staged cross-island groups (islands of another vendor, or of CPUs)."""


@dataclass(frozen=True)
class Role:
    """What one rank runs."""

    rank: int
    device: str
    pipeline: int
    stage: int
    tp_rank: int
    tp: int
    pp: int
    layer_ranges: tuple[tuple[int, int], ...]

    @property
    def virtual_stage_ids(self) -> tuple[int, ...]:
        """Chunk ``c`` of stage ``i`` is virtual stage ``c * pp + i``."""
        return tuple(chunk * self.pp + self.stage for chunk in range(len(self.layer_ranges)))

    @property
    def num_virtual_stages(self) -> int:
        return self.pp * len(self.layer_ranges)

    @property
    def holds_embedding(self) -> bool:
        return self.stage == 0

    @property
    def holds_head(self) -> bool:
        return self.stage == self.pp - 1


@dataclass(frozen=True)
class SyncGroup:
    """The ranks that sum one unit's gradients, and how."""

    ranks: tuple[int, ...]
    aligned: bool  # True: same TP layout on every member; False: sum in the full layout

    @property
    def trivial(self) -> bool:
        return len(self.ranks) == 1


class Layout:
    """Rank roles and process groups of one plan on one world."""

    def __init__(self, plan: Plan, rank: int, device_of_rank: tuple[str, ...]) -> None:
        check_plan(plan)
        self.plan = plan
        self.rank = rank
        self.world_size = len(device_of_rank)
        _check_world(plan, device_of_rank)
        self.device_of_rank = device_of_rank
        self._rank_of_device = {device: r for r, device in enumerate(device_of_rank)}
        self._groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        self._sync_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        self._backward_lanes: dict[tuple[int, ...], dist.ProcessGroup] = {}
        self._tp_mesh: DeviceMesh | None = None
        self._ep_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        self._ep_mesh: DeviceMesh | None = None
        self._island_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        self._host_groups: set[tuple[int, ...]] = set()
        self._gpu_backend: str | None = None
        self._holders: dict[tuple[str, tuple[int, ...]], tuple[tuple[int, int], ...]] = {}

    @classmethod
    def for_local_ranks(cls, plan: Plan, rank: int) -> Layout:
        """Rank ``i`` runs the plan's ``i``-th device (the local launcher's numbering)."""
        return cls(plan, rank, plan.devices)

    # --- roles -----------------------------------------------------------------------------

    @cached_property
    def roles(self) -> tuple[Role, ...]:
        roles: dict[int, Role] = {}
        for p, pipeline in enumerate(self.plan.pipelines):
            for s, stage in enumerate(pipeline.stages):
                for t, rank in enumerate(self.stage_ranks(p, s)):
                    roles[rank] = Role(rank, self.device_of_rank[rank], p, s, t, stage.tp,
                                       pipeline.pp, stage.layer_ranges)
        return tuple(roles[r] for r in range(self.world_size))

    @property
    def role(self) -> Role:
        return self.roles[self.rank]

    def stage_ranks(self, pipeline: int, stage: int) -> tuple[int, ...]:
        """The stage's ranks by TP index: ascending, the order of its process group and
        TP mesh (see "Rank order" above), whatever order the plan lists its devices in."""
        devices = self.plan.pipelines[pipeline].stages[stage].devices
        return tuple(sorted(self._rank_of_device[d] for d in devices))

    def lane_ranks(self, pipeline: int, tp_rank: int) -> tuple[int, ...]:
        """The ranks of TP index ``tp_rank`` in each stage of ``pipeline``, in stage order."""
        stages = range(self.plan.pipelines[pipeline].pp)
        return tuple(self.stage_ranks(pipeline, s)[tp_rank] for s in stages)

    def mixed_tp(self, pipeline: int) -> bool:
        """Whether the stages of ``pipeline`` have different TP degrees (it then runs on its
        leaders; see :mod:`potluck.runtime.parallel.mixed_tp`)."""
        return len({stage.tp for stage in self.plan.pipelines[pipeline].stages}) > 1

    def num_lanes(self, pipeline: int) -> int:
        """Pipeline lanes: one per TP rank, or only the leaders' when TP degrees differ."""
        return 1 if self.mixed_tp(pipeline) else self.plan.pipelines[pipeline].stages[0].tp

    @property
    def is_follower(self) -> bool:
        """A TP rank > 0 of a mixed-TP pipeline: it mirrors its stage leader's schedule."""
        return self.mixed_tp(self.role.pipeline) and self.role.tp_rank > 0

    @property
    def is_announcing_leader(self) -> bool:
        """TP rank 0 of a multi-rank stage in a mixed-TP pipeline: it commands followers."""
        role = self.role
        return self.mixed_tp(role.pipeline) and role.tp_rank == 0 and role.tp > 1

    @cached_property
    def batch_offsets(self) -> tuple[int, ...]:
        """First row of each pipeline's share of the global batch."""
        offsets, start = [], 0
        for pipeline in self.plan.pipelines:
            offsets.append(start)
            start += pipeline.batch_share
        return tuple(offsets)

    @property
    def batch_rows(self) -> tuple[int, int]:
        """``(start, count)``: this rank's replica's rows of each global batch."""
        p = self.role.pipeline
        return self.batch_offsets[p], self.plan.pipelines[p].batch_share

    @property
    def is_replica_leader(self) -> bool:
        """One rank per pipeline (TP rank 0 of its first stage) speaks for the replica."""
        return self.role.stage == 0 and self.role.tp_rank == 0

    @property
    def is_loss_reporter(self) -> bool:
        """TP rank 0 of each pipeline's last stage reports that replica's loss."""
        return self.role.holds_head and self.role.tp_rank == 0

    # --- parameter units ---------------------------------------------------------------------

    def units(self) -> tuple[str, ...]:
        return placement.parameter_units(self.plan.model, self.plan.ep)

    @property
    def island_pipelines(self) -> tuple[int, ...]:
        """The pipelines this rank exchanges gradients with every step (its island's)."""
        return self.plan.island_pipelines(self.role.pipeline)

    def holders(self, unit: str, pipelines: tuple[int, ...] | None = None
                ) -> tuple[tuple[int, int], ...]:
        """``(pipeline, stage)`` of every stage of ``pipelines`` (default: this rank's island)
        that holds ``unit``, in plan order (:func:`potluck.placement.holders`; an expert
        unit: those of its shard)."""
        pipelines = self.island_pipelines if pipelines is None else pipelines
        key = (unit, pipelines)
        if key not in self._holders:
            found = tuple(h for h in placement.holders(self.plan, unit) if h[0] in pipelines)
            shard = placement.expert_shard(unit)
            if shard is not None:
                found = tuple(h for h in found if self.expert_shard_of(*h) == shard)
            self._holders[key] = found
        return self._holders[key]

    # --- expert parallelism ------------------------------------------------------------------

    def expert_ranks(self, pipeline: int, stage: int) -> tuple[int, ...]:
        """The ranks that exchange tokens with stage ``stage`` of ``pipeline``: that stage in
        each pipeline of its expert group, ascending (the group's and the mesh's order)."""
        group = self.plan.expert_group(pipeline)
        return tuple(sorted(self.stage_ranks(k, stage)[0] for k in group))

    def expert_shard_of(self, pipeline: int, stage: int) -> int:
        """Which shard of the routed experts stage ``stage`` of ``pipeline`` holds."""
        return self.expert_ranks(pipeline, stage).index(self.stage_ranks(pipeline, stage)[0])

    def _expert_group_ranks(self) -> list[tuple[int, ...]]:
        """Every stage's expert group, in plan order (none without expert parallelism)."""
        if self.plan.ep == 1:
            return []
        return [self.expert_ranks(p, s) for p in range(0, self.plan.dp, self.plan.ep)
                for s in range(self.plan.pipelines[p].pp)]

    def expert_mesh(self, device_type: str) -> DeviceMesh | None:
        """The 1-D mesh of this rank's expert group (None without expert parallelism)."""
        if self.plan.ep == 1:
            return None
        if self._ep_mesh is None:
            ranks = self.expert_ranks(self.role.pipeline, self.role.stage)
            if ranks not in self._ep_groups:
                raise RuntimeError(f"no expert group for ranks {ranks}; create_groups() first")
            self._ep_mesh = DeviceMesh.from_group(self._ep_groups[ranks], device_type,
                                                  list(ranks), mesh_dim_names=("ep",))
        return self._ep_mesh

    def sync_group(self, unit: str, tp_rank: int | None = None,
                   pipelines: tuple[int, ...] | None = None) -> SyncGroup:
        """The group in which this rank (or TP index ``tp_rank``) sums ``unit``'s gradients
        with the holders among ``pipelines`` (default: this rank's island)."""
        holders = self.holders(unit, pipelines)
        tps = {self.plan.pipelines[p].stages[s].tp for p, s in holders}
        if len(tps) == 1:
            index = self.role.tp_rank if tp_rank is None else tp_rank
            ranks = tuple(self.stage_ranks(p, s)[index] for p, s in holders)
            return SyncGroup(tuple(dict.fromkeys(ranks)), aligned=True)
        ranks = tuple(r for p, s in holders for r in self.stage_ranks(p, s))
        return SyncGroup(tuple(dict.fromkeys(ranks)), aligned=False)

    def cross_island_group(self, unit: str) -> SyncGroup:
        """The group in which this rank sums ``unit`` with its holders in every island."""
        return self.sync_group(unit, pipelines=tuple(range(self.plan.dp)))

    def norm_owner(self, unit: str) -> tuple[int, int]:
        """The stage whose copy of ``unit`` counts in the island's gradient norm."""
        return self.holders(unit)[0]

    def island_ranks(self, island: int) -> tuple[int, ...]:
        """Every rank of island ``island``'s pipelines, ascending."""
        members = self.plan.islands.members(island, self.plan.dp)
        return tuple(sorted(r for p in members
                            for s in range(self.plan.pipelines[p].pp)
                            for r in self.stage_ranks(p, s)))

    @property
    def island_group(self) -> dist.ProcessGroup | None:
        """This rank's island's group (None: the world's default group, no islands)."""
        if not self.plan.islands.split:
            return None
        ranks = self.island_ranks(self.plan.islands.island_of(self.role.pipeline))
        return self._island_groups[ranks]

    # --- process groups ----------------------------------------------------------------------

    def _pipeline_group_ranks(self) -> list[tuple[int, ...]]:
        """Stage (TP) groups and pipeline lanes, in plan order."""
        wanted: list[tuple[int, ...]] = []
        for p, pipeline in enumerate(self.plan.pipelines):
            for s in range(pipeline.pp):
                wanted.append(self.stage_ranks(p, s))
            for t in range(self.num_lanes(p)):
                wanted.append(self.lane_ranks(p, t))
        return wanted

    def _sync_group_ranks(self) -> list[tuple[int, ...]]:
        """Every unit's gradient sync groups, in unit order: each island's, then (islands
        that synchronize rarely) the cross-island ones."""
        if not self.plan.islands.split:
            return self._unit_group_ranks(tuple(range(self.plan.dp)))
        wanted = [r for k in range(self.plan.islands.count)
                  for r in self._unit_group_ranks(self.plan.islands.members(k, self.plan.dp))]
        return wanted + self._cross_island_ranks()

    def _cross_island_ranks(self) -> list[tuple[int, ...]]:
        """Every unit's cross-island groups, in unit order (islands that synchronize rarely)."""
        if not self.plan.islands.split:
            return []
        return self._unit_group_ranks(tuple(range(self.plan.dp)))

    def _unit_group_ranks(self, pipelines: tuple[int, ...]) -> list[tuple[int, ...]]:
        """Every unit's gradient sync groups among ``pipelines``, in unit order."""
        wanted: list[tuple[int, ...]] = []
        for unit in self.units():
            holders = self.holders(unit, pipelines)
            max_tp = max(self.plan.pipelines[p].stages[s].tp for p, s in holders)
            for t in range(max_tp):
                wanted.append(self.sync_group(unit, tp_rank=t, pipelines=pipelines).ranks)
        return wanted

    def create_groups(self, gpu_backend: str | None = None) -> None:
        """Create every process group (collective: all ranks call this, same order);
        ``gpu_backend``: the backend of the groups of GPU ranks only, where the world's is
        gloo across vendors (:func:`~potluck.runtime.launch.gpus.island_backend`).

        A gradient sync group with the same ranks as a pipeline lane or stage gets a
        process group of its own (say the tied embedding/head of a single pipeline), so
        its all-reduces, which overlap the schedule, never queue behind the pipeline's
        sends and receives on one communicator."""
        if self._groups:
            return
        self._gpu_backend = gpu_backend
        pipeline_ranks = [r for r in self._pipeline_group_ranks() if len(r) > 1]
        host = self._host_staged_ranks()
        sync_ranks = [r for r in self._sync_group_ranks() if len(r) > 1 and r not in host]
        for ranks in dict.fromkeys(pipeline_ranks + sync_ranks):
            group = self._new_group(ranks)
            if self.rank in ranks:
                self._groups[ranks] = group
        for ranks in host:
            group = dist.new_group(list(ranks), backend=HOST_BACKEND)
            if self.rank in ranks:
                self._groups[ranks] = group
                self._host_groups.add(ranks)
        shared = set(pipeline_ranks)
        for ranks in dict.fromkeys(r for r in sync_ranks if r in shared):
            group = self._new_group(ranks)
            if self.rank in ranks:
                self._sync_groups[ranks] = group
        if self.plan.comm.split_p2p_channels:
            self._create_backward_lanes()
        for ranks in self._expert_group_ranks():  # their own: all-to-alls in every block
            group = self._new_group(ranks)
            if self.rank in ranks:
                self._ep_groups[ranks] = group
        if self.plan.islands.split:
            self._create_island_groups()

    def _new_group(self, ranks: tuple[int, ...]) -> dist.ProcessGroup:
        """A group of ``ranks`` over the world's backend, or over the GPU islands' own
        where every member is a GPU of one vendor and the world is gloo across vendors (a
        lane of a pipeline that spans vendors stays on the gloo world)."""
        if (self._gpu_backend is None or any(self._on_cpu(r) for r in ranks)
                or self._spans_vendors(ranks)):
            return dist.new_group(list(ranks))
        return dist.new_group(list(ranks), backend=self._gpu_backend)

    def _on_cpu(self, rank: int) -> bool:
        return self._cluster.device(self.device_of_rank[rank]).type.is_cpu

    def _spans_vendors(self, ranks: tuple[int, ...]) -> bool:
        return spans_vendors(self._cluster.device(self.device_of_rank[r]) for r in ranks)

    @cached_property
    def lane_on_host(self) -> bool:
        """Whether this rank's pipeline spans vendors (HETHUB-style), so that its lanes pass
        host tensors over gloo: every stage-to-stage transfer is staged through host memory
        (:func:`potluck.runtime.parallel.pipeline.host_staged`)."""
        return pipeline_spans_vendors(self.plan, self.role.pipeline)

    @cached_property
    def _cluster(self) -> Cluster:
        return Cluster(self.plan.cluster)

    def _host_staged_ranks(self) -> list[tuple[int, ...]]:
        """The cross-island groups that are staged through host memory over gloo (every one
        when some island's transport is host), in creation order."""
        if not self.plan.islands.host_staged:
            return []
        return list(dict.fromkeys(r for r in self._cross_island_ranks() if len(r) > 1))

    def on_host(self, ranks: tuple[int, ...]) -> bool:
        """Whether the group of ``ranks`` takes host (CPU) tensors: a host-staged
        cross-island group, created over gloo whatever the ranks' own backend."""
        return ranks in self._host_groups

    def _create_island_groups(self) -> None:
        """One group per island (its own: the step's norm and token count), in island
        order; a one-rank island gets a group of its rank alone, so that every collective of
        a step has a group whatever the island's size."""
        for island in range(self.plan.islands.count):
            ranks = self.island_ranks(island)
            group = self._new_group(ranks)
            if self.rank in ranks:
                self._island_groups[ranks] = group

    def member_groups(self) -> list[tuple[tuple[int, ...], dist.ProcessGroup]]:
        """Every process group this rank is in, with its ranks, in the order
        :meth:`create_groups` made them (one order for every rank)."""
        return [*self._groups.items(), *self._sync_groups.items(),
                *self._backward_lanes.items(), *self._ep_groups.items(),
                *self._island_groups.items()]

    def lane_neighbours(self) -> list[tuple[int, int]]:
        """The pairs of ranks that send to each other on this rank's lane, in lane order:
        neighbouring stages, and the last with the first when the pipeline runs several chunks
        per stage (an interleaved schedule's next chunk); none for a follower."""
        role = self.role
        if self.is_follower or role.pp == 1:
            return []
        lane = self.lane_ranks(role.pipeline, role.tp_rank)
        pairs = list(zip(lane, lane[1:], strict=False))
        if len(role.layer_ranges) > 1 and role.pp > 2:
            pairs.append((lane[-1], lane[0]))
        return [pair for pair in pairs if self.rank in pair]

    def _lanes(self) -> list[tuple[int, ...]]:
        """Every pipeline lane of more than one rank, in plan order."""
        return [self.lane_ranks(p, t) for p, pipeline in enumerate(self.plan.pipelines)
                for t in range(self.num_lanes(p)) if pipeline.pp > 1]

    def _create_backward_lanes(self) -> None:
        """A second process group per lane, for backward traffic (split P2P channels)."""
        for ranks in self._lanes():
            group = self._new_group(ranks)
            if self.rank in ranks:
                self._backward_lanes[ranks] = group

    def group(self, ranks: tuple[int, ...]) -> dist.ProcessGroup | None:
        """The process group of exactly these ranks (None for a single rank)."""
        if len(ranks) == 1:
            return None
        try:
            return self._groups[ranks]
        except KeyError:
            message = f"no process group for ranks {ranks}; create_groups() first"
            raise RuntimeError(message) from None

    def sync_process_group(self, ranks: tuple[int, ...]) -> dist.ProcessGroup | None:
        """The process group in which gradient sync group ``ranks`` sums (see create_groups)."""
        if ranks in self._sync_groups:
            return self._sync_groups[ranks]
        return self.group(ranks)

    @property
    def lane_group(self) -> dist.ProcessGroup | None:
        """This rank's pipeline lane (None for a follower, which exchanges nothing)."""
        role = self.role
        if self.is_follower:
            return None
        return self.group(self.lane_ranks(role.pipeline, role.tp_rank))

    @property
    def lane_group_backward(self) -> dist.ProcessGroup | None:
        """The group on which this rank's lane sends gradients back: a second group over the
        lane's ranks when the plan splits its P2P channels, else :attr:`lane_group` itself."""
        if not self.plan.comm.split_p2p_channels or self.is_follower:
            return self.lane_group
        ranks = self.lane_ranks(self.role.pipeline, self.role.tp_rank)
        if len(ranks) == 1:
            return None
        if ranks not in self._backward_lanes:
            raise RuntimeError(f"no backward lane group for ranks {ranks}; create_groups() first")
        return self._backward_lanes[ranks]

    @property
    def stage_group(self) -> dist.ProcessGroup | None:
        role = self.role
        return self.group(self.stage_ranks(role.pipeline, role.stage))

    def tp_mesh(self, device_type: str) -> DeviceMesh | None:
        """The 1-D device mesh of this rank's tensor-parallel group (None without TP)."""
        role = self.role
        if role.tp == 1:
            return None
        if self._tp_mesh is None:
            ranks = self.stage_ranks(role.pipeline, role.stage)
            if shards_parameters(self.plan):
                self._tp_mesh = self._dp_tp_mesh(device_type)["tp"]
            else:
                # torch refuses a mesh whose order is not the group's: TP index = coordinate
                self._tp_mesh = DeviceMesh.from_group(self.group(ranks), device_type, list(ranks))
        return self._tp_mesh

    def _dp_tp_mesh(self, device_type: str) -> DeviceMesh:
        """ZeRO-3 with TP: this stage's ``(dp, tp)`` mesh (row ``p``: pipeline ``p``'s ranks
        of the stage), whose ``tp`` slice is the TP mesh and ``dp`` slice FSDP2's; every
        replica holds the stage alike (:func:`potluck.plans.zero3_problem`)."""
        role = self.role
        rows = [self.stage_ranks(p, role.stage) for p in range(self.plan.dp)]
        dp = tuple(row[role.tp_rank] for row in rows)
        tp = self.stage_ranks(role.pipeline, role.stage)
        groups = [self.sync_process_group(dp), self.group(tp)]
        return DeviceMesh.from_group(groups, device_type, mesh=torch.tensor(rows),
                                     mesh_dim_names=("dp", "tp"))

def _check_world(plan: Plan, device_of_rank: tuple[str, ...]) -> None:
    if len(device_of_rank) != plan.num_gpus:
        raise ConfigError(
            f"the plan uses {plan.num_gpus} devices ({plan.layout()}) but {len(device_of_rank)} "
            f"ranks were started; start exactly {plan.num_gpus} ranks or make a plan for this world"
        )
    missing = sorted(set(plan.devices) - set(device_of_rank))
    if missing:
        raise ConfigError(
            f"no rank runs plan device(s) {', '.join(missing)}; ranks run "
            f"{', '.join(device_of_rank)}"
        )
    if len(set(device_of_rank)) != len(device_of_rank):
        raise ConfigError(f"two ranks claim the same device: {', '.join(device_of_rank)}")
