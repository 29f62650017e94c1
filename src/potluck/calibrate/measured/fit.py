"""Plan each measured run, then choose and fit the few inputs that explain the runs.

Every run is planned once with its layout pinned (on the cluster file as given); the
fit only re-prices those plans (:func:`potluck.planner.evaluate.predict`) with new
inputs. The objective is the sum of squared log errors, i.e. relative errors, so a
long run does not outweigh a short one.

Which inputs: those the runs depend on (a non-zero derivative where the fit stands: an
all-reduce hidden behind compute can show once compute is fitted faster), added one at a
time by forward stepwise selection (Efroymson 1960; Draper & Smith, *Applied
Regression Analysis*, 3rd ed., ch. 15): the candidate whose derivative, orthogonal to
the ones already chosen, best explains what is left of the error (and can move that
way within its bounds); it is fitted with the chosen ones and kept if its F statistic
(the drop in squared error over the error per remaining degree of freedom) is at least
:data:`F_TO_ENTER`; then an earlier input that the later ones make unnecessary (its F
below :data:`F_TO_REMOVE`, or the rest fitting as well without it) is dropped. At most
half as many inputs as runs are fitted.

A floor under other times (``Execution.block_host_s``: a block runs at the host's pace
when its GPU work is shorter) has no derivative until it binds, so its derivative cannot
say whether it would help: it is probed instead, at :data:`PROBES_PER_DECADE` values a
decade over its range with the chosen inputs held, scored by the drop in squared error
its best value gives, and, if it enters, fitted from that value. Greedy entry lets a
smooth input mimic a floor (a per-micro-batch overhead grows with the blocks a host-bound
stage runs, and corrects the GPU-bound runs a little too), after which the floor and the
input it needs beside it (the efficiency of the GPU-bound runs) no longer pass F-to-enter
one at a time. So the selection is run a second time with the floor entered first, and
the result with the smaller residual mean square (squared error per remaining degree of
freedom; Draper & Smith, sec. 15.1) is kept. Where no value of the floor lowers the error
(the runs are not host-bound) that second run does not happen.
"""

from __future__ import annotations

import math
from collections.abc import Callable
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
from potluck.calibrate.measured.stats import leave_one_out
from potluck.cluster.spec import ClusterSpec
from potluck.errors import PotluckError
from potluck.model.spec import ModelSpec
from potluck.planner.evaluate import predict
from potluck.planner.search import search
from potluck.plans import Execution, Plan

F_TO_ENTER = 4.0  # Efroymson's customary F-to-enter (about the 5% level for 1 and >= 8 dof)
F_TO_REMOVE = 3.9  # below F-to-enter, so that an input is not added and dropped in turn
SUSPECT = 2.0  # refit without an input whose linearised F-to-remove is below this x F_TO_REMOVE
MAX_STEPS = 20  # entries (each with its removals) before the selection stops regardless
SENSITIVITY = 1e-3  # |d ln(predicted) / d coordinate| below this on every run: not exercised
COLLINEAR = 0.05  # a derivative this close to the chosen ones' span tells nothing new
EXACT = 1e-6  # RMS log error below this: nothing left to explain
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
    """Predicted iteration times of the planned runs for a set of input values."""

    def __init__(self, spec: ClusterSpec, planned: list[PlannedRun]) -> None:
        self.spec = spec
        self.planned = planned
        self.measured_s = np.array([p.run.iteration_time_s for p in planned])
        self.scale_s = float(np.median(self.measured_s))

    def predict(self, values: Values, rows: list[int] | None = None) -> np.ndarray:
        cluster = applied_cluster(self.spec, values)
        times = []
        for i in range(len(self.planned)) if rows is None else rows:
            plan = self.planned[i].plan
            training = replace(plan.training,
                               execution=applied_execution(plan.training.execution, values))
            times.append(predict(replace(plan, cluster=cluster, training=training)).iteration_time_s)
        return np.array(times)


@dataclass(frozen=True)
class Fit:
    """The inputs chosen (in order of entry) and their fitted values; one that entered and
    ended at its starting value is left out (it changes nothing)."""

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

    def start(self, params: list[Parameter]) -> np.ndarray:
        return np.array([to_internal(p, p.start, self.model.scale_s) for p in params])

    def bounds(self, params: list[Parameter]) -> tuple[np.ndarray, np.ndarray]:
        scale = self.model.scale_s
        lower = [math.log(p.lower) if p.is_log else p.lower / scale for p in params]
        upper = [math.log(p.upper) if p.is_log else p.upper / scale for p in params]
        return np.array(lower), np.array(upper)

    def jacobian(self, params: list[Parameter], x: np.ndarray, r: np.ndarray) -> np.ndarray:
        lower, upper = self.bounds(params)
        return jacobian(lambda y: self.residuals(params, y), x, r, lower, upper)

    def solve(self, params: list[Parameter], x0: np.ndarray) -> np.ndarray:
        lower, upper = self.bounds(params)
        return least_squares(lambda y: self.residuals(params, y), x0, lower, upper)


def fit_runs(model: RunModel, candidates: list[Parameter], rows: list[int] | None = None) -> Fit:
    """Choose and fit inputs to ``rows`` of ``model`` (all by default)."""
    rows = list(range(len(model.planned))) if rows is None else rows
    problem = _Problem(model, rows)
    x = problem.start(candidates)
    r = problem.residuals(candidates, x)
    jac = problem.jacobian(candidates, x, r)
    exercised = [p for j, p in enumerate(candidates) if np.max(np.abs(jac[:, j])) > SENSITIVITY]
    best = _stepwise(problem, candidates, _State([], np.zeros(0), r, float(r @ r)))
    for floor in [p for p in candidates if p.is_floor and not best.exact(len(rows))]:
        forced = _forced(problem, floor, r)
        if forced is not None:
            branch = _stepwise(problem, candidates, forced)
            if branch.mean_square(len(rows)) < best.mean_square(len(rows)):
                best = branch
    chosen, x_chosen = best.chosen, best.x
    moved = np.abs(x_chosen - problem.start(chosen)) > UNCHANGED
    kept = [p for p, keep in zip(chosen, moved, strict=True) if keep]
    return Fit(problem.values(kept, x_chosen[moved]), tuple(exercised))


@dataclass(frozen=True)
class _State:
    """The inputs chosen so far, their coordinates, the residuals and their sum of squares."""

    chosen: list[Parameter]
    x: np.ndarray
    r: np.ndarray
    loss: float

    def mean_square(self, runs: int) -> float:
        """The residual mean square: the error per remaining degree of freedom."""
        return self.loss / max(1, runs - len(self.chosen))

    def exact(self, runs: int) -> bool:
        """Nothing left to explain."""
        return math.sqrt(self.loss / runs) <= EXACT


def _stepwise(problem: _Problem, candidates: list[Parameter], state: _State) -> _State:
    """Forward stepwise selection from ``state``: enter the best candidate while it passes
    F-to-enter, dropping the inputs later ones make unnecessary."""
    rows = len(problem.rows)
    chosen, x_chosen, r, loss = state.chosen, state.x, state.r, state.loss
    for _ in range(MAX_STEPS):
        if len(chosen) >= rows // 2 or _State(chosen, x_chosen, r, loss).exact(rows):
            break
        entry = _best_entry(problem, chosen, x_chosen, [p for p in candidates if p not in chosen], r)
        if entry is None:
            break
        best, x_best = entry
        trial = [*chosen, best]
        x_trial = problem.solve(trial, np.append(x_chosen, x_best))
        r_trial = problem.residuals(trial, x_trial)
        trial_loss = float(r_trial @ r_trial)
        if not _enters(loss, trial_loss, rows - len(trial)):
            break
        chosen, x_chosen, r, loss = _backward(problem, trial, x_trial, r_trial, trial_loss)
    return _State(chosen, x_chosen, r, loss)


def _forced(problem: _Problem, floor: Parameter, r: np.ndarray) -> _State | None:
    """``floor`` alone, fitted from its best probe; ``None`` if it explains nothing."""
    if len(problem.rows) < 2:
        return None
    entry = _floor_entry(problem, [], np.zeros(0), floor, r)
    if entry is None:
        return None
    x = problem.solve([floor], np.array([entry[2]]))
    r_floor = problem.residuals([floor], x)
    return _State([floor], x, r_floor, float(r_floor @ r_floor))


def _best_entry(problem: _Problem, chosen: list[Parameter], x_chosen: np.ndarray,
                others: list[Parameter], r: np.ndarray) -> tuple[Parameter, float] | None:
    """The candidate that best explains ``r`` (its derivative orthogonal to the chosen
    ones', or a floor's best probe), and the coordinate its fit starts from."""
    smooth = [p for p in others if not p.is_floor]
    scored = [_smooth_entry(problem, chosen, x_chosen, smooth, r)]
    scored += [_floor_entry(problem, chosen, x_chosen, p, r) for p in others if p.is_floor]
    found = [s for s in scored if s is not None]
    if not found:
        return None
    _, param, x_start = max(found, key=lambda s: s[0])
    return param, x_start


Scored = tuple[float, Parameter, float]  # drop in squared error, candidate, its start coordinate


def _smooth_entry(problem: _Problem, chosen: list[Parameter], x_chosen: np.ndarray,
                  others: list[Parameter], r: np.ndarray) -> Scored | None:
    """The candidate whose derivative, orthogonal to the chosen ones', best explains ``r``
    (scored by the linearised drop in squared error)."""
    if not others:
        return None
    params = [*chosen, *others]
    x = np.append(x_chosen, problem.start(others))
    jac = problem.jacobian(params, x, r)
    basis = np.linalg.qr(jac[:, :len(chosen)])[0] if chosen else np.zeros((len(r), 0))
    lower, upper = problem.bounds(params)
    best, best_score = None, 0.0
    for j in range(len(chosen), len(params)):
        column = jac[:, j]
        q = column - basis @ (basis.T @ column)
        if np.linalg.norm(q) <= COLLINEAR * np.linalg.norm(column):
            continue
        step = -float(q @ r) / float(q @ q)
        if (step < 0 and x[j] <= lower[j] + 1e-12) or (step > 0 and x[j] >= upper[j] - 1e-12):
            continue
        score = float(q @ r) ** 2 / float(q @ q)
        if score > best_score:
            best, best_score = params[j], score
    return None if best is None else (best_score, best, float(x[params.index(best)]))


def _floor_entry(problem: _Problem, chosen: list[Parameter], x_chosen: np.ndarray,
                 floor: Parameter, r: np.ndarray) -> Scored | None:
    """A floor's best value on a log grid over its range, the chosen inputs held, scored by
    the drop in squared error it gives; ``None`` if no value lowers the error."""
    lower, upper = problem.bounds([floor])
    count = max(2, math.ceil((upper[0] - lower[0]) / math.log(10) * PROBES_PER_DECADE) + 1)
    params = [*chosen, floor]
    loss = float(r @ r)
    best, best_loss = None, loss
    for x_floor in np.linspace(lower[0], upper[0], count):
        probe = problem.residuals(params, np.append(x_chosen, x_floor))
        probe_loss = float(probe @ probe)
        if probe_loss < best_loss:
            best, best_loss = float(x_floor), probe_loss
    return None if best is None else (loss - best_loss, floor, best)


def _backward(problem: _Problem, chosen: list[Parameter], x: np.ndarray, r: np.ndarray,
              loss: float) -> tuple[list[Parameter], np.ndarray, np.ndarray, float]:
    """Drop an earlier input the later ones make unnecessary (its F-to-remove below
    :data:`F_TO_REMOVE`), refitting the rest from where they are; again until none. Only
    inputs whose linearised F-to-remove is small are refitted without (a refit is costly)."""
    for j in _removal_suspects(problem, chosen, x, r, loss):
        rest = chosen[:j] + chosen[j + 1:]
        x_rest = problem.solve(rest, np.delete(x, j))
        r_rest = problem.residuals(rest, x_rest)
        rest_loss = float(r_rest @ r_rest)
        if _removes(loss, rest_loss, len(problem.rows) - len(chosen)):
            return _backward(problem, rest, x_rest, r_rest, rest_loss)
    return chosen, x, r, loss


def _removal_suspects(problem: _Problem, chosen: list[Parameter], x: np.ndarray, r: np.ndarray,
                      loss: float) -> list[int]:
    """Earlier inputs whose removal the linearisation says costs little: moving one back to
    its start, the others adjusting, adds (its move x its derivative orthogonal to theirs)^2."""
    if len(chosen) < 2:
        return []
    jac = problem.jacobian(chosen, x, r)
    moves = x - problem.start(chosen)
    dof = len(problem.rows) - len(chosen)
    suspects = []
    for j in range(len(chosen) - 1):
        others = np.delete(jac, j, axis=1)
        basis = np.linalg.qr(others)[0]
        q = jac[:, j] - basis @ (basis.T @ jac[:, j])
        added = moves[j] ** 2 * float(q @ q)
        if loss <= 0 or added / (loss / dof) < SUSPECT * F_TO_REMOVE:
            suspects.append(j)
    return suspects


def _removes(loss: float, without_loss: float, dof: int) -> bool:
    """F-to-remove: what an input adds against the error per degree of freedom."""
    if without_loss <= loss:
        return True
    return loss > 0 and (without_loss - loss) / (loss / dof) < F_TO_REMOVE


def _enters(loss: float, new_loss: float, dof: int) -> bool:
    """F-to-enter: the drop in squared error against the error left per degree of freedom."""
    if dof < 1 or new_loss >= loss:
        return False
    return new_loss <= 0 or (loss - new_loss) / (new_loss / dof) >= F_TO_ENTER


def loo_predictions(model: RunModel, candidates: list[Parameter],
                    done: Callable[[int], None] | None = None) -> list[float]:
    """Each run predicted by a fit (choice of inputs included) made without it; ``done(i)``
    after run ``i``'s."""
    def fit_and_predict(rows: list[int], left_out: int) -> float:
        return float(model.predict(fit_runs(model, candidates, rows).values, [left_out])[0])
    return leave_one_out(len(model.planned), fit_and_predict, done)
