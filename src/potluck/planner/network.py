"""The cost model's network: links, rings, shared network cards and collective times.

Every time the planner charges for moving bytes between devices comes from
here, so a hop's bandwidth, a ring's bottleneck and a network card's sharing
are computed in one place:

- a hop ``a -> b`` is the cluster's link between the two devices
  (:meth:`potluck.cluster.topology.Cluster.link`); when it leaves a machine,
  its network card is shared by the other flows crossing that card at the
  same time: the hop gets ``1 / max(flows at a's card, flows at b's card)``
  of the link (:class:`NicSharing`);
- a *ring* runs at its slowest hop's bandwidth and pays its worst hop's
  latency (:meth:`Network.ring_link`); a ring all-reduce, reduce-scatter or
  all-gather over it takes :func:`potluck.planner.formulas.ring_collective_time_s`;
- an *all-to-all* (expert parallelism's token exchange) sends ``1/g`` of each
  member's bytes to every other member: a member's sends inside its machine
  share its own link, and every member's sends leaving a machine share that
  machine's network card, so it takes the busiest of those resources, plus
  one latency per peer (:meth:`Network.alltoall_s`);
- a *send* between pipeline stages runs one lane per pair of tensor-parallel
  ranks side by side, each with its share of the bytes; it takes as long as
  its slowest lane (:meth:`Network.send_s`); in a pipeline whose stages span vendors
  every lane is staged through host memory and also pays its two devices' copies to and
  from host memory (:func:`host_staging_s`).

How many flows share each card depends on what runs at once, which only the
caller knows: the pipeline's stage boundaries (:meth:`NicSharing.of_pipelines`),
the gradient rings of a step (:meth:`NicSharing.of_rings`), or, for the
search's quick estimates, every GPU of a machine (:meth:`NicSharing.whole_machines`).
The simulator (:mod:`potluck.sim.network`) shares the same links max-min
fairly instead, op by op.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from potluck.cluster.topology import Cluster, Device
from potluck.planner import formulas


@dataclass(frozen=True)
class NicSharing:
    """How many flows cross each machine's network card at once (machines not named: 1)."""

    flows: Mapping[str, int] = field(default_factory=dict)

    def share(self, a: Device, b: Device) -> int:
        """Flows sharing the hop ``a -> b``: 1 inside a machine, else the busier card's."""
        if a.node == b.node or not self.flows:
            return 1
        return max(self.flows.get(a.node, 1), self.flows.get(b.node, 1))

    @classmethod
    def of_pipelines(cls, pipelines: Iterable[Sequence[Sequence[Device]]]) -> NicSharing:
        """Pipeline transfers sharing each card in one direction.

        Every stage boundary that crosses machines carries one flow per TP lane:
        activations one way, gradients back at other times. A card is shared by the
        flows leaving it (or arriving at it, whichever are more); pipelines crossing
        the same card share it.
        """
        leaving: dict[str, int] = defaultdict(int)
        arriving: dict[str, int] = defaultdict(int)
        for stages in pipelines:
            for sender, receiver in zip(stages, stages[1:], strict=False):
                for a, b in zip(sender, receiver, strict=False):
                    if a.node != b.node:
                        leaving[a.node] += 1
                        arriving[b.node] += 1
        return cls({node: max(leaving.get(node, 0), arriving.get(node, 0))
                    for node in set(leaving) | set(arriving)})

    @classmethod
    def of_rings(cls, rings: Iterable[Sequence[Device]]) -> NicSharing:
        """Rings that run at once: each ring crossing machines uses each of their cards."""
        flows: dict[str, int] = defaultdict(int)
        for ring in rings:
            nodes = {d.node for d in ring}
            if len(nodes) > 1:
                for node in nodes:
                    flows[node] += 1
        return cls(dict(flows))

    @classmethod
    def whole_machines(cls, cluster: Cluster, devices: Iterable[Device]) -> NicSharing:
        """Every GPU of each machine of ``devices`` crosses the machine's card at once (the
        search's quick estimates, before it knows which flows overlap)."""
        return cls({d.node: cluster.groups[d.group].gpus_per_node for d in devices})


NO_SHARING = NicSharing()


class RingHops:
    """The hops of rings that run together (one collective), reduced to what their bandwidth
    under any sharing depends on, for callers that re-share them many times
    (:func:`potluck.planner.evaluate.shared_ends`): the slowest hop inside a machine, each
    distinct hop between machines, and the flows the rings add to each card
    (:meth:`NicSharing.of_rings`)."""

    def __init__(self, cluster: Cluster, rings: Sequence[Sequence[Device]]) -> None:
        self.inside_bytes_per_s = float("inf")
        crossing: dict[tuple[str, str], float] = {}
        self.flows = NicSharing.of_rings(rings).flows
        for ring in rings:
            for index, a in enumerate(ring):
                b = ring[(index + 1) % len(ring)]
                bandwidth = cluster.link(a, b).bandwidth_bytes_per_s
                if a.node == b.node:
                    self.inside_bytes_per_s = min(self.inside_bytes_per_s, bandwidth)
                else:
                    pair = (a.node, b.node)
                    crossing[pair] = min(crossing.get(pair, bandwidth), bandwidth)
        self.crossing = [(bandwidth, a, b) for (a, b), bandwidth in crossing.items()]

    def bandwidth_bytes_per_s(self, flows: Mapping[str, int]) -> float:
        """The slowest hop's bandwidth with the cards shared by ``flows`` (as
        :meth:`Network.ring_link` gives each ring's)."""
        slowest = self.inside_bytes_per_s
        for bandwidth, a, b in self.crossing:
            slowest = min(slowest, bandwidth / max(flows.get(a, 1), flows.get(b, 1)))
        return slowest


class RingLink(NamedTuple):
    """A ring's bottleneck: its slowest hop's bandwidth and its worst hop's latency."""

    bandwidth_bytes_per_s: float
    latency_s: float


class Network:
    """Transfer and collective times over one cluster's links."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    def ring_link(self, ring: Sequence[Device], sharing: NicSharing = NO_SHARING) -> RingLink:
        """The bottleneck of a ring through ``ring`` in order (the last device back to the first)."""
        bandwidth, latency = float("inf"), 0.0
        flows = sharing.flows
        for index, a in enumerate(ring):
            b = ring[(index + 1) % len(ring)]
            link = self.cluster.link(a, b)
            hop_bandwidth = link.bandwidth_bytes_per_s
            if flows and a.node != b.node:  # NicSharing.share, inlined: the search's hot loop
                hop_bandwidth /= max(flows.get(a.node, 1), flows.get(b.node, 1))
            bandwidth = min(bandwidth, hop_bandwidth)
            latency = max(latency, link.latency_s)
        return RingLink(bandwidth, latency)

    def allreduce_s(self, num_bytes: float, ring: Sequence[Device],
                    sharing: NicSharing = NO_SHARING) -> float:
        """Ring all-reduce of ``num_bytes`` over ``ring``."""
        if len(ring) <= 1:
            return 0.0
        link = self.ring_link(ring, sharing)
        return formulas.ring_allreduce_time_s(num_bytes, len(ring), link.bandwidth_bytes_per_s,
                                              link.latency_s)

    def reduce_scatter_s(self, num_bytes: float, ring: Sequence[Device],
                         sharing: NicSharing = NO_SHARING) -> float:
        """Reduce-scatter (or all-gather) of a ``num_bytes`` result over ``ring``."""
        link = self.ring_link(ring, sharing)
        return formulas.ring_allgather_time_s(num_bytes, len(ring), link.bandwidth_bytes_per_s,
                                              link.latency_s)

    def alltoall_s(self, num_bytes: float, members: Sequence[Device]) -> float:
        """All-to-all of ``num_bytes`` per member (see the module docstring): pairwise
        exchange (:func:`formulas.pairwise_alltoall_time_s`) at the pace of the busiest
        member link or network card."""
        g = len(members)
        if g <= 1:
            return 0.0
        share = num_bytes / g
        busy: dict[tuple[str, str], float] = defaultdict(float)  # seconds per link or card
        latency = 0.0
        for a in members:
            for b in members:
                if a is b:
                    continue
                link = self.cluster.link(a, b)
                latency = max(latency, link.latency_s)
                resource = ("device", a.id) if a.node == b.node else ("card", a.node)
                busy[resource] += share / link.bandwidth_bytes_per_s
        outbound = (g - 1) * share  # what each member sends in all
        bandwidth = outbound / max(busy.values())  # the busiest resource's pace
        return formulas.pairwise_alltoall_time_s(num_bytes, g, bandwidth, latency)

    def send_s(self, sender: Sequence[Device], receiver: Sequence[Device], num_bytes: float,
               sharing: NicSharing = NO_SHARING, host_staged: bool = False) -> float:
        """``num_bytes`` from one stage to the next, split over lanes of TP ranks side by side;
        ``host_staged``: through host memory (a pipeline that spans vendors), each lane also
        paying :func:`host_staging_s`."""
        lanes = min(len(sender), len(receiver))
        lane_bytes = num_bytes / lanes
        worst = 0.0
        for rank in range(lanes):
            a, b = sender[rank], receiver[rank]
            link = self.cluster.link(a, b)
            share = sharing.share(a, b)
            staging = host_staging_s(self.cluster, a, b, lane_bytes) if host_staged else 0.0
            worst = max(worst, link.latency_s + lane_bytes * share / link.bandwidth_bytes_per_s
                        + staging)
        return worst


def host_staging_s(cluster: Cluster, sender: Device, receiver: Device,
                   num_bytes: float) -> float:
    """What staging one transfer of ``num_bytes`` through host memory adds to it (the stage
    boundaries of a pipeline that spans vendors): the copy from ``sender``'s memory to its
    host and the copy from ``receiver``'s host to its memory, each over that device's host
    link (a CPU rank copies nothing). The cost model's sends and the simulator's flows both
    charge it."""
    return sum(num_bytes / cluster.host_bandwidth_bytes_per_s(d) for d in (sender, receiver)
               if not d.type.is_cpu)
