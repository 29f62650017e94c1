"""The devices an elastic run may use, and the planner's plan for exactly those.

A cluster file describes machines in groups of identical ones; devices come and go one
by one. :func:`present_cluster` rewrites the cluster as the devices that are there: in
each group the machines that are whole stay together, each machine that lost GPUs becomes
a group of its own with fewer GPUs (NVSwitch still joining them all; bridges kept only
where the GPUs left still pair up as bridged), declared links copied to every piece. The search plans on that
cluster (:func:`plan_for_devices`), and the plan is then moved back onto the whole
cluster: every device under its own id (so a GPU rank still finds its CUDA device), the
others listed as unused, the prediction made again there.

A plan of islands that synchronize rarely treats an island as the unit that leaves or
joins:

- when devices go and none joins (:func:`without_lost_islands`), each island that lost one
  leaves whole (its devices left behind stay unused), the others keep their layouts and
  take over its rows of the global batch (in proportion to the rows they had, which the
  planner set in proportion to their throughput; inside an island in proportion to its
  pipelines' rows), and one island left is a plan without islands;
- when devices join (:func:`with_joined_island`; the devices the plan does not run count as
  joined), they become one more island: the islands that lost no device keep their
  layouts, the search lays out the joined devices on a cluster of them only (plan-wide
  choices pinned to the plan's: schedule, ZeRO stage, expert groups), and the global
  batch's rows are split between the islands as the islands planner splits them
  (:mod:`potluck.planner.islands.choose`: by peak FLOPS, then by predicted throughput when
  their steps differ); H, compression, fragments and the outer optimizer stay the plan's.
  An island of another vendor meets the others through host memory. When the joined
  devices cannot hold the model, the whole pool is planned as for any plan, and a warning
  says why.

Either plan ends its notes with one that says what changed (the planner's notes before it
describe the plan it came from). The run resumes from its newest checkpoint, a consensus
state of the islands, as another split (:mod:`potluck.runtime.checkpoints.island_files`).
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass, replace

from potluck.cluster.nodes import LinkSpec, NodeGroup, NvlinkTopology
from potluck.cluster.spec import ClusterSpec
from potluck.cluster.topology import Cluster, device_id, spans_vendors
from potluck.errors import ConfigError, InfeasibleError
from potluck.planner.evaluate import predict
from potluck.planner.islands.choose import (
    batch_rows,
    island_layout,
    peak_flops,
    rebalanced_speeds,
    remapped,
)
from potluck.planner.islands.exchange import island_devices
from potluck.planner.islands.planning import island_search
from potluck.planner.options import SearchOptions
from potluck.planner.search import search
from potluck.plans import Island, Pipeline, Plan, Stage, check_plan
from potluck.plans.islands import ONE_ISLAND, Islands, Transport

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class PresentCluster:
    """The cluster of the devices that are there, and each of its device ids' original id."""

    spec: ClusterSpec
    original_id: dict[str, str]


def present_cluster(spec: ClusterSpec, present: Collection[str]) -> PresentCluster:
    """``spec`` cut down to the devices ``present`` (ids of ``spec``)."""
    unknown = sorted(set(present) - {d.id for d in Cluster(spec).devices})
    if unknown:
        raise ConfigError(f"device {unknown[0]!r} is not in cluster {spec.name!r}")
    groups: list[NodeGroup] = []
    ids: dict[str, str] = {}
    pieces: dict[str, list[str]] = {}
    for group in spec.nodes:
        for piece, machines in _pieces(group, present):
            groups.append(piece)
            pieces.setdefault(group.name, []).append(piece.name)
            ids.update(_original_ids(group, piece, machines))
    if not groups:
        raise ConfigError(f"no device of cluster {spec.name!r} is left")
    kept_types = {g.gpu for g in groups}
    return PresentCluster(replace(
        spec, nodes=tuple(groups), links=_links(spec.links, pieces), calibration=None,
        device_types=tuple(t for t in spec.device_types if t.name in kept_types)), ids)


def _pieces(group: NodeGroup, present: Collection[str]
            ) -> list[tuple[NodeGroup, list[tuple[int, list[int]]]]]:
    """The group's whole machines as one group (same name), each partial machine as a group
    of its own; with each piece, its machines as ``(original index, local indices)``."""
    whole: list[tuple[int, list[int]]] = []
    pieces = []
    for node in range(group.count):
        locals_ = [j for j in range(group.gpus_per_node)
                   if device_id(group.name, node, j) in present]
        if len(locals_) == group.gpus_per_node:
            whole.append((node, locals_))
        elif locals_:
            partial = replace(group, name=f"{group.name}-{node}", count=1,
                              gpus_per_node=len(locals_), nvlink=_nvlink(group, locals_))
            pieces.append((partial, [(node, locals_)]))
    if whole:
        pieces.insert(0, (replace(group, count=len(whole)), whole))
    return pieces


def _nvlink(group: NodeGroup, locals_: list[int]) -> NvlinkTopology:
    """NVLink among the GPUs ``locals_`` of a machine, renumbered 0, 1, ...: bridged pairs
    stay pairs only if every renumbered pair (0,1), (2,3), ... was a bridged pair."""
    if group.nvlink is not NvlinkTopology.PAIRS:
        return group.nvlink
    pairs = zip(locals_[0::2], locals_[1::2], strict=False)
    return (NvlinkTopology.PAIRS if all(a // 2 == b // 2 for a, b in pairs)
            else NvlinkTopology.NONE)


def _original_ids(group: NodeGroup, piece: NodeGroup, machines: list[tuple[int, list[int]]]
                  ) -> dict[str, str]:
    return {device_id(piece.name, k, j): device_id(group.name, node, local)
            for k, (node, locals_) in enumerate(machines) for j, local in enumerate(locals_)}


def _links(links: tuple[LinkSpec, ...], pieces: dict[str, list[str]]) -> tuple[LinkSpec, ...]:
    """Each declared link between two groups, between every piece of one and of the other."""
    return tuple(replace(link, between=(a, b)) for link in links
                 for a in pieces.get(link.between[0], ()) for b in pieces.get(link.between[1], ()))


def plan_for_devices(plan: Plan, present: Collection[str],
                     options: SearchOptions | None = None) -> Plan:
    """The search's best plan for ``plan``'s model and training on the devices ``present``,
    on ``plan``'s whole cluster (raises InfeasibleError when none fits); a plan of islands
    continues without the islands that lost devices and with the joined ones as an island
    (module docstring)."""
    options = options or SearchOptions()
    if plan.islands.split:
        if set(present) <= set(plan.devices):
            return without_lost_islands(plan, present)
        try:
            return with_joined_island(plan, present, options)
        except (ConfigError, InfeasibleError) as err:
            log.warning("the joined devices make no island of their own (%s); planning the "
                        "whole pool of %d devices", err, len(present))
    cut = present_cluster(plan.cluster, present)
    best = search(cut.spec, plan.model, plan.training, options).best
    return on_whole_cluster(best, plan.cluster, cut.original_id)


def without_lost_islands(plan: Plan, present: Collection[str]) -> Plan:
    """``plan`` without each island that has a device not ``present``: the others keep their
    layouts and share the global batch (module docstring)."""
    kept = _kept_islands(plan, present)
    rows = batch_rows(plan.training.global_batch,
                      [float(_island_rows(plan, i)) for i in kept])
    pipelines, members = _kept_pipelines(plan, kept, rows)
    kept_islands = replace(plan.islands, islands=tuple(members)) if len(members) > 1 \
        else ONE_ISLAND
    left = [i for i in range(plan.islands.count) if i not in kept]
    note = (f"elastic: island(s) {', '.join(map(str, left))} lost a device and left; the "
            "others took over their rows")
    return _finished(plan, pipelines, kept_islands, note)


def with_joined_island(plan: Plan, present: Collection[str],
                       options: SearchOptions | None = None) -> Plan:
    """``plan``'s islands that lost no device, laid out as they are, and the devices
    ``present`` that ``plan`` does not run as one more island (module docstring); raises
    InfeasibleError when those cannot hold the model or an island kept would get fewer rows
    than it has pipelines."""
    kept = _kept_islands(plan, present)
    used = set(plan.devices)
    cluster = Cluster(plan.cluster)
    joined = [d.id for d in cluster.devices if d.id in present and d.id not in used]
    if not joined:
        raise InfeasibleError("no device joined")
    cut = present_cluster(plan.cluster, joined)
    pins = replace(options or SearchOptions(), zero=plan.zero, schedule=plan.schedule,
                   virtual_stages=plan.virtual_stages, ep=plan.ep)
    devices = island_devices(cluster, plan)
    speeds = [peak_flops(devices[i], plan.training.dtype) for i in kept]
    speeds.append(peak_flops((cluster.device(d) for d in joined), plan.training.dtype))
    rows = _rows(plan, kept, speeds)
    parts = _joined_parts(plan, kept, cut, pins, rows)
    throughputs = rebalanced_speeds(parts, rows)
    if throughputs is not None:
        rows = _rows(plan, kept, throughputs)
        parts = _joined_parts(plan, kept, cut, pins, rows)
    return _with_island(plan, kept, rows, parts[-1][0], cut.original_id)


def _kept_islands(plan: Plan, present: Collection[str]) -> list[int]:
    """The islands of ``plan`` whose every device is ``present``."""
    islands = plan.islands
    kept = [i for i in range(islands.count)
            if all(d in present for p in islands.members(i, plan.dp)
                   for d in plan.pipelines[p].devices)]
    if not kept:
        raise InfeasibleError("every island lost a device")
    return kept


def _rows(plan: Plan, kept: list[int], speeds: list[float]) -> list[int]:
    """The global batch's rows in proportion to ``speeds`` (of the islands ``kept``, then
    the joined island's); InfeasibleError when an island kept gets fewer rows than it has
    pipelines."""
    rows = batch_rows(plan.training.global_batch, speeds)
    for island, island_rows in zip(kept, rows, strict=False):
        pipelines = len(plan.islands.members(island, plan.dp))
        if island_rows < pipelines:
            raise InfeasibleError(f"island {island} would get {island_rows} of the "
                                  f"{plan.training.global_batch} rows of each batch for its "
                                  f"{pipelines} pipelines")
    return rows


def _joined_parts(plan: Plan, kept: list[int], cut: PresentCluster, options: SearchOptions,
                  rows: list[int]) -> list[tuple[Plan, dict[str, str]]]:
    """Each kept island alone with its ``rows`` (predicted), and the joined devices' island
    laid out by the search with the last of ``rows``, as the islands planner's parts."""
    alone = [_island_alone(plan, island, island_rows)
             for island, island_rows in zip(kept, rows[:-1], strict=True)]
    new = island_layout(cut.spec, plan.model, plan.training, options, rows[-1], island_search)
    same = {d: d for d in plan.devices}
    return [*((p, same) for p in alone), (new, cut.original_id)]


def _island_alone(plan: Plan, island: int, rows: int) -> Plan:
    """Island ``island`` of ``plan`` as a plan of its own, with ``rows`` rows a step."""
    alone = replace(plan, training=replace(plan.training, global_batch=rows),
                    pipelines=tuple(_island_pipelines(plan, island, rows)), islands=ONE_ISLAND,
                    prediction=None)
    return replace(alone, prediction=predict(alone))


def _with_island(plan: Plan, kept: list[int], rows: list[int], new: Plan,
                 original_id: dict[str, str]) -> Plan:
    """The kept islands of ``plan`` with their ``rows`` and ``new`` (laid out on the cut
    cluster of ``original_id``) as the last island."""
    pipelines, members = _kept_pipelines(plan, kept, rows[:-1])
    start = len(pipelines)
    pipelines += [remapped(p, original_id, new, k) for k, p in enumerate(new.pipelines)]
    members.append(Island(tuple(range(start, len(pipelines)))))
    islands = _transported(plan, replace(plan.islands, islands=tuple(members)), pipelines)
    joined = sorted({original_id[d] for d in new.devices})
    note = (f"elastic: {', '.join(joined)} joined as island {len(members) - 1}, {rows[-1]} "
            f"rows of each batch of {sum(rows)}")
    return _finished(plan, pipelines, islands, note)


def _transported(plan: Plan, islands: Islands, pipelines: list[Pipeline]) -> Islands:
    """``islands`` (of ``pipelines``), every one's transport host when their devices are of
    several vendors (no backend joins two) or ``plan``'s islands already crossed through host
    memory; else as they are."""
    cluster = Cluster(plan.cluster)
    host = plan.islands.host_staged or spans_vendors(
        cluster.device(d) for p in pipelines for d in p.devices)
    if not host:
        return islands
    return replace(islands, islands=tuple(replace(i, transport=Transport.HOST)
                                          for i in islands.islands))


def _kept_pipelines(plan: Plan, kept: list[int], rows: list[int]
                    ) -> tuple[list[Pipeline], list[Island]]:
    """The pipelines of ``plan``'s islands ``kept`` with their ``rows``, and those islands
    with their pipelines numbered anew, in order."""
    pipelines: list[Pipeline] = []
    members: list[Island] = []
    for island, island_rows in zip(kept, rows, strict=True):
        own = _island_pipelines(plan, island, island_rows)
        members.append(replace(plan.islands.islands[island],
                               pipelines=tuple(range(len(pipelines), len(pipelines) + len(own)))))
        pipelines += own
    return pipelines, members


def _island_pipelines(plan: Plan, island: int, rows: int) -> list[Pipeline]:
    """Island ``island``'s pipelines with ``rows`` rows a step in all, shared in proportion
    to the rows they had."""
    own = [plan.pipelines[p] for p in plan.islands.members(island, plan.dp)]
    shares = batch_rows(rows, [float(p.batch_share) for p in own])
    return [_with_rows(p, r) for p, r in zip(own, shares, strict=True)]


def _finished(plan: Plan, pipelines: list[Pipeline], islands: Islands, note: str) -> Plan:
    """``plan`` with ``pipelines`` in ``islands``, the devices it no longer runs unused, and
    ``note`` (what changed: the notes before it describe the plan before), checked and
    predicted."""
    used = {d for p in pipelines for d in p.devices}
    unused = tuple(d.id for d in Cluster(plan.cluster).devices if d.id not in used)
    new = replace(plan, pipelines=tuple(pipelines), islands=islands, unused_devices=unused,
                  prediction=None, notes=(*plan.notes, note))
    check_plan(new)
    return replace(new, prediction=predict(new))


def _island_rows(plan: Plan, island: int) -> int:
    return sum(plan.pipelines[p].batch_share for p in plan.islands.members(island, plan.dp))


def _with_rows(pipeline: Pipeline, rows: int) -> Pipeline:
    """``pipeline`` with ``rows`` rows a step: more micro-batches of its size, or micro-batches
    of one row when its size does not divide ``rows``."""
    size = pipeline.micro_batch_size if rows % pipeline.micro_batch_size == 0 else 1
    return replace(pipeline, micro_batch_size=size, num_micro_batches=rows // size)


def on_whole_cluster(plan: Plan, whole: ClusterSpec, original_id: dict[str, str]) -> Plan:
    """``plan`` (made on a cut cluster) with its devices under their ids in ``whole``."""
    pipelines = tuple(replace(p, stages=tuple(_renamed(s, original_id) for s in p.stages))
                      for p in plan.pipelines)
    used = {original_id[d] for d in plan.devices}
    unused = tuple(d.id for d in Cluster(whole).devices if d.id not in used)
    moved = replace(plan, cluster=whole, pipelines=pipelines, unused_devices=unused,
                    prediction=None)
    return replace(moved, prediction=predict(moved))


def _renamed(stage: Stage, original_id: dict[str, str]) -> Stage:
    return replace(stage, devices=tuple(original_id[d] for d in stage.devices))


def predicted_step_s(plan: Plan) -> float:
    """The plan's predicted iteration time (predicted now if the plan carries none)."""
    return (plan.prediction or predict(plan)).iteration_time_s

