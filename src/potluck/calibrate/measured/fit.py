"""Plan each measured run once, then fit a given set of inputs to some of the runs.

Every run is planned once with its layout pinned (on the cluster file as given); a fit
only re-prices those plans (:func:`potluck.planner.evaluate.predict`) with new inputs.
The objective is the sum of squared log errors, i.e. relative errors, so a long run does
not outweigh a short one; the solver is bounded Levenberg-Marquardt (:mod:`.solve`).
Which inputs to fit is :mod:`.select`'s choice, by the error of runs left out of the fit.

A fit starts from the inputs' own values, or from a given point (the fit on every run,
when the same inputs are fitted without one of them: the nearby optimum, in a few
steps). A floor under other times (``Execution.block_host_s``: a block runs at the
host's pace when its GPU work is shorter) has no derivative until it binds, so a fit
from its own value could not move it: it starts instead at the best of
:data:`PROBES_PER_DECADE` values a decade over its range, the other inputs at theirs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from potluck.calibrate.measured.params import (
    Parameter,
    Values,
    applied_cluster,
    applied_execution,
    from_internal,
    to_internal,
)
from potluck.calibrate.measured.runs import MeasuredRun
from potluck.calibrate.measured.solve import jacobian, least_squares
from potluck.cluster.spec import ClusterSpec
from potluck.errors import PotluckError
from potluck.model.spec import ModelSpec
from potluck.planner.evaluate import predict
from potluck.planner.search import search
from potluck.plans import Execution, Plan

SENSITIVITY = 1e-3  # |d ln(predicted) / d coordinate| below this on every run: not exercised
UNCHANGED = 1e-6  # a fitted coordinate this close to its start (relative, or x median run) is kept
PROBES_PER_DECADE = 4  # values of a floor tried per decade of its range (factor 1.78 apart)


@dataclass(frozen=True)
class PlannedRun:
    run: MeasuredRun
    plan: Plan  # the run's layout as potluck plans it on the cluster file


@dataclass(frozen=True)
class Skipped:
    run: MeasuredRun
    reason: str


def plan_runs(spec: ClusterSpec, model: ModelSpec, runs: tuple[MeasuredRun, ...],
              execution: Execution) -> tuple[list[PlannedRun], list[Skipped]]:
    """Each run's pinned layout planned on ``spec``; runs the planner refuses are skipped."""
    planned, skipped = [], []
    for run in runs:
        try:
            result = search(spec, model, run.shape(execution), run.options())
        except PotluckError as err:
            skipped.append(Skipped(run, str(err)))
            continue
        planned.append(PlannedRun(run, result.best))
    return planned, skipped


class RunModel:
    """Predicted iteration times of the planned runs for a set of input values.

    Predictions are remembered by run and values: a fit without one run starts where the
    fit on every run ended, so its first residuals and derivatives were priced already.
    """

    def __init__(self, spec: ClusterSpec, planned: list[PlannedRun]) -> None:
        self.spec = spec
        self.planned = planned
        self.measured_s = np.array([p.run.iteration_time_s for p in planned])
        self.scale_s = float(np.median(self.measured_s))
        self._seen: dict[tuple[int, frozenset], float] = {}

    def predict(self, values: Values, rows: list[int] | None = None) -> np.ndarray:
        key = frozenset(values.items())
        rows = list(range(len(self.planned))) if rows is None else rows
        missing = [i for i in rows if (i, key) not in self._seen]
        if missing:
            cluster = applied_cluster(self.spec, values)
            for i in missing:
                self._seen[i, key] = self._priced(i, cluster, values)
        return np.array([self._seen[i, key] for i in rows])

    def _priced(self, row: int, cluster: ClusterSpec, values: Values) -> float:
        plan = self.planned[row].plan
        training = replace(plan.training,
                           execution=applied_execution(plan.training.execution, values))
        return predict(replace(plan, cluster=cluster, training=training)).iteration_time_s


@dataclass(frozen=True)
class Fit:
    """The inputs fitted and their values; one that ended at its starting value is left
    out (it changes nothing)."""

    values: Values = field(default_factory=dict)
    exercised: tuple[Parameter, ...] = ()  # the candidates the runs depend on at the start


class _Problem:
    """Log residuals of ``rows`` as a function of the solver's coordinates of ``params``."""

    def __init__(self, model: RunModel, rows: list[int]) -> None:
        self.model, self.rows = model, rows
        self.log_measured = np.log(model.measured_s[rows])

    def values(self, params: list[Parameter], x: np.ndarray) -> Values:
        return {p: from_internal(p, float(xi), self.model.scale_s) for p, xi in zip(params, x, strict=True)}

    def residuals(self, params: list[Parameter], x: np.ndarray) -> np.ndarray:
        return np.log(self.model.predict(self.values(params, x), self.rows)) - self.log_measured

    def coordinates(self, params: list[Parameter], values: Values) -> np.ndarray:
        return np.array([to_internal(p, values.get(p, p.start), self.model.scale_s) for p in params])

    def bounds(self, params: list[Parameter]) -> tuple[np.ndarray, np.ndarray]:
        scale = self.model.scale_s
        lower = [math.log(p.lower) if p.is_log else p.lower / scale for p in params]
        upper = [math.log(p.upper) if p.is_log else p.upper / scale for p in params]
        return np.array(lower), np.array(upper)


def derivatives(model: RunModel, params: list[Parameter]) -> np.ndarray:
    """d log(predicted) / d coordinate of each of ``params`` (columns) for every run (rows),
    at the inputs' starting values."""
    problem = _Problem(model, list(range(len(model.planned))))
    x = problem.coordinates(params, {})
    lower, upper = problem.bounds(params)
    return jacobian(lambda y: problem.residuals(params, y), x, problem.residuals(params, x),
                    lower, upper)


def exercised(model: RunModel, candidates: list[Parameter]) -> list[Parameter]:
    """The candidates the runs depend on: a derivative above :data:`SENSITIVITY` on some
    run, or, for a floor, some value of its range that lowers the squared error (the runs
    are host-bound there)."""
    smooth = [p for p in candidates if not p.is_floor]
    columns = derivatives(model, smooth)
    moving = {p for j, p in enumerate(smooth) if np.max(np.abs(columns[:, j])) > SENSITIVITY}
    problem = _Problem(model, list(range(len(model.planned))))
    for floor in (p for p in candidates if p.is_floor):
        start = problem.coordinates([floor], {})
        if _best_probe(problem, [floor], start, 0) != start[0]:
            moving.add(floor)
    return [p for p in candidates if p in moving]


def fit_terms(model: RunModel, params: list[Parameter], rows: list[int] | None = None,
              start: Values | None = None) -> Values:
    """``params`` fitted to ``rows`` of ``model`` (all by default), from ``start`` (by
    default the inputs' own values, a floor from its best probe)."""
    problem = _Problem(model, list(range(len(model.planned))) if rows is None else rows)
    if not params:
        return {}
    x0 = problem.coordinates(params, start or {})
    if start is None:
        for j in (j for j, p in enumerate(params) if p.is_floor):
            x0[j] = _best_probe(problem, params, x0, j)
    lower, upper = problem.bounds(params)
    x = least_squares(lambda y: problem.residuals(params, y), x0, lower, upper)
    return problem.values(params, x)


def changed(values: Values, scale_s: float) -> Values:
    """``values`` without those that ended at their starting value (within :data:`UNCHANGED`,
    relative, or x ``scale_s`` for seconds)."""
    def moved(param: Parameter, value: float) -> bool:
        return abs(to_internal(param, value, scale_s) - to_internal(param, param.start, scale_s)) > UNCHANGED
    return {p: v for p, v in values.items() if moved(p, v)}


def _probes(problem: _Problem, floor: Parameter) -> np.ndarray:
    lower, upper = problem.bounds([floor])
    count = max(2, math.ceil((upper[0] - lower[0]) / math.log(10) * PROBES_PER_DECADE) + 1)
    return np.linspace(lower[0], upper[0], count)


def _best_probe(problem: _Problem, params: list[Parameter], x: np.ndarray, j: int) -> float:
    """Coordinate ``j`` (a floor) at its probe with the smallest squared error, the other
    coordinates held; its start when no probe does better."""
    best, best_loss = x[j], float(problem.residuals(params, x) @ problem.residuals(params, x))
    for probe in _probes(problem, params[j]):
        trial = x.copy()
        trial[j] = probe
        r = problem.residuals(params, trial)
        if float(r @ r) < best_loss:
            best, best_loss = probe, float(r @ r)
    return float(best)
