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
a run directory's ``cpu_measured.json`` when one is given.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict, replace
from pathlib import Path

import torch

from potluck.cluster.calibration import Calibration, calibrate_device, calibrate_group
from potluck.cluster.spec import ClusterSpec
from potluck.model.spec import ModelSpec
from potluck.profiler.calibration_file import profiled_calibration
from potluck.profiler.compute import (
    DeviceMeasurement,
    block_gemm_shapes,
    matmul_flops,
    memory_bandwidth,
)
from potluck.profiler.run import ProfileResult

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
    """What one of ``ranks`` CPU training ranks of this machine gets (cached)."""
    cores = os.cpu_count() or 1
    threads = max(1, cores // ranks)
    key = (socket.gethostname(), torch.__version__, cores, threads, ranks,
           tuple(block_gemm_shapes(model)))
    cache = Path(cache_dir) / CACHE_FILE if cache_dir is not None else None
    if key not in _MEASURED:
        _MEASURED[key] = _cached(cache, key) or _measure(model, ranks, threads)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps({"key": repr(key), **asdict(_MEASURED[key])}))
    return _MEASURED[key]


def _cached(cache: Path | None, key: tuple) -> DeviceMeasurement | None:
    if cache is None or not cache.is_file():
        return None
    try:
        data = json.loads(cache.read_text())
    except json.JSONDecodeError:
        return None
    if data.pop("key", None) != repr(key):
        return None
    return DeviceMeasurement(**data)


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
