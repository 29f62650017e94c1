"""Which concrete machines each job's allocation gets, keeping jobs where they are.

A policy decides how many machines of each node group a job holds; this module picks
the machines (``(group, index)``, the index of ``<group>.<index>`` device ids). A job
keeps the machines it had wherever its new allocation still has room for them, so a
job whose allocation did not change does not move (and pays no restart); the rest are
filled from the free machines in index order.
"""

from __future__ import annotations

from collections.abc import Mapping

from potluck.cluster.spec import ClusterSpec
from potluck.multijob.allocations import Allocation, machine_ids

Machine = tuple[str, int]  # (node group, machine index)


def assign_machines(spec: ClusterSpec, previous: Mapping[str, tuple[Machine, ...]],
                    allocations: Mapping[str, Allocation]) -> dict[str, tuple[Machine, ...]]:
    """The machines of every job of ``allocations`` (which must fit the cluster together)."""
    kept = {job: _kept(previous.get(job, ()), allocation) for job, allocation in allocations.items()}
    taken = {machine for machines in kept.values() for machine in machines}
    free = [machine for machine in machine_ids(spec) if machine not in taken]
    chosen = {}
    for job, allocation in allocations.items():
        machines = list(kept[job])
        for group, count in allocation.machines:
            need = count - sum(1 for g, _ in machines if g == group)
            extra = [m for m in free if m[0] == group][:need]
            if len(extra) < need:
                raise ValueError(f"allocations exceed node group {group!r}")
            machines += extra
            free = [m for m in free if m not in extra]
        chosen[job] = tuple(sorted(machines, key=_order(spec)))
    return chosen


def _kept(machines: tuple[Machine, ...], allocation: Allocation) -> list[Machine]:
    """Of the machines a job held, those its new allocation has room for."""
    room = allocation.counts
    kept = []
    for group, index in machines:
        if room.get(group, 0) > 0:
            kept.append((group, index))
            room[group] -= 1
    return kept


def _order(spec: ClusterSpec):
    position = {group.name: i for i, group in enumerate(spec.nodes)}
    return lambda machine: (position[machine[0]], machine[1])


def machine_name(machine: Machine) -> str:
    """``<group>.<index>``, the machine's id in device ids."""
    return f"{machine[0]}.{machine[1]}"
