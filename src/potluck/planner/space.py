"""The search space: tensor-parallel units, stage orders and data-parallel widths.

A *unit* is one tensor-parallel group: ``tp`` GPUs of one machine, aligned so
that NVLink-bridged pairs stay together. A *family* is a set of node groups
whose units form identical pipelines: each of its ``dp`` pipelines takes
``k_g`` units of every group ``g`` in the family, in a fixed group order,
dealt pipeline- or data-major (:class:`UnitLayout`), optionally wrapped
around (:class:`Wrap`).
Families run side by side as data-parallel replicas with their own share of
the batch; a group may also be left out entirely.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from enum import Enum
from functools import cached_property

from potluck.cluster.spec import NodeGroup
from potluck.cluster.topology import Cluster, Device
from potluck.model.spec import ModelSpec

MAX_TP = 8


class UnitLayout(str, Enum):
    """How a family's units are dealt to its ``dp`` pipelines."""

    PIPELINE = "pipeline"  # pipeline-major: consecutive units of a machine form one pipeline
    DATA = "data"  # data-major: consecutive units of a machine belong to different replicas


class Wrap(str, Enum):
    """Which units go to the far end of each pipeline, next to the head."""

    NONE = "none"
    GROUP = "group"  # half the first group's units: embedding and head on one kind of device
    NODE = "node"  # half the first machine's units: embedding and head on one machine


@dataclass(frozen=True)
class Unit:
    """One tensor-parallel group: ``tp`` devices of one machine."""

    group: str
    node_index: int
    devices: tuple[Device, ...]
    node: str = ""

    def __post_init__(self) -> None:
        if not self.node:
            object.__setattr__(self, "node", self.devices[0].node)

    @cached_property
    def tp(self) -> int:  # cached: the search's hot loops ask millions of times
        return len(self.devices)


def group_units(cluster: Cluster, group: NodeGroup, tp: int) -> list[Unit]:
    """All units of a node group in machine order, ``tp`` consecutive GPUs each."""
    units = []
    for node_index in range(group.count):
        devices = cluster.node_devices(group.name, node_index)
        for start in range(0, group.gpus_per_node - tp + 1, tp):
            units.append(Unit(group.name, node_index, devices[start:start + tp]))
    return units


def tp_options(group: NodeGroup, model: ModelSpec, pinned: int | None) -> list[int]:
    """TP degrees that fit inside one machine of the group and divide the heads."""
    wanted = [pinned] if pinned else [t for t in (1, 2, 4, 8) if t <= MAX_TP]
    return [
        t for t in wanted
        if group.gpus_per_node % t == 0 and model.splits_by(t)
    ]


def stage_orders(groups: tuple[NodeGroup, ...], memory_of: dict[str, float],
                 speed_of: dict[str, float], exhaustive_up_to: int = 2) -> list[tuple[NodeGroup, ...]]:
    """Orders of a family's groups along its pipelines.

    Up to ``exhaustive_up_to`` groups, every order; beyond that the orders by memory
    (first stages hold the most activations) and by speed, each way round. The order by
    memory comes first either way.
    """
    by_memory = tuple(sorted(groups, key=lambda g: (-memory_of[g.name], g.name)))
    if len(groups) <= exhaustive_up_to:
        return list(dict.fromkeys([by_memory, *itertools.permutations(groups)]))
    orders = []
    for key in (memory_of, speed_of):
        ranked = tuple(sorted(groups, key=lambda g, key=key: (-key[g.name], g.name)))
        orders.extend([ranked, tuple(reversed(ranked))])
    return list(dict.fromkeys(orders))


def machine_subsets(group: NodeGroup) -> list[NodeGroup]:
    """The group itself and the same group cut to its first 1, 2, 4, ... machines: a
    family of one group may leave whole machines out (say, behind a slow network)."""
    counts = [n for n in (1 << k for k in range(group.count.bit_length())) if n < group.count]
    return [group, *(replace(group, count=n) for n in counts)]


def dp_candidates(unit_counts: list[int], max_pipelines: int) -> list[int]:
    """Replica counts worth trying for a family: the divisors of each group's unit
    count (no unit left idle in that group), capped by what the batch allows."""
    limit = min(min(unit_counts), max_pipelines)
    values = {d for count in unit_counts for d in range(1, count + 1) if count % d == 0}
    return sorted(d for d in values if d <= limit)
