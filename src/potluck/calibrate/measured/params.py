"""The cost-model inputs a measured-runs fit may change, and how a set of values applies.

* ``matmul_efficiency`` of each device type (fraction of the catalog peak a GEMM reaches);
* a bandwidth factor per link class: the network between machines (every node group's
  ``inter_bandwidth`` and every declared link), PCIe inside a machine, NVLink inside a
  machine, each multiplying the cluster file's figure, never above the link's rated
  figure (the file's own, before any ``calibration:`` section);
* the framework's host time per micro-batch per stage and per iteration
  (``Execution.micro_batch_overhead_s``, ``Execution.step_overhead_s``), at least 0 and
  at most what the runs leave room for: a stage runs its micro-batches one after another,
  so no run's iteration is shorter than its micro-batches times the overhead of each, nor
  shorter than the overhead per iteration;
* the host's time to issue one transformer block's forward (``Execution.block_host_s``), a
  floor under the block's GPU time (:mod:`potluck.planner.compute`): a *floor* parameter,
  which the runs depend on only where it binds.

Values are applied the way a ``calibration:`` section is (:mod:`potluck.cluster.calibration`),
so what is fitted is exactly what the written file makes the planner see.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

from potluck.cluster.calibration import (
    Calibration,
    DeviceCalibration,
    LinkCalibration,
    calibrate_device,
    calibrate_group,
    calibrated_links,
)
from potluck.cluster.nodes import NodeGroup, NvlinkTopology, PathKind
from potluck.cluster.spec import ClusterSpec, cluster_from_data
from potluck.plans import Execution

EFFICIENCY_BOUNDS = (0.05, 1.0)  # a GEMM reaches between 5% and 100% of the peak
LINK_FACTOR_LOWER = 0.01  # measured bandwidth / the cluster file's figure; at most its rated one
# one block's forward issued in 1 us (a CUDA graph) to 100 ms (a Python loop per kernel);
# AMP's Megatron v1.1.5 profile shows 3.9-5.8 ms per layer (benchmarks/data/README.md)
BLOCK_HOST_BOUNDS_S = (1e-6, 0.1)


class Kind(str, Enum):
    EFFICIENCY = "matmul_efficiency"
    LINK = "bandwidth_factor"
    MICRO_BATCH_OVERHEAD = "micro_batch_overhead_s"
    STEP_OVERHEAD = "step_overhead_s"
    BLOCK_HOST = "block_host_s"


EXECUTION_KINDS = (Kind.MICRO_BATCH_OVERHEAD, Kind.STEP_OVERHEAD, Kind.BLOCK_HOST)  # Execution fields


@dataclass(frozen=True)
class RunTime:
    """What bounds the host times: a run's measured seconds and its micro-batches per
    pipeline (the most of any pipeline)."""

    measured_s: float
    micro_batches: int


@dataclass(frozen=True)
class Parameter:
    """One input the fit may change, with its starting value and bounds (natural units)."""

    kind: Kind
    target: str  # device type name, or link kind (network, pcie, nvlink); "" for overheads
    start: float
    lower: float
    upper: float

    @property
    def name(self) -> str:
        if self.kind is Kind.EFFICIENCY:
            return f"{self.target} matmul_efficiency"
        if self.kind is Kind.LINK:
            return f"{self.target} bandwidth factor"
        return self.kind.value

    @property
    def is_log(self) -> bool:
        """Fitted in log space (a relative change), else in seconds."""
        return self.kind in (Kind.EFFICIENCY, Kind.LINK, Kind.BLOCK_HOST)

    @property
    def in_seconds(self) -> bool:
        """A duration (an :class:`~potluck.plans.Execution` field), else a ratio."""
        return self.kind in EXECUTION_KINDS

    @property
    def is_physical(self) -> bool:
        """Bounded by the hardware (a peak, a link's rate), not only by the runs' times."""
        return self.kind in (Kind.EFFICIENCY, Kind.LINK)

    @property
    def is_floor(self) -> bool:
        """A floor under other times: no derivative until it binds, so the fit probes its
        range instead of following its derivative from the start."""
        return self.kind is Kind.BLOCK_HOST


Values = dict[Parameter, float]


def candidates(spec: ClusterSpec, execution: Execution, runs: Sequence[RunTime],
               rated: ClusterSpec | None = None) -> list[Parameter]:
    """Every input of ``spec`` a fit could change, bounded as the module says (``rated``:
    the cluster file without its ``calibration:`` section, whose link figures are the
    ceilings; ``spec`` itself when ``None``)."""
    low, high = EFFICIENCY_BOUNDS
    found = [Parameter(Kind.EFFICIENCY, t.name, min(max(t.matmul_efficiency, low), high), low, high)
             for t in spec.device_types]
    found += [Parameter(Kind.LINK, kind.value, 1.0, LINK_FACTOR_LOWER,
                        link_ceiling(spec, rated or spec, kind)) for kind in _link_kinds(spec)]
    per_micro_batch_s = min(run.measured_s / run.micro_batches for run in runs)
    found.append(Parameter(Kind.MICRO_BATCH_OVERHEAD, "", execution.micro_batch_overhead_s,
                           0.0, max(per_micro_batch_s, execution.micro_batch_overhead_s)))
    shortest_s = min(run.measured_s for run in runs)
    found.append(Parameter(Kind.STEP_OVERHEAD, "", execution.step_overhead_s, 0.0,
                           max(shortest_s, execution.step_overhead_s)))
    low_s, high_s = BLOCK_HOST_BOUNDS_S
    found.append(Parameter(Kind.BLOCK_HOST, "", min(max(execution.block_host_s, low_s), high_s),
                           low_s, high_s))
    return found


def link_ceiling(spec: ClusterSpec, rated: ClusterSpec, kind: PathKind) -> float:
    """The largest factor on ``spec``'s ``kind`` links that leaves every one at or below its
    rated figure in ``rated`` (1 for a file without calibration; never below 1, so that the
    file's own figures stay within bounds)."""
    ratios = []
    for group, rated_group in zip(spec.nodes, rated.nodes, strict=True):
        now, most = _bandwidth(spec, group, kind), _bandwidth(rated, rated_group, kind)
        if now and most:
            ratios.append(most / now)
    if kind is PathKind.NETWORK:
        declared = {frozenset(link.between): link.bandwidth_bytes_per_s for link in rated.links}
        ratios += [declared[frozenset(link.between)] / link.bandwidth_bytes_per_s
                   for link in spec.links if frozenset(link.between) in declared]
    return max(1.0, min(ratios, default=1.0))


def rated_cluster(data: Any, label: str) -> ClusterSpec:
    """The cluster of a file's parsed YAML ``data`` without its ``calibration:`` section:
    the figures the file rates its links at."""
    return cluster_from_data({k: v for k, v in data.items() if k != "calibration"}, label)


def _link_kinds(spec: ClusterSpec) -> list[PathKind]:
    inside = [g for g in spec.nodes if g.gpus_per_node > 1]
    kinds = []
    if len(spec.nodes) > 1 or any(g.count > 1 for g in spec.nodes):
        kinds.append(PathKind.NETWORK)
    if any(g.nvlink is not NvlinkTopology.ALL for g in inside):
        kinds.append(PathKind.PCIE)
    if any(g.nvlink is not NvlinkTopology.NONE for g in inside):
        kinds.append(PathKind.NVLINK)
    return kinds


def to_internal(param: Parameter, value: float, scale_s: float) -> float:
    """The solver's coordinate: log of a ratio, or seconds / ``scale_s``."""
    return math.log(value) if param.is_log else value / scale_s


def from_internal(param: Parameter, x: float, scale_s: float) -> float:
    return math.exp(x) if param.is_log else x * scale_s


def fitted_calibration(spec: ClusterSpec, values: Values, source: str = "") -> Calibration:
    """The device and link entries ``values`` set, in absolute figures of ``spec``."""
    devices = tuple(DeviceCalibration(p.target, matmul_efficiency=v)
                    for p, v in values.items() if p.kind is Kind.EFFICIENCY)
    links: list[LinkCalibration] = []
    for p, factor in values.items():
        if p.kind is Kind.LINK:
            links.extend(link_entries(spec, PathKind(p.target), factor))
    return Calibration(devices, tuple(links), source)


def link_entries(spec: ClusterSpec, kind: PathKind, factor: float) -> list[LinkCalibration]:
    """Link entries scaling ``spec``'s ``kind`` links by ``factor`` (one per node group, and
    one per declared link for the network)."""
    entries = []
    for group in spec.nodes:
        bandwidth = _bandwidth(spec, group, kind)
        if bandwidth is not None:
            entries.append(LinkCalibration(bandwidth * factor, kind=kind, groups=(group.name,)))
    if kind is PathKind.NETWORK:
        entries += [LinkCalibration(link.bandwidth_bytes_per_s * factor, link.latency_s,
                                    between=link.between) for link in spec.links]
    return entries


def _bandwidth(spec: ClusterSpec, group: NodeGroup, kind: PathKind) -> float | None:
    """The bandwidth ``spec`` gives ``group``'s ``kind`` links (as the topology reads it)."""
    device = spec.device_type(group.gpu)
    if kind is PathKind.NETWORK:
        return group.inter_bandwidth_bytes_per_s
    if kind is PathKind.NVLINK and group.nvlink is not NvlinkTopology.NONE:
        if group.nvlink is NvlinkTopology.ALL and group.intra_bandwidth_bytes_per_s:
            return group.intra_bandwidth_bytes_per_s
        return group.nvlink_bandwidth_bytes_per_s or device.link_bandwidth_bytes_per_s
    if kind is PathKind.PCIE and group.nvlink is not NvlinkTopology.ALL:
        return group.intra_bandwidth_bytes_per_s or device.pcie_bandwidth_bytes_per_s
    return None


def applied_cluster(spec: ClusterSpec, values: Values) -> ClusterSpec:
    """``spec`` with the device and link ``values`` applied (in memory)."""
    found = fitted_calibration(spec, values)
    if not found.devices and not found.links:
        return spec
    return replace(
        spec,
        nodes=tuple(calibrate_group(group, found) for group in spec.nodes),
        device_types=tuple(calibrate_device(t, found) for t in spec.device_types),
        links=calibrated_links(spec.links, found),
    )


def applied_execution(execution: Execution, values: Values) -> Execution:
    """``execution`` with the host-time ``values`` applied."""
    changes = {p.kind.value: v for p, v in values.items() if p.kind in EXECUTION_KINDS}
    return replace(execution, **changes) if changes else execution
