"""Fitting link bandwidth and latency to the measured gradient all-reduces.

Each gradient group of the plan (the cost model's: a stage's replicas, a
pipeline's tied embeddings) all-reduces over rings, one per tensor-parallel
rank, which the cost model prices as ``2(n-1)/n x bytes / W + 2(n-1) alpha``
with ``W`` and ``alpha`` of the ring's slowest link. The runtime reduces all
of a rank's groups one after the other in one ``dp_allreduce`` op, and a
rank that finished its backward early waits for the others inside it; so per
step, among ranks in the same rings, the shortest op (the last rank to
arrive) measures the collectives. Each such op is one linear equation in
``1/W`` and ``alpha`` of the link classes its rings cross. Least squares
gives both where the reduced sizes differ (2x or more), else the bandwidth
with the latency kept. Where the plan overlaps the all-reduce with the
backward pass (``Execution.overlap_grad_reduce``, as the runtime does), the op
is only the exposed rest, and the cost model's overlap window is added back.

A link class is what a calibration entry can name: a kind (``pcie``,
``nvlink``, ``network``) inside one node group, or the network between two
groups. Pipeline transfers are not fitted: a receive's wait includes the
sender's lateness. Network cards shared by several rings are not modelled
here (one machine's runs never share one).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from potluck.calibrate import expected
from potluck.calibrate.measure import allreduce_s
from potluck.calibrate.solve import log_bisect
from potluck.cluster.nodes import PathKind
from potluck.cluster.spec import ClusterSpec
from potluck.cluster.topology import Cluster, Device, Link
from potluck.planner import formulas
from potluck.planner.cost import CostModel
from potluck.planner.evaluate import gradient_groups, predict
from potluck.plans import Plan
from potluck.traces import Trace

SIZE_SPREAD_FOR_LATENCY = 2.0
EXPOSED_FLOOR_S = 1e-4  # an overlapped all-reduce that left less than this was hidden
EXPOSED = "the exposed all-reduce an emulated run was padded to"
SCALE_RANGE = (1e-3, 1e4)

Terms = dict["LinkKey", tuple[float, float]]  # per link class: (bytes over W, latencies)


@dataclass(frozen=True)
class LinkKey:
    """A class of links a calibration entry names."""

    kind: PathKind  # pcie | nvlink | network
    group: str | None = None  # inside this node group
    between: tuple[str, str] | None = None  # or the network between these two

    def describe(self) -> str:
        return f"{self.kind.value} in {self.group}" if self.between is None else (
            f"network {self.between[0]}-{self.between[1]}")


@dataclass(frozen=True)
class LinkFit:
    key: LinkKey
    bandwidth_bytes_per_s: float
    latency_s: float | None  # None: kept as it was
    observations: int
    source: str = ""  # what the fit read, where it is not ``observations`` all-reduces


def link_key(cluster: Cluster, a: Device, b: Device) -> LinkKey:
    kind = cluster.link(a, b).kind
    if kind in (PathKind.PCIE, PathKind.NVLINK):
        return LinkKey(kind, a.group)
    if a.group == b.group:
        return LinkKey(PathKind.NETWORK, a.group)
    first, second = sorted((a.group, b.group))
    return LinkKey(PathKind.NETWORK, between=(first, second))


def _ring_terms(cluster: Cluster, ring: list[Device], num_bytes: float, *, scatter: bool) -> Terms:
    """A ring collective's bytes and latencies on its slowest link class: an all-reduce, or
    (ZeRO-1's ``scatter``) a reduce-scatter, half of one."""
    hops = [(ring[i], ring[(i + 1) % len(ring)]) for i in range(len(ring))]
    slowest = min(hops, key=lambda hop: cluster.link(*hop).bandwidth_bytes_per_s)
    passes = formulas.HALF_RING_PASSES if scatter else formulas.ALLREDUCE_PASSES
    return {link_key(cluster, *slowest): formulas.ring_terms(num_bytes, len(ring), passes)}


def device_terms(plan: Plan) -> tuple[dict[str, Terms], Cluster]:
    """Per device: the all-reduce terms of every ring it is in (summed per link class)."""
    cost = CostModel.for_plan(plan)
    terms: dict[str, Terms] = defaultdict(dict)
    for group in gradient_groups(cost, plan):
        if len(group.members) < 2:
            continue
        for ring in group.rings:
            for key, (bytes_term, latency_term) in _ring_terms(
                    cost.cluster, ring, group.bytes_per_ring, scatter=group.scatter).items():
                for device in ring:
                    old = terms[device.id].get(key, (0.0, 0.0))
                    terms[device.id][key] = (old[0] + bytes_term, old[1] + latency_term)
    return dict(terms), cost.cluster


def overlap_windows(plan: Plan) -> dict[str, float]:
    """Per device: the backward the cost model lets its all-reduces hide behind (the
    shortest one-micro-batch backward among the replicas of each of its groups)."""
    if not plan.training.execution.overlap_grad_reduce:
        return {}
    cost = CostModel.for_plan(plan)
    windows: dict[str, float] = {}
    for group in gradient_groups(cost, plan):
        window = min(expected.backward_s(cost, plan, k, j) for k, j in group.members)
        for device in (d for ring in group.rings for d in ring):
            windows[device.id] = min(windows.get(device.id, window), window)
    return windows


def observations(plan: Plan, measured: Trace) -> list[tuple[Terms, float]]:
    """(terms, seconds): per step, the fastest all-reduce op among ranks with the same terms.
    Where the plan overlaps the all-reduce with the backward pass, the op is the exposed
    rest: the window it hid behind is added back, and ops with nothing exposed (which only
    say the all-reduce fit in the window) are left out."""
    terms, _ = device_terms(plan)
    windows = overlap_windows(plan)
    found = []
    for seconds in allreduce_s(measured).values():
        fastest: dict[tuple, tuple[Terms, float]] = {}
        for device, duration_s in seconds.items():
            if device not in terms or (windows and duration_s < EXPOSED_FLOOR_S):
                continue
            duration_s += windows.get(device, 0.0)
            key = tuple(sorted((k.describe(), v) for k, v in terms[device].items()))
            if key not in fastest or duration_s < fastest[key][1]:
                fastest[key] = (terms[device], duration_s)
        found.extend(fastest.values())
    return found


def fit_links(plan: Plan, measured: Trace) -> tuple[LinkFit, ...]:
    """Bandwidth of each link class all-reduces use, and its latency where the reduced sizes
    differ enough."""
    rows = observations(plan, measured)
    keys = sorted({key for terms, _ in rows for key in terms}, key=LinkKey.describe)
    if not keys:
        return ()
    latency_now = _current_latencies(plan, keys)
    free = [key for key in keys if _sizes_spread(rows, key)]
    solution = _solve(rows, keys, free, latency_now)
    if solution is None and free:
        free, solution = [], _solve(rows, keys, [], latency_now)
    if solution is None:
        return ()
    counts = {key: sum(1 for terms, _ in rows if key in terms) for key in keys}
    return tuple(LinkFit(key, 1.0 / float(solution[key][0]),
                         float(solution[key][1]) if key in free else None, counts[key])
                 for key in keys if solution[key][0] > 0)


def _solve(rows: list[tuple[Terms, float]], keys: list[LinkKey], free: list[LinkKey],
           latency_now: dict[LinkKey, float]) -> dict[LinkKey, tuple[float, float]] | None:
    """Least squares for 1/W of every key and alpha of the ``free`` ones; None if negative."""
    columns = [(key, 0) for key in keys] + [(key, 1) for key in free]
    matrix = np.zeros((len(rows), len(columns)))
    target = np.zeros(len(rows))
    for r, (terms, seconds) in enumerate(rows):
        target[r] = seconds
        for c, (key, which) in enumerate(columns):
            if key in terms:
                matrix[r, c] = terms[key][which]
        for key in keys:
            if key not in free and key in terms:
                target[r] -= terms[key][1] * latency_now[key]
    values, *_ = np.linalg.lstsq(matrix, target, rcond=None)
    if any(v < 0 for v in values):
        return None
    solved = dict(zip(columns, values, strict=True))
    return {key: (solved[(key, 0)], solved.get((key, 1), latency_now[key])) for key in keys}


def _sizes_spread(rows: list[tuple[Terms, float]], key: LinkKey) -> bool:
    sizes = [terms[key][0] for terms, _ in rows if key in terms]
    return len(sizes) >= 2 and max(sizes) >= SIZE_SPREAD_FOR_LATENCY * min(sizes)


def current_link(spec: ClusterSpec, key: LinkKey) -> Link | None:
    """The link of class ``key`` in ``spec`` as it stands (None: no such pair of devices)."""
    cluster = Cluster(spec)
    for a in cluster.devices:
        for b in cluster.devices:
            if a.id != b.id and link_key(cluster, a, b) == key:
                return cluster.link(a, b)
    return None


def _current_latencies(plan: Plan, keys: list[LinkKey]) -> dict[LinkKey, float]:
    links = current_links(plan.cluster, keys)
    return {key: links[key].latency_s if key in links else 0.0 for key in keys}


def current_links(spec: ClusterSpec, keys: list[LinkKey]) -> dict[LinkKey, Link]:
    return {key: link for key in keys if (link := current_link(spec, key)) is not None}


def scaled_links(links: dict[LinkKey, Link], scale: float, source: str) -> tuple[LinkFit, ...]:
    """``links`` with transfers ``scale`` times as long (bandwidth divided, latency
    multiplied)."""
    return tuple(LinkFit(key, link.bandwidth_bytes_per_s / scale, link.latency_s * scale, 0, source)
                 for key, link in links.items())


def fit_exposed(plan: Plan, measured: Trace, apply: Callable[[tuple[LinkFit, ...]], ClusterSpec]
                ) -> tuple[LinkFit, ...]:
    """An emulated run: every rank's sync was padded to the plan's exposed all-reduce time,
    so the link classes its rings cross are scaled together until the cost model's exposed
    time is the one measured (per step the shortest sync, then the median)."""
    terms, _ = device_terms(plan)
    keys = sorted({key for found in terms.values() for key in found}, key=LinkKey.describe)
    shortest = [min(seconds.values()) for seconds in allreduce_s(measured).values()]
    links = current_links(plan.cluster, keys)
    if not links or not shortest:
        return ()

    def exposed_s(scale: float) -> float:
        calibrated = replace(plan, cluster=apply(scaled_links(links, scale, EXPOSED)))
        return predict(calibrated).breakdown.dp_s

    target_s, (low, high) = statistics.median(shortest), SCALE_RANGE
    if not exposed_s(low) < target_s < exposed_s(high):
        return ()
    return scaled_links(links, log_bisect(exposed_s, target_s, low, high), EXPOSED)
