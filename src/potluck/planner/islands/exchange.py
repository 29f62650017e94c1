"""What the exchange between islands costs: one owner for its bytes, its time and the part of
it that training waits for.

- **Bytes**: every outer step each island sends the pseudo-gradient of every parameter (the
  weights at the last outer step minus the weights now; DiLoCo, Douillard et al. 2023,
  arXiv:2311.08105, Algorithm 1) at the compression's bytes per value
  (:attr:`potluck.plans.islands.Compression.bytes_per_value`).
- **Time**: a ring all-reduce of those bytes over the islands
  (:func:`potluck.planner.formulas.ring_allreduce_time_s`, the one ring formula), each hop at
  the slowest link between the machines of two neighbouring islands and the ring at its
  slowest hop. The link between two islands is taken as one path that all their flows share
  (a site's uplink, a WAN link between two groups): the whole pseudo-gradient crosses it, not
  one share per rank, a conservative choice that the links of a cluster file (per group, not
  per flow) cannot refine.
- **Host staging** (islands whose transport is ``host``: another vendor's, or CPUs): the
  wire (:class:`potluck.runtime.grads.islands.CrossIslandWire`) copies each accelerator
  rank's payload, at the compression's width, to host memory before the gloo collective and
  brings the sum back as FP32 after it, each over the rank's own host link (PCIe, the
  group's ``host_bandwidth``). Ranks copy at once, so the exchange lasts the slowest rank's
  two copies longer; a CPU rank copies nothing.
- **Exposed per inner step**: plain DiLoCo blocks at each outer step, so its whole exchange
  is exposed once every H steps. Streaming DiLoCo (Douillard et al. 2025, arXiv:2501.18512)
  sends F fragments at staggered steps (:meth:`potluck.plans.islands.Islands.exchanges_at`),
  each overlapping the inner steps until the next fragment is due (``H // F`` whole steps,
  :attr:`~potluck.plans.islands.Islands.overlap_steps`, when the runtime applies it): a fragment's
  exposed part is ``max(0, its time - the compute it overlaps)``. ``bounded`` with a
  staleness of 1 or more overlaps its exchange with the H steps until the next push: the
  link carries one push at a time, so more pushes in flight hide nothing more (a push every
  H steps of an exchange longer than H steps waits ``exchange - H steps`` per push however
  many are in flight; the simulator's drawn cycle shows it, ``potluck.sim.outer``).
"""

from __future__ import annotations

from dataclasses import dataclass

from potluck import placement
from potluck.cluster.topology import Cluster, Device
from potluck.model import counts
from potluck.model.spec import ModelSpec
from potluck.planner import formulas
from potluck.planner.network import RingLink
from potluck.plans import Plan
from potluck.plans.islands import Compression, Islands, SyncMethod


@dataclass(frozen=True)
class OuterExchange:
    """One outer step's exchange between the islands of a plan."""

    bytes_per_outer_step: float  # what each island sends per outer step (all fragments)
    exchange_s: float  # one whole exchange (every fragment) over the slowest link, staged
    exposed_per_step_s: float  # what training waits for, amortized over the inner steps
    link: RingLink  # the slowest link between neighbouring islands


NO_EXCHANGE = OuterExchange(0.0, 0.0, 0.0, RingLink(float("inf"), 0.0))


def pseudo_gradient_bytes(model: ModelSpec, compression: Compression) -> float:
    """Bytes of one pseudo-gradient of every parameter of ``model`` on the wire."""
    return counts.total_params(model) * compression.bytes_per_value


def island_devices(cluster: Cluster, plan: Plan) -> list[list[Device]]:
    """Per island, the devices of its pipelines."""
    islands = plan.islands
    return [[cluster.device(d) for k in islands.members(i, plan.dp)
             for d in plan.pipelines[k].devices]
            for i in range(islands.count)]


def between_islands(cluster: Cluster, devices: list[list[Device]]) -> RingLink:
    """The ring through the islands in order: its slowest hop's bandwidth (the slowest link
    between any machine of one island and any of the next) and its worst latency."""
    bandwidth, latency = float("inf"), 0.0
    for index, island in enumerate(devices):
        following = devices[(index + 1) % len(devices)]
        if following is island:
            continue
        for a in _one_per_machine(island):
            for b in _one_per_machine(following):
                link = cluster.link(a, b)
                bandwidth = min(bandwidth, link.bandwidth_bytes_per_s)
                latency = max(latency, link.latency_s)
    return RingLink(bandwidth, latency)


def _one_per_machine(devices: list[Device]) -> list[Device]:
    return list({d.node: d for d in devices}.values())


def exchange_s(num_bytes: float, islands: int, link: RingLink) -> float:
    """One all-reduce of ``num_bytes`` over ``islands`` islands on ``link``."""
    if islands <= 1:
        return 0.0
    return formulas.ring_allreduce_time_s(num_bytes, islands, link.bandwidth_bytes_per_s,
                                          link.latency_s)


STAGED_SUM_BYTES_PER_VALUE = 4.0
"""A host-staged sum comes back to the device in FP32 (the wire widens it on the host)."""


def staging_s(cluster: Cluster, plan: Plan) -> float:
    """The time a host-staged exchange adds: the slowest accelerator rank's copy of its
    pseudo-gradient down to host memory and of the sum back (module docstring); 0 where the
    islands meet over their backend. A rank holds its stage's units over its tensor-parallel
    group (:func:`potluck.placement.unit_params`)."""
    if not plan.islands.host_staged:
        return 0.0
    per_value = plan.islands.compression.bytes_per_value + STAGED_SUM_BYTES_PER_VALUE
    units = placement.parameter_units(plan.model)
    slowest_s = 0.0
    for pipeline in plan.pipelines:
        for i, stage in enumerate(pipeline.stages):
            params = sum(placement.unit_params(plan.model, u) for u in units
                         if placement.stage_holds(stage, i, pipeline.pp, u)) / len(stage.devices)
            for device in (cluster.device(d) for d in stage.devices):
                if not device.type.is_cpu:
                    slowest_s = max(slowest_s, params * per_value
                                    / cluster.host_bandwidth_bytes_per_s(device))
    return slowest_s


def whole_exchange_s(cluster: Cluster, plan: Plan, link: RingLink) -> float:
    """One whole exchange of ``plan``'s islands (every fragment) on ``link``: the ring
    all-reduce of the pseudo-gradient at the compression's width, and its host staging."""
    islands = plan.islands
    ring_s = exchange_s(pseudo_gradient_bytes(plan.model, islands.compression), islands.count,
                        link)
    return ring_s + staging_s(cluster, plan)


def exposed_per_step_s(islands: Islands, whole_exchange_s: float, step_s: float) -> float:
    """The part of the outer exchange that training waits for, per inner step (see the
    module docstring): diloco blocks for each fragment beyond the ``H // F`` steps it overlaps
    (one fragment: no overlap); bounded overlaps the H steps until its next push when it may
    run a push ahead (staleness 1 or more), none at staleness 0."""
    h = islands.inner_steps
    if not islands.split:
        return 0.0
    if islands.sync is SyncMethod.BOUNDED:
        return max(0.0, whole_exchange_s - min(1, islands.staleness) * h * step_s) / h
    fragments = islands.fragments
    fragment_s = whole_exchange_s / fragments
    overlapped_s = islands.overlap_steps * step_s  # the runtime applies it then (whole steps)
    return fragments * max(0.0, fragment_s - overlapped_s) / h


def outer_exchange(cluster: Cluster, plan: Plan, step_s: float) -> OuterExchange:
    """The exchange of ``plan``'s islands, with inner steps of ``step_s`` seconds."""
    islands = plan.islands
    if not islands.split:
        return NO_EXCHANGE
    link = between_islands(cluster, island_devices(cluster, plan))
    whole_s = whole_exchange_s(cluster, plan, link)
    return OuterExchange(pseudo_gradient_bytes(plan.model, islands.compression), whole_s,
                         exposed_per_step_s(islands, whole_s, step_s), link)
