"""``potluck calibrate RUN_DIR``: fit the cost model's inputs to a traced run, write them
into a cluster file, and show the run's prediction error before and after.

"Before" is the run's plan as it was made; "after" is the same plan on the
calibrated cluster file read back (what the next ``potluck plan`` on it
sees), both simulated and compared with the same measured steps. A fit that
predicts the run's own step worse than the plan did is refused
(:class:`~potluck.errors.PotluckError`, nothing written): the file is
written beside the output first and only moved into place when it helps.

The framework's host time per iteration that the optimizer step shows
(:func:`potluck.calibrate.fit_devices.fit_step_overhead`) is set in the
file's ``execution:`` section (``step_overhead_s``, the
:class:`~potluck.plans.Execution` field; the section's other keys kept, by
:func:`potluck.cluster.calibration_file.with_execution`, the writer
``calibrate --measured`` uses too), which the "after" plan runs with.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, replace
from pathlib import Path

from potluck.calibrate.cluster_file import write_calibrated
from potluck.calibrate.compare_run import compare_run
from potluck.calibrate.fit import Fit, applied_overhead, fit_run
from potluck.calibrate.measure import kept_steps
from potluck.calibrate.run import RunRecord, load_run
from potluck.cluster.spec import ClusterSpec, load_cluster
from potluck.errors import PotluckError
from potluck.plans import check_plan_matches
from potluck.safe_files import writing
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
    """Fit, write ``out`` (default: :func:`default_output`) and compare before and after;
    refused (nothing written) when the fit would predict the run worse than before."""
    record = load_run(run_dir)
    if cluster is not None:
        check_plan_matches(record.plan, load_cluster(cluster), label=f"{run_dir}/plan.json")
    fit = fit_run(record, source=_source(record))
    path = Path(out) if out is not None else default_output(run_dir, cluster)
    before = compare_run(record)
    pending = path.with_name(f".{path.name}.pending")
    try:
        calibrated = _write(pending, fit, record, cluster)
        overhead_s = _written_overhead(fit)
        after = compare_run(record, applied_overhead(replace(record.plan, cluster=calibrated),
                                                     overhead_s))
        check_not_worse(record, before, after)
        with writing(path):
            os.replace(pending, path)
    finally:
        pending.unlink(missing_ok=True)
    return CalibrationOutcome(record, fit, path, calibrated, before, after)


def _written_overhead(fit: Fit) -> float | None:
    return fit.step_overhead_s or None  # none fitted, or none beyond the traffic


def _write(path: Path, fit: Fit, record: RunRecord, cluster: str | Path | None) -> ClusterSpec:
    """The calibrated file at ``path`` (a fitted host time set in its ``execution:``
    section), its cluster read back."""
    overhead_s = _written_overhead(fit)
    execution = {} if overhead_s is None else {"step_overhead_s": overhead_s}
    return write_calibrated(path, fit, record.plan.cluster, cluster, execution)


def check_not_worse(record: RunRecord, before: TraceComparison, after: TraceComparison) -> None:
    """Refuse a calibration that predicts the run's step further from the measurement than
    the run's own plan did."""
    if abs(after.step_error) <= abs(before.step_error):
        return
    raise PotluckError(
        f"calibration refused: fitted to {record.run_dir} it would predict the step "
        f"{after.predicted_step_s:.4g} s ({after.step_error:+.1%} of the measured "
        f"{after.measured_step_s:.4g} s), worse than the cluster file's {before.predicted_step_s:.4g} s "
        f"({before.step_error:+.1%}); nothing written (trace more steps, --trace-steps, on a "
        "quieter machine, or run potluck profile for the devices' figures)")
