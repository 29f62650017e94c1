"""Turn measurements into a cluster file's calibration, and write the file.

Figures are converted to the cost model's inputs (see
:mod:`potluck.cluster.calibration`): ``matmul_efficiency`` is the measured
FLOP/s in the dtype the device trains in (FP32 on CPUs, BF16 or FP16 on GPUs)
over the type's catalog peak, and ``memory_bandwidth_factor`` the measured
bandwidth over the catalog's times the model's 80% derate, so the cost model
computes with exactly what was measured. Ranks of one type are summarized by
their median. Links inside a machine are ``pcie`` (``nvlink`` on NVSwitch
types), links between machines ``network``. The section is written by
:mod:`potluck.cluster.calibration_file`, as ``potluck calibrate``'s is.

Without a cluster file, the written file describes the machines profiled (one
node group per host). With one, its text is kept and its calibration section
replaced, for the node groups of the profiled device type.
"""

from __future__ import annotations

import datetime
import re
import statistics
from pathlib import Path

import torch
import yaml

from potluck.cluster.calibration import (
    Calibration,
    DeviceCalibration,
    LinkCalibration,
    MeasuredDevice,
    MeasuredLink,
    uncalibrated_device,
)
from potluck.cluster.calibration_file import with_calibration, write_calibrated_cluster
from potluck.cluster.catalog import DeviceType, catalog, closest_names, lookup, normalize_name
from potluck.cluster.nodes import PathKind
from potluck.cluster.spec import ClusterSpec, load_cluster
from potluck.errors import ConfigError
from potluck.planner.formulas import MEMORY_BANDWIDTH_EFFICIENCY
from potluck.planner.gemm import effective_dtype
from potluck.plans import DType
from potluck.profiler.run import ProfileResult
from potluck.version import __version__
from potluck.yamlio import read_text

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


def profiled_calibration(result: ProfileResult, device_type: DeviceType,
                         groups: list[str]) -> Calibration:
    """What ``result`` measured, for ``groups`` of ``device_type`` (its figures before any
    calibration: the bandwidth factor is relative to them)."""
    dtype = effective_dtype(device_type, DType.BF16).value
    flops = statistics.median(d.matmul_flops.get(dtype, 0.0) for d in result.devices)
    if flops <= 0:
        raise ConfigError(f"the profile measured no {dtype} matmuls; profile with --dtypes {dtype}")
    bandwidth = statistics.median(d.memory_bandwidth_bytes_per_s for d in result.devices)
    measured = MeasuredDevice(
        tuple((name, statistics.median(d.matmul_flops[name] for d in result.devices))
              for name in result.devices[0].matmul_flops), bandwidth)
    device = DeviceCalibration(
        device_type.name, matmul_efficiency=flops / (device_type.tflops * 1e12),
        memory_bandwidth_factor=bandwidth / (device_type.memory_bandwidth_bytes_per_s
                                             * MEMORY_BANDWIDTH_EFFICIENCY),
        measured=measured)
    return Calibration((device,), _links(result, device_type, groups), _source(result))


def _links(result: ProfileResult, device_type: DeviceType,
           groups: list[str]) -> tuple[LinkCalibration, ...]:
    links = []
    intra_kind = PathKind.NVLINK if device_type.link.joins_whole_node else PathKind.PCIE
    measured = None
    if result.allreduce is not None:
        measured = MeasuredLink(result.allreduce.bus_bandwidth_bytes_per_s, result.allreduce.ranks)
    for same_host, kind in ((True, intra_kind), (False, PathKind.NETWORK)):
        pairs = [p for p in result.pairs if p.same_host is same_host]
        if not pairs:
            continue
        links.append(LinkCalibration(
            bandwidth_bytes_per_s=statistics.median(p.bandwidth_bytes_per_s for p in pairs),
            latency_s=statistics.median(p.latency_s for p in pairs),
            kind=kind, groups=tuple(groups), measured=measured))
    return tuple(links)


def _source(result: ProfileResult) -> str:
    day = datetime.date.today().isoformat()
    return (f"potluck profile {__version__} (torch {torch.__version__.split('+')[0]}, "
            f"{len(result.devices)} ranks, {day})")


def profiled_cluster_text(result: ProfileResult, type_name: str) -> str:
    """A new cluster file: one node group per host profiled, and the calibration."""
    return with_calibration(*_profiled_file(result, type_name))


def _profiled_file(result: ProfileResult, type_name: str) -> tuple[str, Calibration]:
    """The new file's text without its calibration, and the calibration."""
    counts: dict[str, int] = {}
    for host in result.hosts:
        counts[host] = counts.get(host, 0) + 1
    names = {host: _group_name(host, i) for i, host in enumerate(counts)}
    nodes = [{"name": names[h], "gpu": type_name, "gpus_per_node": n} for h, n in counts.items()]
    header = ("# Written by `potluck profile`: the machines it ran on, one node group per host,\n"
              "# with what it measured in `calibration` (the planner reads both).\n")
    text = header + yaml.safe_dump({"name": "profiled", "nodes": nodes}, sort_keys=False)
    return text, profiled_calibration(result, lookup(type_name), list(names.values()))


def _group_name(host: str, index: int) -> str:
    name = re.sub(r"[^a-z0-9-]+", "-", host.lower()).strip("-")
    return name or f"host{index}"


def file_calibration(spec: ClusterSpec, result: ProfileResult, type_name: str) -> Calibration:
    """What ``result`` measured, for the node groups of ``spec`` with ``type_name`` GPUs."""
    if type_name not in {t.name for t in spec.device_types}:
        known = ", ".join(t.name for t in spec.device_types)
        raise ConfigError(f"the cluster file has no {type_name} node groups ({known}); profile on "
                          "its machines, or pass --device-type")
    before = uncalibrated_device(spec.device_type(type_name), spec.calibration)
    groups = [g.name for g in spec.nodes if g.gpu == type_name]
    return profiled_calibration(result, before, groups)


def calibrated_text(original: str, spec: ClusterSpec, result: ProfileResult,
                    type_name: str) -> str:
    """``original`` cluster file text with its calibration section replaced."""
    return with_calibration(original, file_calibration(spec, result, type_name))


def write_calibrated(out: str | Path, result: ProfileResult, type_name: str,
                     cluster: str | Path | None = None) -> ClusterSpec:
    """Write the calibrated cluster file and read it back as the planner will."""
    if cluster is None:
        return write_calibrated_cluster(out, *_profiled_file(result, type_name))
    calibration = file_calibration(load_cluster(cluster), result, type_name)
    return write_calibrated_cluster(out, read_text(Path(cluster), "cluster file"), calibration)
