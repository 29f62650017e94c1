"""The profiler: measure the devices and links potluck runs on, write a calibrated cluster file.

``profile_cluster`` measures matmul throughput per dtype at a model's shapes
and memory bandwidth on every rank (:mod:`potluck.profiler.compute`),
point-to-point and all-reduce bandwidth and latency between ranks with
torch.distributed (:mod:`potluck.profiler.comm`), and writes them as the
``calibration:`` section the planner reads
(:mod:`potluck.profiler.calibration_file`, through the cluster package's one
writer, :mod:`potluck.cluster.calibration_file`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from potluck.cluster.spec import ClusterSpec
from potluck.model.spec import ModelSpec
from potluck.profiler.calibration_file import device_type_name, write_calibrated
from potluck.profiler.run import ProfileOptions, ProfileResult, Progress, profile


@dataclass(frozen=True)
class ProfileOutcome:
    result: ProfileResult
    device_type: str
    cluster: ClusterSpec  # the written file, read back
    path: Path


def profile_cluster(out: str | Path, model: ModelSpec, *, cluster: str | Path | None = None,
                    ranks: int | None = None, budget_s: float = 1.0,
                    device_type: str | None = None, timeout_s: float | None = None,
                    progress: Progress | None = None) -> ProfileOutcome | None:
    """Measure, then write the calibrated cluster file ``out`` (``None`` on ranks but 0)."""
    options = ProfileOptions(model, ranks=ranks, budget_s=budget_s, timeout_s=timeout_s)
    result = profile(options, progress)
    if result is None:
        return None
    type_name = device_type or device_type_name(result.devices[0].device_name)
    spec = write_calibrated(out, result, type_name, cluster)
    return ProfileOutcome(result, type_name, spec, Path(out))


__all__ = ["ProfileOptions", "ProfileOutcome", "ProfileResult", "profile", "profile_cluster"]
