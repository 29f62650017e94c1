"""Predicted against measured peak memory per rank, from a run directory.

The prediction is the plan's cost model, :attr:`potluck.plans.Prediction.memory` (one
:class:`~potluck.plans.DeviceMemory` per device: its ``total_bytes``, and its
``host_bytes`` where the cost model predicts host memory); the measurement is the
``memory`` rows of ``metrics.jsonl`` (:func:`potluck.runtime.loop.trainer.rank_memory_rows`:
each rank's peak device and host bytes per step, and what its stashes took on other
devices). Bytes a rank holds for a peer (peer swap) count in that peer's device bytes,
as the memory contract says; the figure per rank is the largest over the run's steps.
A GPU run's rows also give each device's allocator reserve and its memory in use by every
process (:mod:`potluck.runtime.loop.peak_memory`); a peer's reserve counts what the
swapping rank's allocator reserved there, and both are shown beside the allocator peak
(None for CPU runs and runs of older versions).

Like is compared with like: ranks that ran as CPU processes (a CPU run, or GPUs emulated
with ``--emulate``; their rows have no GPU figures) have no CUDA context, cuBLAS or NCCL
workspaces, so the cost model's runtime overhead of each GPU
(:meth:`~potluck.planner.cost.CostModel.overhead_bytes`, 1 GB) is left out of their
prediction (``overhead_left_out_bytes``) and the table says so.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from potluck.cluster.topology import Cluster
from potluck.errors import ConfigError
from potluck.planner.cost import CostModel
from potluck.planner.evaluate import predict
from potluck.plans import Plan, load_plan
from potluck.tables import compact_table
from potluck.yamlio import MAX_LOG_BYTES, read_text

METRICS_FILE = "metrics.jsonl"
PLAN_FILE = "plan.json"


@dataclass(frozen=True)
class RankMemory:
    """One device's predicted and measured peaks, in bytes."""

    device: str
    predicted_device_bytes: float
    measured_device_bytes: float
    predicted_host_bytes: float
    measured_host_bytes: float
    measured_reserved_bytes: float | None = None  # GPUs: the allocators' reserve there
    measured_used_bytes: float | None = None  # GPUs: the device's memory in use, all processes
    overhead_left_out_bytes: float = 0.0  # the GPU runtime's, absent from a CPU rank

    @property
    def device_error(self) -> float:
        """Predicted over measured, minus one (0.05: predicted 5% high)."""
        return self.predicted_device_bytes / max(self.measured_device_bytes, 1.0) - 1.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "device_error": self.device_error}


def memory_rows(run_dir: str | Path) -> list[tuple[dict[str, Any], ...]]:
    """Each step's per-rank memory rows of a run's ``metrics.jsonl`` (none: an older run)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in read_text(path, METRICS_FILE, MAX_LOG_BYTES).splitlines()
            if line.strip()]
    return [tuple(row["memory"]) for row in rows if row.get("memory")]


def measured_peaks(steps: list[tuple[dict[str, Any], ...]]) -> dict[str, tuple[float, float]]:
    """Each device's (device, host) peak over the steps, peer stashes on their holder."""
    peaks: dict[str, tuple[float, float]] = {}
    for step in steps:
        device_bytes = {row["device"]: row["device_bytes"] for row in step}
        for row in step:
            for peer, held in row.get("held_on", {}).items():
                device_bytes[peer] = device_bytes.get(peer, 0.0) + held
        for row in step:
            name = row["device"]
            old = peaks.get(name, (0.0, 0.0))
            peaks[name] = (max(old[0], device_bytes[name]), max(old[1], row["host_bytes"]))
    return peaks


def measured_gpu_peaks(steps: list[tuple[dict[str, Any], ...]]
                       ) -> dict[str, tuple[float, float]]:
    """Each GPU's (reserved, used) peak over the steps of a GPU run: its rank's reserve plus
    what peers' allocators reserved on it, and its memory in use (already every process's)."""
    peaks: dict[str, tuple[float, float]] = {}
    for step in steps:
        reserved = {row["device"]: row["reserved_bytes"] for row in step
                    if row.get("reserved_bytes") is not None}
        for row in step:
            for peer, held in row.get("reserved_on", {}).items():
                reserved[peer] = reserved.get(peer, 0.0) + held
        for row in step:
            name, used = row["device"], row.get("used_bytes")
            if used is None or name not in reserved:
                continue
            old = peaks.get(name, (0.0, 0.0))
            peaks[name] = (max(old[0], reserved[name]), max(old[1], used))
    return peaks


def compare_memory(plan: Plan, steps: list[tuple[dict[str, Any], ...]]) -> tuple[RankMemory, ...]:
    """Every device of ``plan``: its predicted peaks beside the measured ones."""
    if not steps:
        raise ConfigError("the run's metrics.jsonl has no memory rows: train it again with this "
                          "version of potluck (potluck train --out DIR)")
    measured, gpus = measured_peaks(steps), measured_gpu_peaks(steps)
    prediction = plan.prediction or predict(plan)
    left_out = {} if gpus else runtime_overheads(plan)
    return tuple(
        RankMemory(m.device, m.total_bytes - left_out.get(m.device, 0.0),
                   measured.get(m.device, (0.0, 0.0))[0],
                   float(getattr(m, "host_bytes", 0.0)), measured.get(m.device, (0.0, 0.0))[1],
                   *gpus.get(m.device, (None, None)),
                   overhead_left_out_bytes=left_out.get(m.device, 0.0))
        for m in prediction.memory)


def runtime_overheads(plan: Plan) -> dict[str, float]:
    """What the cost model adds to each device of ``plan`` for its GPU runtime (0 for a CPU),
    by device id."""
    cost, devices = CostModel.for_plan(plan), Cluster(plan.cluster).by_id
    return {device: cost.overhead_bytes(devices[device].type) for device in plan.devices}


def compare_run_memory(run_dir: str | Path) -> tuple[RankMemory, ...]:
    """``potluck compare RUN_DIR``'s memory table."""
    run_dir = Path(run_dir)
    if not (run_dir / PLAN_FILE).is_file():
        raise ConfigError(f"{run_dir} has no {PLAN_FILE}: not a run directory of potluck train --out")
    return compare_memory(load_plan(run_dir / PLAN_FILE), memory_rows(run_dir))


def render_memory(console: Console, ranks: tuple[RankMemory, ...]) -> None:
    """The per-rank table of ``potluck compare`` (a GPU run's reserve and use beside)."""
    gpus = any(r.measured_reserved_bytes is not None for r in ranks)
    extra = ("reserved MB", "used MB") if gpus else ()
    table = compact_table("peak memory per rank", (
        "device", "predicted MB", "measured MB", "error", *extra, "host predicted MB",
        "host measured MB"), left=("device",))
    for r in ranks:
        figures = (_megabytes(r.measured_reserved_bytes), _megabytes(r.measured_used_bytes))
        table.add_row(r.device, f"{r.predicted_device_bytes / 1e6:.4g}",
                      f"{r.measured_device_bytes / 1e6:.4g}", f"{r.device_error:+.1%}",
                      *(figures if gpus else ()),
                      f"{r.predicted_host_bytes / 1e6:.4g}", f"{r.measured_host_bytes / 1e6:.4g}")
    console.print(table)
    left_out = max((r.overhead_left_out_bytes for r in ranks), default=0.0)
    if left_out:
        console.print(f"predicted leaves out the {left_out / 1e9:.3g} GB a GPU's runtime takes "
                      "(CUDA context, cuBLAS and NCCL workspaces): these ranks ran as CPU "
                      "processes, which hold none", highlight=False)


def _megabytes(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 1e6:.4g}"
