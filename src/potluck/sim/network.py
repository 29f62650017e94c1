"""The links transfers cross, and how concurrent transfers share them.

A transfer is a :class:`Flow`: one or more *lanes* (tensor-parallel ranks
sending side by side, or the hops of a ring all-reduce) that each move
``lane_bytes`` after a start-up ``latency_s``. A lane crosses *resources*:

- an NVLink bridge or switch port between two GPUs: ``("nvlink", a, b)``,
  one per direction;
- PCIe between GPUs of one host: the sender's uplink ``("pcie_tx", a)`` and
  the receiver's downlink ``("pcie_rx", b)``;
- the network: the sending machine's card ``("nic_tx", node)``, the
  receiving machine's ``("nic_rx", node)`` (full duplex: sending and
  receiving do not share), and a declared link between two node groups
  ``("wan", group_a, group_b)`` when the cluster file declares one.

Capacities and latencies are the cluster's (:class:`potluck.cluster.topology.Cluster`,
what the cost model reads). Concurrent flows share each resource max-min fairly
(progressive filling, Bertsekas & Gallager, *Data Networks*, Sec. 6.5.2); a
flow never runs faster than its slowest lane's link, so a lone flow takes
exactly ``latency + lane_bytes / bandwidth``, the cost model's transfer time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from potluck.cluster.nodes import PathKind
from potluck.cluster.topology import Cluster, Device
from potluck.planner import formulas

Resource = tuple[str, ...]
SATURATED = 1e-9  # relative residual below which a resource counts as full


@dataclass(frozen=True)
class Flow:
    """A transfer: lanes moving ``lane_bytes`` each over the resources they cross."""

    lane_bytes: float
    latency_s: float
    cap_bytes_per_s: float  # the slowest lane's link bandwidth
    resources: tuple[tuple[Resource, int], ...]  # resource, lanes crossing it

class Network:
    """Resources of a cluster with their capacities, and the paths between devices."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.capacity: dict[Resource, float] = {}

    def path(self, a: Device, b: Device) -> tuple[list[Resource], float, float]:
        """Resources a transfer from ``a`` to ``b`` crosses, its bandwidth and latency."""
        link = self.cluster.link(a, b)
        if link.kind is PathKind.LOCAL:
            return [], link.bandwidth_bytes_per_s, 0.0
        if link.kind is PathKind.NVLINK:
            resources = [("nvlink", a.id, b.id)]
            self._add(resources[0], link.bandwidth_bytes_per_s)
        elif link.kind is PathKind.PCIE:
            resources = [("pcie_tx", a.id), ("pcie_rx", b.id)]
            for resource in resources:
                self._add(resource, link.bandwidth_bytes_per_s)
        else:
            resources = [("nic_tx", a.node), ("nic_rx", b.node)]
            self._add(resources[0], self.cluster.nic_bandwidth_bytes_per_s(a))
            self._add(resources[1], self.cluster.nic_bandwidth_bytes_per_s(b))
            if link.kind is PathKind.DECLARED:
                resources.append(("wan", a.group, b.group))
                self._add(resources[-1], link.bandwidth_bytes_per_s)
        return resources, link.bandwidth_bytes_per_s, link.latency_s

    def _add(self, resource: Resource, capacity: float) -> None:
        self.capacity.setdefault(resource, capacity)

    def lanes_flow(self, pairs: Sequence[tuple[Device, Device]], lane_bytes: float,
                   latency_factor: float = 1.0, serial_pairs: bool = False) -> Flow:
        """Lanes ``a -> b`` side by side, each moving ``lane_bytes``; ``serial_pairs``: each
        lane also holds the one in-order channel its two devices share in both directions
        (``("pair", a, b)``, point-to-point ops issued one at a time on one communicator)."""
        counts: dict[Resource, int] = {}
        cap, latency = float("inf"), 0.0
        for a, b in pairs:
            resources, bandwidth, lane_latency = self.path(a, b)
            if serial_pairs and resources:
                resources = [*resources, ("pair", *sorted((a.id, b.id)))]
                self._add(resources[-1], bandwidth)
            for resource in resources:
                counts[resource] = counts.get(resource, 0) + 1
            cap, latency = min(cap, bandwidth), max(latency, lane_latency)
        return Flow(lane_bytes, latency * latency_factor, cap, tuple(counts.items()))

    def ring_flow(self, rings: Sequence[Sequence[Device]], num_bytes_per_ring: float,
                  scatter: bool = False) -> Flow:
        """Ring all-reduces of ``num_bytes_per_ring`` over each ring, all at once.

        Every hop carries ``2(g-1)/g`` of the bytes and the ring pays ``2(g-1)``
        latencies (the cost model's :func:`potluck.planner.formulas.ring_terms`);
        a reduce-scatter (``scatter``) is the first half of that.
        """
        g = len(rings[0])
        pairs = [(ring[i], ring[(i + 1) % g]) for ring in rings for i in range(g)]
        passes = formulas.HALF_RING_PASSES if scatter else formulas.ALLREDUCE_PASSES
        hop_bytes, latencies = formulas.ring_terms(num_bytes_per_ring, g, passes)
        return self.lanes_flow(pairs, hop_bytes, latency_factor=latencies)


def max_min_rates(flows: dict[int, Flow], capacity: dict[Resource, float]) -> dict[int, float]:
    """Max-min fair rate of every lane of ``flows`` (progressive filling).

    All unfrozen flows grow at the same rate until a resource fills (its flows
    freeze) or a flow reaches its own link's bandwidth.
    """
    residual: dict[Resource, float] = {}
    load: dict[Resource, int] = {}
    for flow in flows.values():
        for resource, lanes in flow.resources:
            residual[resource] = capacity[resource]
            load[resource] = load.get(resource, 0) + lanes
    rates: dict[int, float] = {}
    open_flows = dict(flows)
    level = 0.0
    while open_flows:
        step = min((residual[r] / n for r, n in load.items() if n > 0), default=float("inf"))
        step = min(step, min(f.cap_bytes_per_s for f in open_flows.values()) - level)
        if step == float("inf"):  # nothing limits the rest (no shared resource, no link cap)
            rates.update(dict.fromkeys(open_flows, step))
            break
        level += step
        for resource, n in load.items():
            residual[resource] -= step * n
        frozen = [
            key for key, flow in open_flows.items()
            if flow.cap_bytes_per_s - level <= SATURATED * flow.cap_bytes_per_s
            or any(residual[r] <= SATURATED * capacity[r] for r, _ in flow.resources)
        ]
        for key in frozen:
            rates[key] = level
            for resource, lanes in open_flows.pop(key).resources:
                load[resource] -= lanes
    return rates
