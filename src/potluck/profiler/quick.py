"""A quick measurement of this machine's CPU, for training CPU ranks the cluster file has no
figures for.

The catalog's ``cpu`` entry is a nominal guess (a small cloud VM); CPUs differ
by far more than GPUs of one name, so a plan for CPU ranks predicted with it can
miss by two orders of magnitude. When a cluster's ``cpu`` devices have no
calibration entry, :func:`with_measured_cpu` measures what one training rank of
this machine gets, as ``potluck profile`` measures it
(:mod:`potluck.profiler.compute`) but in about a second and in this process:
FP32 matmul FLOP/s at the model's GEMM shapes with the threads a rank gets
(the cores split among the ranks, as ``runtime.launch.local`` splits them), and
memory bandwidth: an element-wise add over all cores, divided among the ranks,
since they share the memory bus. The figures become the ``cpu`` entry of the
cluster's calibration (``profiler.calibration_file.profiled_calibration``), so
the plan and its prediction use them. Measured once per process, and kept in
a run directory's ``cpu_measured.json`` once a run is launched there
(:func:`keep_measurement`), so that a resumed run plans with the same figures.
That file is a cache from a directory that may come from someone else: one that
does not parse, is for another machine or model, or holds anything but finite
positive figures is ignored and the CPU measured again.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
from dataclasses import asdict, replace
from pathlib import Path

import torch

from potluck.cluster.calibration import Calibration, calibrate_device, calibrate_group
from potluck.cluster.spec import ClusterSpec
from potluck.errors import ConfigError
from potluck.model.spec import ModelSpec
from potluck.profiler.calibration_file import profiled_calibration
from potluck.profiler.compute import (
    DeviceMeasurement,
    block_gemm_shapes,
    matmul_flops,
    memory_bandwidth,
)
from potluck.profiler.run import ProfileResult
from potluck.safe_files import write_text
from potluck.yamlio import read_bounded

log = logging.getLogger(__name__)
CPU = "cpu"
MATMUL_BUDGET_S = 0.6
BANDWIDTH_BYTES = 64e6  # per tensor: far beyond the caches
BANDWIDTH_BUDGET_S = 0.2
CACHE_FILE = "cpu_measured.json"
_MEASURED: dict[tuple, DeviceMeasurement] = {}


def needs_measurement(spec: ClusterSpec) -> bool:
    """Whether ``spec`` trains on ``cpu`` devices its calibration says nothing of."""
    if not any(group.gpu == CPU for group in spec.nodes):
        return False
    known = spec.calibration.devices if spec.calibration else ()
    return not any(entry.device == CPU for entry in known)


def ranks_per_machine(spec: ClusterSpec) -> int:
    return max(group.gpus_per_node for group in spec.nodes if group.gpu == CPU)


def measure_cpu(model: ModelSpec, ranks: int, cache_dir: str | Path | None = None
                ) -> DeviceMeasurement:
    """What one of ``ranks`` CPU training ranks of this machine gets (measured once per
    process, or read from ``cache_dir``'s cache when it holds this machine's figures)."""
    key = _key(model, ranks)
    if key not in _MEASURED:
        cached = _cached(Path(cache_dir) / CACHE_FILE, key) if cache_dir is not None else None
        _MEASURED[key] = cached or _measure(model, ranks, key[3])
    return _MEASURED[key]


def keep_measurement(model: ModelSpec, ranks: int, cache_dir: str | Path) -> None:
    """Write this process's measurement for ``model`` on ``ranks`` ranks into ``cache_dir``
    (a run directory, when its run is launched); nothing when there is none."""
    key = _key(model, ranks)
    if key not in _MEASURED:
        return
    write_text(Path(cache_dir) / CACHE_FILE,
               json.dumps({"key": repr(key), **asdict(_MEASURED[key])}))


def _key(model: ModelSpec, ranks: int) -> tuple:
    """What a measurement depends on: the machine, torch, the threads a rank gets, the
    model's GEMM shapes."""
    cores = os.cpu_count() or 1
    return (socket.gethostname(), torch.__version__, cores, max(1, cores // ranks), ranks,
            tuple(block_gemm_shapes(model)))


def _cached(cache: Path, key: tuple) -> DeviceMeasurement | None:
    """The cache's measurement when it is this key's and holds finite positive figures."""
    if not cache.exists():
        return None
    try:
        data = json.loads(read_bounded(cache, "CPU measurement cache"))
        if data.get("key") != repr(key):
            return None
        flops = {str(k): float(v) for k, v in data["matmul_flops"].items()}
        bandwidth = float(data["memory_bandwidth_bytes_per_s"])
    except (ConfigError, ValueError, TypeError, KeyError, AttributeError):
        log.warning("%s is not a CPU measurement potluck wrote; measuring again", cache)
        return None
    if not all(math.isfinite(v) and v > 0 for v in (*flops.values(), bandwidth)) or not flops:
        log.warning("%s holds figures that are not finite and positive; measuring again", cache)
        return None
    return DeviceMeasurement(CPU, flops, bandwidth)


def _measure(model: ModelSpec, ranks: int, threads: int) -> DeviceMeasurement:
    device = torch.device(CPU)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        flops = matmul_flops(device, torch.float32, block_gemm_shapes(model), MATMUL_BUDGET_S)
        torch.set_num_threads(os.cpu_count() or 1)
        shared = memory_bandwidth(device, BANDWIDTH_BYTES, BANDWIDTH_BUDGET_S) / ranks
    finally:
        torch.set_num_threads(before)
    return DeviceMeasurement(CPU, {"fp32": flops}, shared)


def with_measured_cpu(spec: ClusterSpec, model: ModelSpec, cache_dir: str | Path | None = None
                      ) -> ClusterSpec:
    """``spec`` with this machine's measured figures as its ``cpu`` calibration, when it
    has cpu devices and no such entry (else unchanged)."""
    if not needs_measurement(spec):
        return spec
    measured = measure_cpu(model, ranks_per_machine(spec), cache_dir)
    groups = [group.name for group in spec.nodes if group.gpu == CPU]
    found = profiled_calibration(ProfileResult([socket.gethostname()], [measured]),
                                 spec.device_type(CPU), groups)
    entry = Calibration(found.devices, (), found.source)
    old = spec.calibration or Calibration()
    source = f"{old.source}; cpu: {found.source}, quick" if old.source else f"{found.source}, quick"
    return replace(
        spec,
        nodes=tuple(calibrate_group(group, entry) for group in spec.nodes),
        device_types=tuple(calibrate_device(t, entry) for t in spec.device_types),
        calibration=Calibration(old.devices + found.devices, old.links, source),
    )
