"""``potluck calibrate --measured runs.csv``: plan every run, choose and fit, check, write.

"Before" is each run's prediction on the cluster file as given; "after" its
prediction on the written file read back (what the next ``potluck plan`` sees);
"held out" its prediction by the chosen inputs fitted without it (:mod:`.select`).
Two checks refuse a fit, and nothing is written: no set of inputs predicts held-out
runs better than the cluster file by more than the noise (the selection chooses none;
with 3 runs or more), and the written file does not lower both the squared log error
and the mean absolute percentage error over the runs.
"""

from __future__ import annotations

import datetime
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from potluck.calibrate.measured.fit import Fit, PlannedRun, RunModel, Skipped, changed, plan_runs
from potluck.calibrate.measured.output import calibrated_text, merged_calibration
from potluck.calibrate.measured.params import Parameter, RunTime, candidates, rated_cluster
from potluck.calibrate.measured.runs import read_runs
from potluck.calibrate.measured.select import (
    MIN_HELD_OUT,
    SIGNIFICANT,
    Selection,
    gain,
    select_terms,
    t_95,
)
from potluck.calibrate.measured.stats import mape
from potluck.cluster.spec import ClusterSpec, parse_cluster
from potluck.errors import ConfigError, PotluckError
from potluck.model.spec import ModelSpec
from potluck.planner.evaluate import predict
from potluck.plans import Execution
from potluck.version import __version__
from potluck.yamlio import parse_yaml, read_text

MIN_RUNS = 2  # one input from one run would explain it by construction

Progress = Callable[[float, str], None]  # (fraction done, what it is doing)


class CalibrationRefused(PotluckError):
    """The fit would not predict the runs better than the cluster file does."""


@dataclass(frozen=True)
class MeasuredOutcome:
    """What was fitted to which runs, where it was written, and the errors."""

    cluster_file: Path
    planned: tuple[PlannedRun, ...]
    skipped: tuple[Skipped, ...]
    fit: Fit
    candidates: tuple[Parameter, ...]
    selection: Selection
    before_s: tuple[float, ...]
    after_s: tuple[float, ...]
    fit_time_s: float  # the selection's fits, wall clock

    @property
    def measured_s(self) -> tuple[float, ...]:
        return tuple(p.run.iteration_time_s for p in self.planned)

    @property
    def held_out_s(self) -> tuple[float, ...]:
        """Each run predicted by the chosen inputs fitted without it."""
        return self.selection.chosen.held_out_s

    def notes(self) -> tuple[str, ...]:
        """What the user should know about how the inputs were chosen."""
        if self.selection.folds:
            return ()
        return (f"{len(self.planned)} runs: too few to choose inputs by held-out error "
                f"(leaving one out needs at least {MIN_HELD_OUT}); fitted the one input that "
                "best explains them, with no held-out check",)


def default_output(cluster: str | Path) -> Path:
    path = Path(cluster)
    return path.with_name(f"{path.stem}-calibrated.yaml")


def calibrate_measured(runs_file: str | Path, model: ModelSpec, cluster: str | Path,
                       out: str | Path | None = None, progress: Progress | None = None
                       ) -> MeasuredOutcome:
    """Fit the inputs of ``cluster`` to the runs of ``runs_file`` and write ``out``;
    ``progress(fraction, what)`` hears of the fit and each leave-one-out fit, and is told
    after the first fit how long the others will take."""
    report = progress or _silent
    text = _read(cluster)
    spec = parse_cluster(text, str(cluster))
    execution = spec.execution or Execution()
    runs = read_runs(runs_file, {group.name: group.num_gpus for group in spec.nodes})
    report(0.0, f"planning {len(runs)} runs")
    planned, skipped = plan_runs(spec, model, runs, execution)
    _check_enough(Path(runs_file), len(runs), planned, skipped)
    started = time.perf_counter()
    runs_model = RunModel(spec, planned)
    found = candidates(spec, execution, run_times(planned),
                       rated_cluster(parse_yaml(text, str(cluster)), str(cluster)))
    selection = select_terms(runs_model, found, report)
    elapsed = time.perf_counter() - started
    check_generalizes(selection)
    fit = Fit(changed(selection.chosen.values, runs_model.scale_s),
              tuple(p for p in found if p in selection.pool))
    path = Path(out) if out is not None else default_output(cluster)
    source = (f"potluck calibrate {__version__} --measured {Path(runs_file).name} "
              f"({len(planned)} runs, {datetime.date.today().isoformat()})")
    new_text = calibrated_text(text, merged_calibration(spec, fit.values, source), fit.values,
                               str(cluster))
    before = selection.tried[0].in_sample_s
    after = predict_on(planned, parse_cluster(new_text, str(path)))
    check_improves(fit, before, after, runs_model.measured_s.tolist())
    path.write_text(new_text)
    return MeasuredOutcome(path, tuple(planned), tuple(skipped), fit, tuple(found), selection,
                           before, after, elapsed)


def run_times(planned: list[PlannedRun]) -> list[RunTime]:
    """Each run's measured seconds and micro-batches per pipeline (the host times' bounds)."""
    return [RunTime(p.run.iteration_time_s, max(q.num_micro_batches for q in p.plan.pipelines))
            for p in planned]


def _silent(fraction: float, what: str) -> None:
    """No progress shown."""


def _read(cluster: str | Path) -> str:
    if not Path(cluster).exists():
        raise ConfigError(f"cluster file {str(cluster)!r} not found; check the path")
    return read_text(Path(cluster), "cluster file")


def _check_enough(runs_file: Path, total: int, planned: list[PlannedRun],
                  skipped: list[Skipped]) -> None:
    if len(planned) >= MIN_RUNS:
        return
    why = "; ".join(f"line {s.run.line}: {s.reason}" for s in skipped)
    raise ConfigError(f"{runs_file}: {len(planned)} of {total} runs could be planned, a fit needs "
                      f"at least {MIN_RUNS}{' (' + why + ')' if why else ''}; add runs")


def predict_on(planned: list[PlannedRun], spec: ClusterSpec) -> tuple[float, ...]:
    """Each run's plan predicted on ``spec``, with the execution traits of its ``execution:``
    section (the runs' own where it has none)."""
    times = []
    for p in planned:
        training = replace(p.plan.training, execution=spec.execution or p.plan.training.execution)
        times.append(predict(replace(p.plan, cluster=spec, training=training)).iteration_time_s)
    return tuple(times)


def check_generalizes(selection: Selection) -> None:
    """Refuse when no set of inputs predicts held-out runs significantly better than the
    cluster file (the selection chose none, with 3 runs or more)."""
    best = selection.best_fitted()
    if selection.chosen.terms or not selection.folds or best is None:
        return
    better, standard_error = gain(best, selection.tried[0], selection.measured_s)
    count = len(selection.measured_s)
    raise CalibrationRefused(
        f"no fit predicts runs left out of it significantly better than the cluster file: "
        f"held-out error {selection.held_out_mape(best):.1%} with the best inputs "
        f"({best.names()}) against {selection.uncalibrated_mape:.1%} uncalibrated, "
        f"{better * 100:.1f} points better with a standard error of {standard_error * 100:.1f} "
        f"(a fit must be better by {SIGNIFICANT * 100:.1f} points and by {t_95(count - 1):.2f} "
        f"standard errors over {count} runs); nothing written: add runs whose layouts differ "
        "more")


def check_improves(fit: Fit, before: tuple[float, ...], after: tuple[float, ...],
                   measured: list[float]) -> None:
    """Refuse a fit that does not predict the runs better than the cluster file does."""
    if not fit.values:
        raise CalibrationRefused(
            f"no input explains these runs better than the cluster file does (error "
            f"{mape(before, measured):.1%} before); nothing written: add runs whose layouts "
            "differ more")
    old, new = _squared_log_error(before, measured), _squared_log_error(after, measured)
    if new >= old or mape(after, measured) >= mape(before, measured):
        raise CalibrationRefused(
            f"the fit predicts these runs no better than the cluster file (error "
            f"{mape(before, measured):.1%} before, {mape(after, measured):.1%} after); nothing "
            "written: check that the runs and the cluster file describe the same machines")


def _squared_log_error(predicted: tuple[float, ...], measured: list[float]) -> float:
    return sum(math.log(p / m) ** 2 for p, m in zip(predicted, measured, strict=True))
