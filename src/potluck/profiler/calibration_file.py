"""Turn measurements into the ``calibration:`` section of a cluster file, and write the file.

Figures are converted to the cost model's inputs (see
:mod:`potluck.cluster.calibration`): ``matmul_efficiency`` is the measured
FLOP/s in the dtype the device trains in (FP32 on CPUs, BF16 or FP16 on GPUs)
over the type's catalog peak, and ``memory_bandwidth_factor`` the measured
bandwidth over the catalog's times the model's 80% derate, so the cost model
computes with exactly what was measured. Ranks of one type are summarized by
their median. Links inside a machine are ``pcie`` (``nvlink`` on NVSwitch
types), links between machines ``network``.

Without a cluster file, the written file describes the machines profiled (one
node group per host). With one, its text is kept and its calibration section
replaced, for the node groups of the profiled device type.
"""

from __future__ import annotations

import datetime
import re
import statistics
from pathlib import Path
from typing import Any

import torch
import yaml

from potluck.cluster.catalog import DeviceType, catalog, closest_names, lookup, normalize_name
from potluck.cluster.spec import ClusterSpec, load_cluster
from potluck.errors import ConfigError
from potluck.planner.cost import effective_dtype
from potluck.planner.formulas import MEMORY_BANDWIDTH_EFFICIENCY
from potluck.plans import DType
from potluck.profiler.run import ProfileResult
from potluck.version import __version__

_VENDOR_WORDS = ("nvidia", "geforce", "amd", "radeon", "tesla")


def device_type_name(measured_name: str) -> str:
    """The catalog name of a device torch reports (``NVIDIA GeForce RTX 3090`` -> ``rtx3090``)."""
    if measured_name == "cpu":
        return "cpu"
    words = [w for w in re.split(r"[\s_]+", measured_name.lower()) if w not in _VENDOR_WORDS]
    wanted = normalize_name("".join(words))
    known = sorted(catalog())
    if wanted in known:
        return wanted
    close = closest_names(wanted, known, n=1)
    if not close:
        raise ConfigError(f"cannot tell which catalog GPU {measured_name!r} is; "
                          "pass --device-type with its catalog name (see `potluck catalog`)")
    return close[0]


def calibration_section(result: ProfileResult, device_type: DeviceType,
                        groups: list[str]) -> dict[str, Any]:
    """The ``calibration`` mapping for ``groups`` of ``device_type``."""
    dtype = effective_dtype(device_type, DType.BF16).value
    flops = statistics.median(d.matmul_flops.get(dtype, 0.0) for d in result.devices)
    if flops <= 0:
        raise ConfigError(f"the profile measured no {dtype} matmuls; profile with --dtypes {dtype}")
    bandwidth = statistics.median(d.memory_bandwidth_bytes_per_s for d in result.devices)
    measured = {f"tflops_{name}": round(statistics.median(d.matmul_flops[name]
                                                          for d in result.devices) / 1e12, 4)
                for name in result.devices[0].matmul_flops}
    measured["memory_bandwidth"] = _bandwidth(bandwidth)
    device = {
        "matmul_efficiency": round(flops / (device_type.tflops * 1e12), 4),
        "memory_bandwidth_factor": round(
            bandwidth / (device_type.memory_bandwidth_bytes_per_s * MEMORY_BANDWIDTH_EFFICIENCY), 4),
        "measured": measured,
    }
    section: dict[str, Any] = {"source": _source(result), "devices": {device_type.name: device}}
    links = _links(result, device_type, groups)
    if links:
        section["links"] = links
    return section


def _links(result: ProfileResult, device_type: DeviceType, groups: list[str]) -> list[dict]:
    links = []
    intra_kind = "nvlink" if device_type.link.joins_whole_node else "pcie"
    for same_host, kind in ((True, intra_kind), (False, "network")):
        pairs = [p for p in result.pairs if p.same_host is same_host]
        if not pairs:
            continue
        entry: dict[str, Any] = {
            "kind": kind, "groups": list(groups),
            "bandwidth": _bandwidth(statistics.median(p.bandwidth_bytes_per_s for p in pairs)),
            "latency": _duration(statistics.median(p.latency_s for p in pairs)),
        }
        if result.allreduce is not None:
            entry["measured"] = {
                "allreduce_bus_bandwidth": _bandwidth(result.allreduce.bus_bandwidth_bytes_per_s),
                "allreduce_ranks": result.allreduce.ranks}
        links.append(entry)
    return links


def _source(result: ProfileResult) -> str:
    day = datetime.date.today().isoformat()
    return (f"potluck profile {__version__} (torch {torch.__version__.split('+')[0]}, "
            f"{len(result.devices)} ranks, {day})")


def _bandwidth(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.4g}GB/s"


def _duration(seconds: float) -> str:
    return f"{seconds * 1e6:.4g}us" if seconds < 1e-3 else f"{seconds * 1e3:.4g}ms"


def profiled_cluster_text(result: ProfileResult, type_name: str) -> str:
    """A new cluster file: one node group per host profiled, and the calibration."""
    counts: dict[str, int] = {}
    for host in result.hosts:
        counts[host] = counts.get(host, 0) + 1
    names = {host: _group_name(host, i) for i, host in enumerate(counts)}
    nodes = [{"name": names[h], "gpu": type_name, "gpus_per_node": n} for h, n in counts.items()]
    calibration = calibration_section(result, lookup(type_name), list(names.values()))
    header = ("# Written by `potluck profile`: the machines it ran on, one node group per host,\n"
              "# with what it measured in `calibration` (the planner reads both).\n")
    return header + yaml.safe_dump({"name": "profiled", "nodes": nodes,
                                    "calibration": calibration}, sort_keys=False)


def _group_name(host: str, index: int) -> str:
    name = re.sub(r"[^a-z0-9-]+", "-", host.lower()).strip("-")
    return name or f"host{index}"


def calibrated_text(original: str, spec: ClusterSpec, result: ProfileResult,
                    type_name: str) -> str:
    """``original`` cluster file text with its calibration section replaced."""
    if type_name not in {t.name for t in spec.device_types}:
        known = ", ".join(t.name for t in spec.device_types)
        raise ConfigError(f"the cluster file has no {type_name} node groups ({known}); profile on "
                          "its machines, or pass --device-type")
    uncalibrated = next(t for t in spec.device_types if t.name == type_name)
    groups = [g.name for g in spec.nodes if g.gpu == type_name]
    section = calibration_section(result, _catalog_figures(uncalibrated, spec), groups)
    kept = _without_calibration(original).rstrip("\n")
    return kept + "\n" + yaml.safe_dump({"calibration": section}, sort_keys=False)


def _catalog_figures(device_type: DeviceType, spec: ClusterSpec) -> DeviceType:
    """The type before an earlier calibration scaled it (factors are relative to the file's figures)."""
    if spec.calibration is None:
        return device_type
    for entry in spec.calibration.devices:
        if entry.device == device_type.name and entry.memory_bandwidth_factor:
            from dataclasses import replace

            return replace(device_type, memory_bandwidth_bytes_per_s=(
                device_type.memory_bandwidth_bytes_per_s / entry.memory_bandwidth_factor))
    return device_type


def _without_calibration(text: str) -> str:
    """Drop a top-level ``calibration:`` block (up to the next top-level key)."""
    kept, skipping = [], False
    for line in text.splitlines(keepends=True):
        if re.match(r"^calibration\s*:", line):
            skipping = True
            continue
        if skipping and line.strip() and not line[0].isspace() and not line.lstrip().startswith("#"):
            skipping = False
        if not skipping:
            kept.append(line)
    return "".join(kept)


def write_calibrated(out: str | Path, result: ProfileResult, type_name: str,
                     cluster: str | Path | None = None) -> ClusterSpec:
    """Write the calibrated cluster file and read it back as the planner will."""
    if cluster is None:
        text = profiled_cluster_text(result, type_name)
    else:
        text = calibrated_text(Path(cluster).read_text(), load_cluster(cluster), result, type_name)
    Path(out).write_text(text)
    return load_cluster(out)
