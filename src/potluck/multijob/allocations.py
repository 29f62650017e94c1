"""Allocations: which whole machines of a cluster a job gets, and the sub-cluster they form.

The unit is a machine of a node group: GPUs of one machine share its PCIe, NVLink and
network card, and a cluster manager hands out machines, so jobs never split one. An
:class:`Allocation` says how many machines of each node group a job holds (machines of a
group are alike, so the count is all the planner needs); :func:`subcluster` turns it into
a :class:`~potluck.cluster.spec.ClusterSpec` holding only those machines, which potluck's
planner plans as it plans any cluster.

:func:`candidate_allocations` restricts what jobs may get, since every allocation a job
is considered on costs a planner call: per node group 1, 2, 4, ... machines. On clusters
of at most :data:`SMALL_CLUSTER_GPUS` GPUs also all of a group's machines, and mixes:
every combination of those counts across groups when there are at most
:data:`MAX_MIXED_CANDIDATES` of them, else the unions of whole groups (a job may then mix
GPU types, which the planner plans natively). On larger clusters a job runs on a power
of two of one group's machines, as in Gavel (Narayanan et al., OSDI'20), where a job runs
on one accelerator type per round: planning the five job shapes of a trace on every
candidate of a 256-GPU cluster of three groups then takes about 30 s.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from potluck.cluster.calibration import Calibration
from potluck.cluster.spec import ClusterSpec

SMALL_CLUSTER_GPUS = 64  # clusters up to this size also offer whole groups and mixes
MAX_MIXED_CANDIDATES = 48  # every combination of group sizes, if there are no more than this


@dataclass(frozen=True, order=True)
class Allocation:
    """Machines per node group: ``((group, count), ...)`` in cluster-file order, counts > 0."""

    machines: tuple[tuple[str, int], ...]

    @staticmethod
    def of(spec: ClusterSpec, counts: Mapping[str, int]) -> Allocation:
        return Allocation(tuple((g.name, counts[g.name]) for g in spec.nodes
                                if counts.get(g.name, 0) > 0))

    @property
    def counts(self) -> dict[str, int]:
        return dict(self.machines)

    @property
    def num_machines(self) -> int:
        return sum(count for _, count in self.machines)

    @property
    def groups(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.machines)

    def num_gpus(self, spec: ClusterSpec) -> int:
        per_node = {g.name: g.gpus_per_node for g in spec.nodes}
        return sum(per_node[name] * count for name, count in self.machines)

    def fits(self, free: Mapping[str, int]) -> bool:
        return all(free.get(name, 0) >= count for name, count in self.machines)

    def label(self) -> str:
        """``2xa100+4xbox3090``: machines per node group."""
        return "+".join(f"{count}x{name}" for name, count in self.machines)


def capacity(spec: ClusterSpec) -> dict[str, int]:
    """Machines per node group of the whole cluster."""
    return {group.name: group.count for group in spec.nodes}


def whole_cluster(spec: ClusterSpec) -> Allocation:
    return Allocation.of(spec, capacity(spec))


def candidate_allocations(spec: ClusterSpec) -> tuple[Allocation, ...]:
    """What a job may be given, fewest machines first (see the module docstring)."""
    small = spec.num_gpus <= SMALL_CLUSTER_GPUS
    sizes = {group.name: _sizes(group.count, whole=small) for group in spec.nodes}
    found = {Allocation(((name, count),)) for name, counts in sizes.items() for count in counts}
    if small and math.prod(len(counts) + 1 for counts in sizes.values()) <= MAX_MIXED_CANDIDATES:
        found |= {Allocation.of(spec, dict(zip(sizes, combination, strict=True)))
                  for combination in itertools.product(*([0, *c] for c in sizes.values()))
                  if any(combination)}
    elif small:
        found |= {Allocation.of(spec, {g.name: g.count for g in subset})
                  for size in range(2, len(spec.nodes) + 1)
                  for subset in itertools.combinations(spec.nodes, size)}
    return tuple(sorted(found, key=lambda a: (a.num_machines, a.machines)))


def _sizes(count: int, *, whole: bool) -> list[int]:
    """1, 2, 4, ... up to ``count``, and ``count`` itself if ``whole``."""
    sizes = list(itertools.takewhile(lambda n: n <= count, (2**k for k in itertools.count())))
    return sorted({*sizes, count}) if whole else sizes


def subcluster(spec: ClusterSpec, allocation: Allocation) -> ClusterSpec:
    """The cluster of only ``allocation``'s machines: its groups with fewer machines (renumbered
    from 0), the device types and declared links among them, the calibration that applies."""
    counts = allocation.counts
    nodes = tuple(replace(g, count=counts[g.name]) for g in spec.nodes if g.name in counts)
    kept = {g.name for g in nodes}
    types = {g.gpu for g in nodes}
    return ClusterSpec(
        nodes=nodes,
        device_types=tuple(t for t in spec.device_types if t.name in types),
        links=tuple(link for link in spec.links if set(link.between) <= kept),
        name=spec.name, calibration=_calibration(spec.calibration, kept, types),
        execution=spec.execution,
    )


def _calibration(found: Calibration | None, groups: set[str], types: set[str]) -> Calibration | None:
    """What of ``found`` concerns the kept groups and device types (it is already applied
    to them; kept so the sub-cluster's plans say what was measured)."""
    if found is None:
        return None
    links = tuple(
        replace(link, groups=tuple(g for g in link.groups if g in groups))
        for link in found.links
        if (link.between is None or set(link.between) <= groups)
        and (not link.groups or set(link.groups) & groups)
    )
    devices = tuple(d for d in found.devices if d.device in types)
    return Calibration(devices=devices, links=links, source=found.source)


def machine_ids(spec: ClusterSpec) -> Iterable[tuple[str, int]]:
    """Every machine as ``(group, index)`` in cluster-file order."""
    return ((group.name, index) for group in spec.nodes for index in range(group.count))
