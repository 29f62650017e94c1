"""Write a fitted calibration into a cluster file the planner reads.

With ``--cluster FILE``: that file's text with its ``calibration:`` section
replaced (the rest kept as written). Without: a new file describing the run's
cluster as the plan recorded it (node groups, device types that differ from
the catalog, declared links), then the calibration. The section is written by
:mod:`potluck.cluster.calibration_file` (as ``potluck profile``'s is), whose
five-significant-digit spelling the description uses too; the file is read
back as ``potluck plan`` would.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from pathlib import Path
from typing import Any

import yaml

from potluck.calibrate.fit import Fit, calibration, uncalibrated_bandwidth
from potluck.cluster.calibration_file import (
    bandwidth_text,
    duration_text,
    number,
    write_calibrated_cluster,
)
from potluck.cluster.catalog import DeviceType, catalog
from potluck.cluster.nodes import NodeGroup
from potluck.cluster.spec import ClusterSpec, default_nvlink, load_cluster
from potluck.yamlio import read_text


def _size_text(num_bytes: float) -> str:
    return f"{num_bytes / 1e9:.5g}GB"


def _enum_text(value: Enum) -> str:
    return value.value


def _as_is(value: Any) -> Any:
    return value


_NODE_FIELDS = (  # NodeGroup attribute, cluster-file key, how it is written
    ("nvlink_bandwidth_bytes_per_s", "nvlink_bandwidth", bandwidth_text),
    ("intra_bandwidth_bytes_per_s", "intra_bandwidth", bandwidth_text),
    ("inter_bandwidth_bytes_per_s", "inter_bandwidth", bandwidth_text),
    ("intra_latency_s", "intra_latency", duration_text),
    ("inter_latency_s", "inter_latency", duration_text),
)
_DEVICE_FIELDS = (  # DeviceType attribute, cluster-file key, how it is written
    ("tflops", "tflops", number), ("memory_bytes", "memory", _size_text),
    ("memory_bandwidth_bytes_per_s", "memory_bandwidth", bandwidth_text), ("bf16", "bf16", _as_is),
    ("link", "link", _enum_text),
    ("link_bandwidth_bytes_per_s", "link_bandwidth", bandwidth_text),
    ("pcie_bandwidth_bytes_per_s", "pcie_bandwidth", bandwidth_text),
    ("matmul_efficiency", "matmul_efficiency", number), ("sm_count", "sm_count", _as_is),
)


def _differs(value: Any, known: Any) -> bool:
    if isinstance(value, float):
        return abs(value - known) > 1e-9 * max(1.0, abs(value))
    return value != known


def _node(group: NodeGroup, device_type: DeviceType) -> dict[str, Any]:
    node: dict[str, Any] = {"name": group.name, "gpu": group.gpu,
                            "gpus_per_node": group.gpus_per_node, "count": group.count}
    if group.nvlink is not default_nvlink(device_type):
        node["nvlink"] = group.nvlink.value
    for attr, key, how in _NODE_FIELDS:
        value = getattr(group, attr)
        if value is not None and value != getattr(NodeGroup, attr, None):
            node[key] = how(value)
    return node


def _device(spec: ClusterSpec, device_type: DeviceType) -> dict[str, Any]:
    """The fields of a device type that differ from its catalog entry (all, if none)."""
    known = catalog().get(device_type.name)
    uncalibrated = {"memory_bandwidth_bytes_per_s": uncalibrated_bandwidth(spec, device_type.name)}
    fields = {}
    for attr, key, how in _DEVICE_FIELDS:
        value = uncalibrated.get(attr, getattr(device_type, attr))
        if known is None or _differs(value, getattr(known, attr)):
            fields[key] = how(value)
    return fields


def cluster_text(spec: ClusterSpec) -> str:
    """A cluster file describing ``spec`` (without its calibration)."""
    types = {t.name: t for t in spec.device_types}
    data: dict[str, Any] = {"name": spec.name,
                            "nodes": [_node(g, types[g.gpu]) for g in spec.nodes]}
    devices = {name: fields for name, t in types.items() if (fields := _device(spec, t))}
    if devices:
        data["devices"] = devices
    if spec.links:
        data["links"] = [{"between": list(link.between),
                          "bandwidth": bandwidth_text(link.bandwidth_bytes_per_s),
                          "latency": duration_text(link.latency_s)} for link in spec.links]
    header = ("# Written by `potluck calibrate`: the run's cluster as its plan recorded it, and\n"
              "# the inputs fitted to the run in `calibration` (the planner reads both).\n")
    return header + yaml.safe_dump(data, sort_keys=False)


def write_calibrated(out: str | Path, fit: Fit, plan_cluster: ClusterSpec,
                     cluster_file: str | Path | None = None,
                     execution: Mapping[str, float] | None = None) -> ClusterSpec:
    """Write ``fit`` (and the fitted ``execution`` fields) into ``cluster_file``'s text (or
    a description of ``plan_cluster``) at ``out``; return the file's cluster read back."""
    if cluster_file is not None:
        base, text = load_cluster(cluster_file), read_text(Path(cluster_file), "cluster file")
    else:
        base, text = plan_cluster, cluster_text(plan_cluster)
    return write_calibrated_cluster(out, text, calibration(fit, base), execution)
