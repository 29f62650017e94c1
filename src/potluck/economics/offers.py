"""Offers: the clusters one could rent or buy, from an offers file or from the catalog.

An offers file lists machines on offer, each a homogeneous cluster::

    offers:
      - name: 3090-pairs
        gpu: rtx3090
        gpus_per_node: 8
        nodes: 1                  # or `count`; default 1
        nvlink: pairs             # none | pairs | all; default as in cluster files
        network: 10Gb/s           # between nodes; default 10Gb/s
        price_per_hour: 0.39      # USD per GPU-hour, on-demand
        spot_price_per_hour: 0.22
        purchase_price: 1499      # USD per GPU
        power_w: 350
        source: "RunPod, 2026-03"  # where the prices come from; default: file and line
        host_memory: 256GB        # per machine; default as in cluster files

Any price left out comes from the catalog, except that an offer stating an
on-demand price without a spot price has no spot price (its catalog spot
price belongs to another seller). ``intra_bandwidth`` and
``nvlink_bandwidth`` override the link figures as in a cluster file. Errors
name the file and line.

Without an offers file, :func:`catalog_offers` builds one candidate per GPU
type of the catalog and GPU count (1, 2, 4, 8, ... up to ``max_gpus``), one
machine of up to 8 GPUs with the type's native interconnect (NVLink bridges
in pairs, NVSwitch for SXM parts) and, beyond 8 GPUs, several such machines:
``DATACENTER_NETWORK`` between machines whose GPUs share an NVSwitch or
Infinity Fabric (HGX-class servers), ``CONSUMER_NETWORK`` between others.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from potluck.cluster.catalog import DeviceType, LinkKind, catalog, closest_names, lookup, normalize_name
from potluck.cluster.spec import (
    DEFAULT_INTER_BANDWIDTH_BYTES_PER_S,
    ClusterSpec,
    NodeGroup,
    NvlinkTopology,
    default_nvlink,
    parse_nvlink_topology,
)
from potluck.errors import ConfigError
from potluck.units import non_negative_number, parse_bandwidth_bytes_per_s, parse_size_bytes
from potluck.yamlio import Fields, load_yaml, non_empty_str, parse_yaml, positive_int

MAX_GPUS_PER_NODE = 8
DATACENTER_NETWORK_BYTES_PER_S = 8 * 100e9 / 8  # one 100 Gb/s InfiniBand NIC per GPU, 8 GPUs
CONSUMER_NETWORK_BYTES_PER_S = DEFAULT_INTER_BANDWIDTH_BYTES_PER_S  # 10 Gb/s Ethernet

_OFFER_KEYS = (
    "name", "gpu", "gpus_per_node", "nodes", "count", "nvlink", "nvlink_bandwidth",
    "intra_bandwidth", "network", "price_per_hour", "spot_price_per_hour", "purchase_price",
    "power_w", "source", "host_memory",
)
_PRICE_KEYS = {
    "price_per_hour": "price_per_hour_usd",
    "spot_price_per_hour": "spot_price_per_hour_usd",
    "purchase_price": "purchase_price_usd",
    "power_w": "power_w",
}


@dataclass(frozen=True)
class Offer:
    """One cluster on offer: its description for the planner and where its prices come from."""

    name: str
    spec: ClusterSpec
    source: str  # where its prices come from

    @property
    def num_gpus(self) -> int:
        return self.spec.num_gpus

    @property
    def group(self) -> NodeGroup:
        return self.spec.nodes[0]


def load_offers(path: str | Path) -> list[Offer]:
    """Read and validate an offers file."""
    return offers_from_data(load_yaml(path, "offers file"), str(path))


def parse_offers(text: str, label: str = "offers.yaml") -> list[Offer]:
    """Validate offers given as YAML text."""
    return offers_from_data(parse_yaml(text, label), label)


def offers_from_data(data: Any, label: str) -> list[Offer]:
    top = Fields(data, label, "offers file")
    top.check_keys(("offers",))
    items = top.data.get("offers")
    if not isinstance(items, list) or not items:
        raise ConfigError(f"{label}:{top.line_of('offers')}: offers: must be a non-empty list of "
                          "offers, each with at least gpu and gpus_per_node")
    lines = getattr(items, "item_lines", [0] * len(items))
    offers = [_offer(Fields(item, label, f"offers[{i}]", lines[i])) for i, item in enumerate(items)]
    seen: dict[str, int] = {}
    for i, offer in enumerate(offers):
        if offer.name in seen:
            where = Fields(items[i], label, f"offers[{i}]", lines[i])
            raise where.error("name", f"{offer.name!r} is already the name of offers[{seen[offer.name]}]")
        seen[offer.name] = i
    return offers


def _offer(fields: Fields) -> Offer:
    fields.check_keys(_OFFER_KEYS)
    if fields.has("nodes") and fields.has("count"):
        raise fields.error("count", "give `nodes` or `count`, not both")
    device_type = _device_type(fields)
    per_node = fields.get("gpus_per_node", positive_int)
    nodes = fields.get("nodes" if fields.has("nodes") else "count", positive_int, 1)
    nvlink = fields.get("nvlink", parse_nvlink_topology, default_nvlink(device_type))
    nvlink_bandwidth = fields.optional("nvlink_bandwidth", parse_bandwidth_bytes_per_s)
    _check_nvlink(fields, device_type, nvlink, per_node, nvlink_bandwidth)
    name = fields.get("name", non_empty_str, _default_name(device_type, per_node * nodes, nvlink))
    source = fields.get("source", non_empty_str, f"{fields.label}:{fields.line}")
    group = NodeGroup(
        name=device_type.name, gpu=device_type.name, gpus_per_node=per_node, count=nodes,
        nvlink=nvlink, nvlink_bandwidth_bytes_per_s=nvlink_bandwidth,
        intra_bandwidth_bytes_per_s=fields.optional("intra_bandwidth", parse_bandwidth_bytes_per_s),
        inter_bandwidth_bytes_per_s=fields.get(
            "network", parse_bandwidth_bytes_per_s, DEFAULT_INTER_BANDWIDTH_BYTES_PER_S),
        host_memory_bytes=fields.optional("host_memory", parse_size_bytes),
    )
    priced = _priced_type(fields, device_type, source)
    if not any(fields.has(key) for key in _PRICE_KEYS):
        source = _catalog_source(device_type)
    return Offer(name, ClusterSpec(nodes=(group,), device_types=(priced,), name=name), source)


def _catalog_source(device_type: DeviceType) -> str:
    return f"catalog: {device_type.sources.get('price', 'no source given')}"


def _device_type(fields: Fields) -> DeviceType:
    name = fields.get("gpu", non_empty_str)
    known = sorted(t for t in catalog() if not catalog()[t].is_cpu)
    if normalize_name(name) not in catalog():
        close = closest_names(name, known)
        hint = f"did you mean {', '.join(close)}?" if close else f"known: {', '.join(known)}"
        raise fields.error("gpu", f"unknown GPU type {name!r}: {hint} (`potluck catalog` lists them)")
    return lookup(name)






def _check_nvlink(fields: Fields, device_type: DeviceType, nvlink: NvlinkTopology, per_node: int,
                  nvlink_bandwidth: float | None) -> None:
    if nvlink is NvlinkTopology.NONE:
        return
    if device_type.link is LinkKind.NONE and not nvlink_bandwidth:
        raise fields.error("nvlink", f"{device_type.name} has no NVLink; use `nvlink: none` "
                                     "or give nvlink_bandwidth")
    if nvlink is NvlinkTopology.PAIRS and per_node % 2:
        raise fields.error("nvlink", f"pairs needs an even gpus_per_node, not {per_node}")


def _priced_type(fields: Fields, device_type: DeviceType, source: str) -> DeviceType:
    """The device type with the offer's prices; its sources say where they come from."""
    overrides = {attr: fields.get(key, non_negative_number) for key, attr in _PRICE_KEYS.items()
                 if fields.has(key)}
    if "price_per_hour_usd" in overrides and "spot_price_per_hour_usd" not in overrides:
        overrides["spot_price_per_hour_usd"] = 0.0
    if not overrides:
        return device_type
    sources = dict(device_type.sources)
    sources.update({key: source for key in _PRICE_KEYS if fields.has(key)})
    return replace(device_type, sources=sources, **overrides)


def _default_name(device_type: DeviceType, gpus: int, nvlink: NvlinkTopology) -> str:
    """``8x rtx3090 nvlink-pairs``, ``8x h100-sxm nvlink``, ``4x rtx4090``."""
    if gpus == 1 or nvlink is NvlinkTopology.NONE:
        return f"{gpus}x {device_type.name}"
    if nvlink is NvlinkTopology.PAIRS:
        return f"{gpus}x {device_type.name} nvlink-pairs"
    link = device_type.link.value if device_type.link.joins_whole_node else "nvlink"
    return f"{gpus}x {device_type.name} {link}"


def catalog_offers(max_gpus: int = MAX_GPUS_PER_NODE, gpus: tuple[str, ...] | None = None) -> list[Offer]:
    """One offer per catalog GPU type (or those in ``gpus``) and count up to ``max_gpus``."""
    if max_gpus < 1:
        raise ConfigError(f"--max-gpus must be at least 1, not {max_gpus}")
    types = [lookup(g) for g in gpus] if gpus else [t for t in catalog().values() if not t.is_cpu]
    return [_catalog_offer(t, n) for t in types for n in gpu_counts(max_gpus)]


def gpu_counts(max_gpus: int) -> list[int]:
    """1, 2, 4, 8, ... up to ``max_gpus``, and ``max_gpus`` itself when it fits whole machines."""
    counts = [2**k for k in range(max_gpus.bit_length()) if 2**k <= max_gpus]
    if max_gpus not in counts and (max_gpus <= MAX_GPUS_PER_NODE or max_gpus % MAX_GPUS_PER_NODE == 0):
        counts.append(max_gpus)
    return counts


def _catalog_offer(device_type: DeviceType, gpus: int) -> Offer:
    per_node = min(gpus, MAX_GPUS_PER_NODE)
    if device_type.link.joins_whole_node:
        nvlink, network = NvlinkTopology.ALL, DATACENTER_NETWORK_BYTES_PER_S
    elif device_type.link is LinkKind.NVLINK_BRIDGE and per_node % 2 == 0:
        nvlink, network = NvlinkTopology.PAIRS, CONSUMER_NETWORK_BYTES_PER_S
    else:
        nvlink, network = NvlinkTopology.NONE, CONSUMER_NETWORK_BYTES_PER_S
    group = NodeGroup(name=device_type.name, gpu=device_type.name, gpus_per_node=per_node,
                      count=gpus // per_node, nvlink=nvlink, inter_bandwidth_bytes_per_s=network)
    name = _default_name(device_type, gpus, nvlink)
    return Offer(name, ClusterSpec(nodes=(group,), device_types=(device_type,), name=name),
                 _catalog_source(device_type))
