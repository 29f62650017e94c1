"""Measured figures for a cluster: the ``calibration:`` section of a cluster file, read and applied.

``potluck profile`` (from microbenchmarks) and ``potluck calibrate`` (from a
traced training run) build a :class:`Calibration` and write it with
:mod:`potluck.cluster.calibration_file`; the planner reads it here with the
rest of the file. Calibration changes the cost model's *inputs* only, never
its formulas::

    calibration:
      source: potluck profile 0.1.0 (torch 2.13, 2026-11-29)
      devices:
        rtx3090:
          matmul_efficiency: 0.71        # GEMM FLOP/s at the model's shapes / catalog peak
          memory_bandwidth_factor: 1.02  # measured bandwidth / (catalog x 0.8, the model's derate)
          measured: {tflops_bf16: 50.4, memory_bandwidth: 763GB/s}   # for people; not read
      links:
        - kind: pcie                     # pcie | nvlink | network, inside these node groups
          groups: [box3090]              # (all groups when left out)
          bandwidth: 11.2GB/s
          latency: 12us
        - between: [box3090, a100]       # the network between two node groups
          bandwidth: 0.94Gb/s
          latency: 18ms

A device entry replaces the type's ``matmul_efficiency`` (its GEMM ceiling, on top of which
:mod:`potluck.planner.gemm` still prices each GEMM by its shape) and multiplies its
``memory_bandwidth`` (the factor is relative to the file's own figures:
:func:`uncalibrated_device` undoes it). ``measured`` figures are written for
people and never read back. A link entry replaces a node group's figures:
``network`` its ``inter_bandwidth``/``inter_latency``, ``pcie`` its
``intra_bandwidth``, ``nvlink`` its ``nvlink_bandwidth`` (both on NVSwitch
nodes, where every pair is NVLink), and either kind its ``intra_latency``; a
``between`` entry becomes a declared link between the two groups (replacing
one the file declares). Calibrated figures win over the ones written by hand.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Annotated, Any

from pydantic import Field, NonNegativeFloat, PositiveFloat, WithJsonSchema
from pydantic.json_schema import SkipJsonSchema

from potluck.cluster.catalog import DeviceType, Efficiency
from potluck.cluster.nodes import (
    DEFAULT_INTER_LATENCY_S,
    LinkSpec,
    NodeGroup,
    NvlinkTopology,
    PathKind,
)
from potluck.errors import ConfigError
from potluck.units import parse_bandwidth_bytes_per_s, parse_duration_s, positive_number
from potluck.yamlio import Fields, LineList

LINK_KINDS = (PathKind.PCIE, PathKind.NVLINK, PathKind.NETWORK)  # what an entry can name
_DEVICE_KEYS = ("matmul_efficiency", "memory_bandwidth_factor", "measured")
_LINK_KEYS = ("kind", "groups", "between", "bandwidth", "latency", "measured")


@dataclass(frozen=True)
class MeasuredDevice:
    """What the profiler measured on a device type, for people (the planner does not read it)."""

    matmul_flops_per_s: tuple[tuple[str, float], ...]  # (dtype name, FLOP/s), in the order measured
    memory_bandwidth_bytes_per_s: float


@dataclass(frozen=True)
class MeasuredLink:
    """The all-reduce the profiler ran over a link kind's ranks, for people (not read)."""

    allreduce_bus_bandwidth_bytes_per_s: float
    allreduce_ranks: int


# Plans carry their cluster, calibration included, so these classes are part of the plan
# file's schema (docs/plan.schema.json): the informational ``measured`` figures are written to
# cluster files only (never to plans, never read back), and a link's kind is a string there.
NOT_IN_PLANS = Field(exclude=True)
KIND_IN_PLANS = WithJsonSchema({"title": "Kind", "type": "string"})


# The cost-model inputs of one device type, as measured.
@dataclass(frozen=True)
class DeviceCalibration:
    device: str  # a device type name of the cluster
    matmul_efficiency: Efficiency | None = None
    memory_bandwidth_factor: PositiveFloat | None = None
    measured: Annotated[SkipJsonSchema[MeasuredDevice | None], NOT_IN_PLANS] = None  # not read back


@dataclass(frozen=True)
class LinkCalibration:
    """Measured figures of one kind of link inside node groups, or between two groups."""

    bandwidth_bytes_per_s: PositiveFloat
    latency_s: NonNegativeFloat | None = None
    kind: Annotated[PathKind, KIND_IN_PLANS] = PathKind.NETWORK
    groups: tuple[str, ...] = ()  # empty: every group
    between: tuple[str, str] | None = None
    measured: Annotated[SkipJsonSchema[MeasuredLink | None], NOT_IN_PLANS] = None  # not read back


# A cluster file's ``calibration:`` section: what was measured, and by what (``source``).
@dataclass(frozen=True)
class Calibration:

    devices: tuple[DeviceCalibration, ...] = ()
    links: tuple[LinkCalibration, ...] = ()
    source: str = ""


def parse_calibration(top: Fields, device_names: set[str], group_names: set[str]) -> Calibration:
    """Read the ``calibration`` section of a cluster file (errors name the line)."""
    section = Fields(top.data["calibration"], top.label, "calibration", top.line_of("calibration"))
    section.check_keys(("source", "devices", "links"))
    devices = []
    if section.has("devices"):
        table = Fields(section.data["devices"], top.label, "calibration.devices",
                       section.line_of("devices"))
        for name in table.data:
            if str(name) not in device_names:
                raise table.error(str(name), f"the cluster has no device type {name!r} "
                                             f"(it has {', '.join(sorted(device_names))})")
            entry = Fields(table.data[name], top.label, f"calibration.devices.{name}",
                           table.line_of(name))
            entry.check_keys(_DEVICE_KEYS)
            devices.append(DeviceCalibration(
                # measured against the catalog's nominal peak: a CPU's can be several times it
                str(name), entry.optional("matmul_efficiency", positive_number),
                entry.optional("memory_bandwidth_factor", positive_number)))
    links = []
    if section.has("links"):
        raw = section.data["links"]
        if not isinstance(raw, list):
            raise section.error("links", "must be a list of link entries")
        for i, item in enumerate(raw):
            line = raw.item_lines[i] if isinstance(raw, LineList) else 0
            links.append(_link(Fields(item, top.label, f"calibration.links[{i}]", line), group_names))
    return Calibration(tuple(devices), tuple(links), str(section.data.get("source", "")))


def _link(entry: Fields, group_names: set[str]) -> LinkCalibration:
    entry.check_keys(_LINK_KEYS)
    between = entry.optional("between", _names)
    groups = entry.optional("groups", _names) or ()
    for name in (*groups, *(between or ())):
        if name not in group_names:
            raise entry.error("between" if between else "groups",
                              f"no node group named {name!r} (groups: {', '.join(sorted(group_names))})")
    if between is not None and len(between) != 2:
        raise entry.error("between", "must name two node groups")
    kind = entry.get("kind", _kind, PathKind.NETWORK)
    if between is not None and kind is not PathKind.NETWORK:
        raise entry.error("kind", "a link between two node groups is the network")
    return LinkCalibration(
        bandwidth_bytes_per_s=entry.get("bandwidth", parse_bandwidth_bytes_per_s),
        latency_s=entry.optional("latency", parse_duration_s),
        kind=kind, groups=tuple(groups),
        between=(between[0], between[1]) if between else None,
    )


def _names(value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, list):
        raise ConfigError(f"must be a list of node group names, not {value!r}")
    return tuple(str(v) for v in value)


def _kind(value: Any) -> PathKind:
    if value not in LINK_KINDS:
        raise ConfigError(f"must be one of {', '.join(k.value for k in LINK_KINDS)}, not {value!r}")
    return PathKind(value)


def calibrate_device(device_type: DeviceType, calibration: Calibration) -> DeviceType:
    """``device_type`` with its measured matmul efficiency and memory bandwidth."""
    for entry in calibration.devices:
        if entry.device != device_type.name:
            continue
        sources = dict(device_type.sources)
        changes: dict[str, Any] = {}
        if entry.matmul_efficiency is not None:
            changes["matmul_efficiency"] = entry.matmul_efficiency
            sources["matmul_efficiency"] = calibration.source or "calibration"
        if entry.memory_bandwidth_factor is not None:
            changes["memory_bandwidth_bytes_per_s"] = (
                device_type.memory_bandwidth_bytes_per_s * entry.memory_bandwidth_factor)
            sources["memory_bandwidth"] = calibration.source or "calibration"
        device_type = replace(device_type, sources=sources, **changes)
    return device_type


def uncalibrated_device(device_type: DeviceType, calibration: Calibration | None) -> DeviceType:
    """``device_type`` with the memory bandwidth it had before ``calibration`` scaled it (a
    new calibration's factor is relative to the file's own figures, not to an older one's)."""
    bandwidth = device_type.memory_bandwidth_bytes_per_s
    for entry in calibration.devices if calibration is not None else ():
        if entry.device == device_type.name and entry.memory_bandwidth_factor:
            bandwidth /= entry.memory_bandwidth_factor
    return replace(device_type, memory_bandwidth_bytes_per_s=bandwidth)


def calibrate_group(group: NodeGroup, calibration: Calibration) -> NodeGroup:
    """``group`` with its measured link figures."""
    for link in calibration.links:
        if link.between is not None or (link.groups and group.name not in link.groups):
            continue
        group = replace(group, **_group_fields(group, link))
    return group


def _group_fields(group: NodeGroup, link: LinkCalibration) -> dict[str, Any]:
    if link.kind is PathKind.NETWORK:
        fields = {"inter_bandwidth_bytes_per_s": link.bandwidth_bytes_per_s}
        if link.latency_s is not None:
            fields["inter_latency_s"] = link.latency_s
        return fields
    if link.kind is PathKind.NVLINK:
        fields = {"nvlink_bandwidth_bytes_per_s": link.bandwidth_bytes_per_s}
        if group.nvlink is NvlinkTopology.ALL:
            fields["intra_bandwidth_bytes_per_s"] = link.bandwidth_bytes_per_s
    elif group.nvlink is NvlinkTopology.ALL:
        fields = {}  # every pair of an NVSwitch node is NVLink: no PCIe path to calibrate
    else:
        fields = {"intra_bandwidth_bytes_per_s": link.bandwidth_bytes_per_s}
    if link.latency_s is not None:
        fields["intra_latency_s"] = link.latency_s
    return fields


def calibrated_links(links: tuple[LinkSpec, ...], calibration: Calibration) -> tuple[LinkSpec, ...]:
    """Declared links with the measured ones between node groups in their place."""
    result = list(links)
    for link in calibration.links:
        if link.between is None:
            continue
        result = [spec for spec in result if set(spec.between) != set(link.between)]
        result.append(LinkSpec(link.between, link.bandwidth_bytes_per_s,
                               link.latency_s if link.latency_s is not None
                               else DEFAULT_INTER_LATENCY_S))
    return tuple(result)
