"""Where to split a cluster into islands: machines whose links to each other are much faster
than their links to the rest.

A cluster's machines and the bandwidth between each pair (:func:`machine_links`) give the
candidate splits (:func:`candidate_splits`):

- **at a gap**: for each bandwidth level, the machines joined by links at least that fast
  form the islands; the split is kept when every link inside an island is at least
  :data:`GAP_FACTOR` times faster than every link between islands (two labs joined at 1 Gb/s
  over 100 Gb/s inside become two islands);
- **evenly, on a slow network**: where every link between machines is slower than
  :data:`SLOW_LINK_BYTES_PER_S` and no gap splits them (eight desktops on one 1 Gb/s
  switch), the machines in order split into 2, 4, 8, ... islands of equal size.

- **by vendor**: on a cluster of several vendors (NVIDIA, AMD, CPUs; no backend joins two),
  every split keeps each island one vendor's, and the split by vendor is always a candidate;
  the islands then meet through host memory (``Island.transport`` host).

Splits into more than :data:`MAX_ISLANDS` islands are not tried: the convergence model's
sources stop there (:mod:`potluck.planner.islands.convergence`), and each island is one more
search. A cluster with neither (:func:`has_slow_links` false) is planned without islands, so
the island search costs nothing there.
"""

from __future__ import annotations

from dataclasses import dataclass

from potluck.cluster.topology import Cluster, Device, spans_vendors

GAP_FACTOR = 4.0
"""Links inside an island at least this many times faster than those between islands (an
assumption: a gap of 4x or more is what makes rare synchronization pay where per-step sync
over the fast links still does)."""
SLOW_LINK_BYTES_PER_S = 10e9 / 8
"""Links between machines below 10 Gb/s (consumer Ethernet, the internet) are slow enough
to split even without a gap (an assumption: a 7B model's 14 GB bf16 gradient takes over 10 s
per step at 10 Gb/s)."""

MAX_ISLANDS = 8
"""The most islands a split may have (the convergence model's sources: up to 8 replicas)."""


@dataclass(frozen=True)
class Split:
    """Machines (``<group>.<index>``) per island, and the links that justify the split."""

    islands: tuple[tuple[str, ...], ...]
    inside_bytes_per_s: float  # the slowest link inside an island (inf: single machines)
    between_bytes_per_s: float  # the fastest link between two islands

    @property
    def count(self) -> int:
        return len(self.islands)


def machines(cluster: Cluster) -> dict[str, Device]:
    """Each machine of ``cluster`` by id, with its first device, in cluster order."""
    firsts: dict[str, Device] = {}
    for d in cluster.devices:
        firsts.setdefault(d.node, d)
    return firsts


def machine_links(cluster: Cluster) -> dict[tuple[str, str], float]:
    """The bandwidth between every pair of machines (both orders)."""
    firsts = machines(cluster)
    return {(a, b): cluster.link(da, db).bandwidth_bytes_per_s
            for a, da in firsts.items() for b, db in firsts.items() if a != b}


def _components(nodes: list[str], links: dict[tuple[str, str], float], threshold: float
                ) -> tuple[tuple[str, ...], ...]:
    """Machines joined by links of at least ``threshold``, in cluster order."""
    island_of = {node: i for i, node in enumerate(nodes)}
    for (a, b), bandwidth in links.items():
        if bandwidth >= threshold and island_of[a] != island_of[b]:
            old, new = island_of[b], island_of[a]
            island_of = {n: new if i == old else i for n, i in island_of.items()}
    order = list(dict.fromkeys(island_of[n] for n in nodes))
    return tuple(tuple(n for n in nodes if island_of[n] == i) for i in order)


def measured(islands: tuple[tuple[str, ...], ...], links: dict[tuple[str, str], float]) -> Split:
    """``islands`` with the slowest link inside and the fastest between."""
    island_of = {n: i for i, members in enumerate(islands) for n in members}
    inside = [bw for (a, b), bw in links.items() if island_of[a] == island_of[b]]
    between = [bw for (a, b), bw in links.items() if island_of[a] != island_of[b]]
    return Split(islands, min(inside, default=float("inf")), max(between, default=0.0))


def gap_splits(cluster: Cluster) -> list[Split]:
    """The splits at a gap of :data:`GAP_FACTOR` or more (see the module docstring)."""
    links = machine_links(cluster)
    nodes = list(machines(cluster))
    found: dict[tuple, Split] = {}
    for threshold in sorted(set(links.values())):
        split = measured(_components(nodes, links, threshold), links)
        if 1 < split.count <= MAX_ISLANDS \
                and split.inside_bytes_per_s >= GAP_FACTOR * split.between_bytes_per_s:
            found.setdefault(split.islands, split)
    return list(found.values())


def even_splits(cluster: Cluster) -> list[Split]:
    """The machines in order split into 2, 4, 8, ... equal islands."""
    links = machine_links(cluster)
    nodes = list(machines(cluster))
    splits, count = [], 2
    while count <= min(len(nodes), MAX_ISLANDS):
        if len(nodes) % count == 0:
            size = len(nodes) // count
            splits.append(measured(tuple(tuple(nodes[i:i + size])
                                         for i in range(0, len(nodes), size)), links))
        count *= 2
    return splits


def slow_network(cluster: Cluster) -> bool:
    """Whether every link between machines is slower than :data:`SLOW_LINK_BYTES_PER_S`."""
    links = machine_links(cluster)
    return bool(links) and max(links.values()) < SLOW_LINK_BYTES_PER_S


def machine_vendors(cluster: Cluster) -> dict[str, str]:
    """Each machine's vendor (its first device's: nvidia, amd, cpu), in cluster order."""
    return {node: device.type.vendor.value for node, device in machines(cluster).items()}


def mixes_vendors(cluster: Cluster) -> bool:
    """Whether the cluster's machines are of several vendors (no backend joins them)."""
    return spans_vendors(machines(cluster).values())


def vendor_split(cluster: Cluster) -> Split:
    """One island per vendor, its machines in cluster order."""
    vendors = machine_vendors(cluster)
    islands = tuple(tuple(n for n in vendors if vendors[n] == v)
                    for v in dict.fromkeys(vendors.values()))
    return measured(islands, machine_links(cluster))


def _one_vendor_each(split: Split, vendors: dict[str, str]) -> bool:
    return all(len({vendors[n] for n in island}) == 1 for island in split.islands)


def candidate_splits(cluster: Cluster, *, forced: bool = False) -> list[Split]:
    """The splits worth searching: at a gap, else even ones on a slow network (``forced``:
    even ones on any network of two machines or more, for a pinned ``--sync``). On a cluster
    of several vendors, only splits whose islands are one vendor's each, the split by vendor
    always among them (its islands then meet through host memory,
    :func:`~potluck.plans.vendors.vendors_problem`)."""
    if mixes_vendors(cluster):
        vendors = machine_vendors(cluster)
        found = [s for s in gap_splits(cluster) + even_splits(cluster)
                 if _one_vendor_each(s, vendors)]
        by_vendor = vendor_split(cluster)
        return [*found, by_vendor] if by_vendor.islands not in {s.islands for s in found} \
            else found
    gaps = gap_splits(cluster)
    if gaps:
        return gaps
    return even_splits(cluster) if forced or slow_network(cluster) else []


def has_slow_links(cluster: Cluster) -> bool:
    """Whether the cluster has links slow enough to consider islands."""
    return bool(candidate_splits(cluster))
