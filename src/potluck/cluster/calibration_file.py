"""Writing the ``calibration:`` and ``execution:`` sections of a cluster file: the one
writer of what ``potluck profile`` and ``potluck calibrate`` measured and fitted.

Each command builds a :class:`~potluck.cluster.calibration.Calibration`;
:func:`calibration_section` turns it into the mapping
:func:`~potluck.cluster.calibration.parse_calibration` reads back,
:func:`with_calibration` puts that section in place of a cluster file's own
(the rest of the text kept as written, the new section at the end), and
:func:`write_calibrated_cluster` writes the file and reads it back as the
planner will. Figures have five significant digits: bandwidths in GB/s,
latencies in microseconds, factors and TFLOP/s as plain numbers (the same
spelling :func:`bandwidth_text`, :func:`duration_text` and :func:`number`
give the rest of a cluster file a command writes).

:func:`with_execution` sets fitted :class:`~potluck.plans.Execution` fields (host times,
in seconds) in a file's ``execution:`` section, keeping its other keys, so that a file
calibrated again still has one section (the cluster parser reads it back into
``ClusterSpec.execution``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from potluck.cluster.calibration import (
    Calibration,
    DeviceCalibration,
    LinkCalibration,
    MeasuredDevice,
    MeasuredLink,
)
from potluck.cluster.spec import ClusterSpec, load_cluster
from potluck.errors import ConfigError
from potluck.safe_files import write_text

_SECTION = re.compile(r"^calibration\s*:")
EXECUTION_SECTION = "execution"
_EXECUTION = re.compile(rf"^{EXECUTION_SECTION}\s*:")


def number(value: float) -> float:
    """A figure rounded to five significant digits."""
    return float(f"{value:.5g}")


def bandwidth_text(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.5g}GB/s"


def duration_text(seconds: float) -> str:
    return f"{seconds * 1e6:.5g}us"


def calibration_section(calibration: Calibration) -> dict[str, Any]:
    """The ``calibration:`` mapping of a cluster file."""
    section: dict[str, Any] = {
        "source": calibration.source,
        "devices": {entry.device: _device(entry) for entry in calibration.devices},
    }
    if calibration.links:
        section["links"] = [_link(link) for link in calibration.links]
    return section


def _device(entry: DeviceCalibration) -> dict[str, Any]:
    fields = {"matmul_efficiency": entry.matmul_efficiency,
              "memory_bandwidth_factor": entry.memory_bandwidth_factor}
    device: dict[str, Any] = {key: number(value) for key, value in fields.items()
                              if value is not None}
    if entry.measured is not None:
        device["measured"] = _measured_device(entry.measured)
    return device


def _measured_device(measured: MeasuredDevice) -> dict[str, Any]:
    figures: dict[str, Any] = {f"tflops_{dtype}": number(flops_per_s / 1e12)
                               for dtype, flops_per_s in measured.matmul_flops_per_s}
    figures["memory_bandwidth"] = bandwidth_text(measured.memory_bandwidth_bytes_per_s)
    return figures


def _link(link: LinkCalibration) -> dict[str, Any]:
    entry: dict[str, Any]
    if link.between:
        entry = {"between": list(link.between)}
    else:
        entry = {"kind": link.kind.value}
        if link.groups:
            entry["groups"] = list(link.groups)
    entry["bandwidth"] = bandwidth_text(link.bandwidth_bytes_per_s)
    if link.latency_s is not None:
        entry["latency"] = duration_text(link.latency_s)
    if link.measured is not None:
        entry["measured"] = _measured_link(link.measured)
    return entry


def _measured_link(measured: MeasuredLink) -> dict[str, Any]:
    return {"allreduce_bus_bandwidth": bandwidth_text(measured.allreduce_bus_bandwidth_bytes_per_s),
            "allreduce_ranks": measured.allreduce_ranks}


def without_calibration(text: str) -> str:
    """Cluster file text without its top-level ``calibration:`` block (which runs up to the
    next top-level key; comment lines inside it go with it)."""
    return without_section(text, _SECTION)


def without_section(text: str, section: re.Pattern[str]) -> str:
    """Cluster file text without the top-level block whose first line matches ``section``."""
    kept, skipping = [], False
    for line in text.splitlines(keepends=True):
        if section.match(line):
            skipping = True
            continue
        if skipping and line.strip() and not line[0].isspace() and not line.lstrip().startswith("#"):
            skipping = False
        if not skipping:
            kept.append(line)
    return "".join(kept)


def with_calibration(text: str, calibration: Calibration) -> str:
    """Cluster file ``text`` with ``calibration`` as its section (replacing any it had)."""
    section = yaml.safe_dump({"calibration": calibration_section(calibration)}, sort_keys=False)
    return without_calibration(text).rstrip("\n") + "\n" + section


def with_execution(text: str, fitted: Mapping[str, float], label: str = "cluster file") -> str:
    """Cluster file ``text`` whose ``execution:`` section has the ``fitted`` fields set and its
    other keys kept (one section, at the end); ``text`` itself when nothing was fitted."""
    if not fitted:
        return text
    data = yaml.safe_load(text)
    old = data.get(EXECUTION_SECTION) if isinstance(data, dict) else None
    if old is not None and not isinstance(old, dict):
        raise ConfigError(f"{label}: execution must be a mapping of Execution fields, "
                          f"e.g. `micro_batch_overhead_s: 0.002`, not {old!r}")
    section = {**(old or {}), **{key: number(value) for key, value in fitted.items()}}
    dumped = yaml.safe_dump({EXECUTION_SECTION: section}, sort_keys=False)
    return without_section(text, _EXECUTION).rstrip("\n") + "\n" + dumped



def write_calibrated_cluster(path: str | Path, text: str, calibration: Calibration,
                             execution: Mapping[str, float] | None = None) -> ClusterSpec:
    """Write ``text`` with ``calibration`` as its section (and the fitted ``execution``
    fields in its ``execution:`` section) to ``path``; return the file's cluster read back
    as the planner reads it."""
    write_text(path, with_execution(with_calibration(text, calibration), execution or {},
                                    str(path)))
    return load_cluster(path)
