"""The devices an elastic run may use, and the planner's plan for exactly those.

A cluster file describes machines in groups of identical ones; devices come and go one
by one. :func:`present_cluster` rewrites the cluster as the devices that are there: in
each group the machines that are whole stay together, each machine that lost GPUs becomes
a group of its own with fewer GPUs (NVSwitch still joining them all; bridges kept only
where the GPUs left still pair up as bridged), declared links copied to every piece. The search plans on that
cluster (:func:`plan_for_devices`), and the plan is then moved back onto the whole
cluster: every device under its own id (so a GPU rank still finds its CUDA device), the
others listed as unused, the prediction made again there.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, replace

from potluck.cluster.nodes import LinkSpec, NodeGroup, NvlinkTopology
from potluck.cluster.spec import ClusterSpec
from potluck.cluster.topology import Cluster, device_id
from potluck.errors import ConfigError
from potluck.planner.evaluate import predict
from potluck.planner.options import SearchOptions
from potluck.planner.search import search
from potluck.plans import Plan, Stage


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
    on ``plan``'s whole cluster (raises InfeasibleError when none fits)."""
    cut = present_cluster(plan.cluster, present)
    best = search(cut.spec, plan.model, plan.training, options or SearchOptions()).best
    return on_whole_cluster(best, plan.cluster, cut.original_id)


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

