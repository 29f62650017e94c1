"""``potluck calibrate RUN_DIR``: fit the cost model's inputs to a traced run, write them
into a cluster file, and show the run's prediction error before and after.

"Before" is the run's plan as it was made; "after" is the same plan on the
calibrated cluster file read back (what the next ``potluck plan`` on it
sees), both simulated and compared with the same measured steps.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, replace
from pathlib import Path

from potluck.calibrate.cluster_file import write_calibrated
from potluck.calibrate.compare_run import compare_run
from potluck.calibrate.fit import Fit, fit_run
from potluck.calibrate.measure import kept_steps
from potluck.calibrate.run import RunRecord, load_run
from potluck.cluster.spec import ClusterSpec, load_cluster
from potluck.plans import check_plan_matches
from potluck.sim.compare import TraceComparison
from potluck.version import __version__

CALIBRATED_FILE = "calibrated.yaml"


@dataclass(frozen=True)
class CalibrationOutcome:
    """What ``potluck calibrate`` fitted, where it wrote it, and the errors before and after."""

    record: RunRecord
    fit: Fit
    cluster_file: Path
    calibrated: ClusterSpec
    before: TraceComparison
    after: TraceComparison

def default_output(run_dir: str | Path, cluster: str | Path | None) -> Path:
    """``<cluster>-calibrated.yaml`` beside the cluster file, else ``RUN_DIR/calibrated.yaml``."""
    if cluster is not None:
        path = Path(cluster)
        return path.with_name(f"{path.stem}-calibrated.yaml")
    return Path(run_dir) / CALIBRATED_FILE


def _source(record: RunRecord) -> str:
    steps = kept_steps(record.measured)
    day = datetime.date.today().isoformat()
    return (f"potluck calibrate {__version__} from {record.run_dir} ({record.plan.layout()}, "
            f"steps {steps[0]}-{steps[-1]}, {day})")


def calibrate_run(run_dir: str | Path, cluster: str | Path | None = None,
                  out: str | Path | None = None) -> CalibrationOutcome:
    """Fit, write ``out`` (default: :func:`default_output`) and compare before and after."""
    record = load_run(run_dir)
    if cluster is not None:
        check_plan_matches(record.plan, load_cluster(cluster), label=f"{run_dir}/plan.json")
    fit = fit_run(record, source=_source(record))
    path = Path(out) if out is not None else default_output(run_dir, cluster)
    calibrated = write_calibrated(path, fit, record.plan.cluster, cluster)
    after = compare_run(record, replace(record.plan, cluster=calibrated))
    return CalibrationOutcome(record, fit, path, calibrated, compare_run(record), after)
