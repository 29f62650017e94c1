"""Which inputs a measured-runs fit changes: the set whose fit best predicts runs it did
not see.

Sets tried: none (the cluster file as it is); each input the runs depend on, alone; each
pair of them whose derivatives the runs tell apart (one not within :data:`COLLINEAR` of
the other's direction at the start: two inputs that move every run alike cannot be
fitted together); then, from the best pair, one more input at a time while that lowers
the held-out error by :data:`SIGNIFICANT` (forward selection scored by
cross-validation: Hastie, Tibshirani & Friedman, *The Elements of Statistical
Learning*, 2nd ed., secs. 3.3.2 and 7.10), up to half as many inputs as runs and two
fewer than the runs (so that a fit without one run keeps a degree of freedom).

The held-out error of a set is the mean absolute percentage error of each run predicted
by the set fitted to the other runs: leave-one-out (ESL sec. 7.10.1), or, with more than
:data:`MAX_FOLDS` runs, that many folds (runs ``i, i + F, i + 2F, ...`` left out
together). The empty set's is the cluster file's own error on the runs.

The choice: a set is a candidate only if it predicts held-out runs significantly better
than the cluster file (the empty set): its held-out error lower by more than
:data:`SIGNIFICANT` and by more than :func:`t_95` standard errors of the difference, run
by run (a one-sided paired t-test at the 5% level: 2.35 standard errors over 4 runs,
2.02 over 6). With no candidate, the selection chooses nothing and ``calibrate``
refuses. Of the candidates, the simplest whose held-out error is within the noise of the
lowest (at most one standard error, or :data:`SIGNIFICANT`, above it: the
one-standard-error rule of Breiman, Friedman, Olshen & Stone, *Classification and
Regression Trees*, 1984, sec. 3.4.3; ESL sec. 7.10): the fewest inputs, then the fewest
host times (the per-micro-batch, per-iteration and per-block overheads are bounded only by
the runs' own times, while an efficiency and a bandwidth are bounded by the hardware's
peak and rated speed), then the lowest error. (On 20 seeds of 3% noise around the cluster
file's own predictions, no fit was kept over 4 runs, one over 6.) The choice sees every
run, so the chosen set's held-out error is a little optimistic; the validation benchmark
checks runs the fit never saw.

With fewer than :data:`MIN_HELD_OUT` runs, one run left out leaves a single run to fit,
which any one input explains exactly: the held-out error cannot tell a right input from
a lucky one. Then (the fallback rule) the one input whose fit on both runs has the
lowest error is chosen, with no held-out check (``calibrate`` still refuses a fit that
does not lower the runs' own error); the held-out predictions are still reported.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from potluck.calibrate.measured.fit import RunModel, derivatives, exercised, fit_terms
from potluck.calibrate.measured.params import Parameter, Values
from potluck.calibrate.measured.stats import cross_validated, mape
from potluck.calibrate.measured.stats import errors as relative_errors

SIGNIFICANT = 0.005  # held-out MAPE: a difference below half a percentage point is noise
COLLINEAR = 0.05  # |orthogonal part| / |derivative| at or below this: the same direction
MAX_FOLDS = 10  # more runs than this: 10-fold cross-validation (ESL sec. 7.10.1)
MIN_HELD_OUT = 3  # fewer runs: the fallback rule (one input, no held-out check)
T_95 = (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812,  # 1-10 dof
        1.796, 1.782, 1.771, 1.761, 1.753, 1.746, 1.740, 1.734, 1.729, 1.725,
        1.721, 1.717, 1.714, 1.711, 1.708, 1.706, 1.703, 1.701, 1.699, 1.697)  # 11-30

Progress = Callable[[float, str], None]  # (fraction done, what it is doing)


@dataclass(frozen=True)
class Scored:
    """A set of inputs, its fit on every run, and each run predicted by a fit without it."""

    terms: tuple[Parameter, ...]
    values: Values  # fitted to every run
    in_sample_s: tuple[float, ...]  # every run predicted with ``values``
    held_out_s: tuple[float, ...]  # each run predicted by the set fitted without it

    def names(self) -> str:
        return " + ".join(p.name for p in self.terms) or "none"


@dataclass(frozen=True)
class Selection:
    """The set chosen, every set scored (the empty set first) and how they were scored."""

    chosen: Scored
    tried: tuple[Scored, ...]
    pool: tuple[Parameter, ...]  # the inputs the runs depend on (the sets are made of them)
    measured_s: tuple[float, ...]
    folds: int  # held-out groups of runs; 0 below MIN_HELD_OUT runs (the fallback rule)

    def held_out_mape(self, scored: Scored) -> float:
        return mape(scored.held_out_s, self.measured_s)

    @property
    def uncalibrated_mape(self) -> float:
        return self.held_out_mape(self.tried[0])

    def best_fitted(self) -> Scored | None:
        """The non-empty set with the lowest held-out error (``None``: no input to fit)."""
        return min((s for s in self.tried if s.terms), key=self.held_out_mape, default=None)


def select_terms(model: RunModel, candidates: list[Parameter],
                 progress: Progress | None = None) -> Selection:
    """Score sets of ``candidates`` by held-out error and choose one, as the module says;
    ``progress(fraction, what)`` hears of each set."""
    report = progress or _silent
    count = len(model.planned)
    pool = exercised(model, candidates)
    measured = tuple(float(t) for t in model.measured_s)
    if count < MIN_HELD_OUT:
        tried = [_score(model, (), count)] + _each(
            model, [(p,) for p in pool], count, report, len(pool))
        report(1.0, f"fitted {len(tried) - 1} inputs one at a time")
        chosen = min(tried, key=lambda s: mape(s.in_sample_s, measured))
        return Selection(chosen, tuple(tried), tuple(pool), measured, 0)
    folds = min(count, MAX_FOLDS)
    limit = min(count // 2, count - 2)
    first = [(p,) for p in pool] + _pairs(model, pool) if limit >= 2 else [(p,) for p in pool]
    # growing a set of ``size`` inputs tries each input it lacks; sets stop at ``limit``
    at_most = len(first) + sum(len(pool) - size for size in range(2, min(limit, len(pool))))
    tried = [_score(model, (), folds)] + _each(model, first, folds, report, at_most)
    tried += _extend(model, pool, tried, limit, folds, report, at_most)
    report(1.0, f"scored {len(tried)} sets of inputs")
    return Selection(_choose(tried, measured), tuple(tried), tuple(pool), measured, folds)


def _each(model: RunModel, sets: list[tuple[Parameter, ...]], folds: int, report: Progress,
          at_most: int, done: int = 0) -> list[Scored]:
    scored = []
    for i, terms in enumerate(sets, done):
        report(i / max(1, at_most), f"set {i + 1} of at most {at_most}: "
                                    f"{' + '.join(p.name for p in terms)}")
        scored.append(_score(model, terms, folds))
    return scored


def _extend(model: RunModel, pool: list[Parameter], tried: list[Scored], limit: int, folds: int,
            report: Progress, at_most: int) -> list[Scored]:
    """From the best set of the largest size tried, one input more while that helps."""
    measured = model.measured_s
    added: list[Scored] = []
    size = 2
    while size < limit:
        base = min((s for s in tried + added if len(s.terms) == size),
                   key=lambda s: mape(s.held_out_s, measured), default=None)
        if base is None:
            break
        sets = [(*base.terms, p) for p in pool if p not in base.terms]
        step = _each(model, sets, folds, report, at_most, len(tried) - 1 + len(added))
        added += step
        best = min(step, key=lambda s: mape(s.held_out_s, measured), default=None)
        if best is None or (mape(best.held_out_s, measured)
                            > mape(base.held_out_s, measured) - SIGNIFICANT):
            break
        size += 1
    return added


def _pairs(model: RunModel, pool: list[Parameter]) -> list[tuple[Parameter, ...]]:
    """Pairs of ``pool`` whose derivatives are not collinear (a floor has none at the
    start: it pairs with every input)."""
    smooth = [p for p in pool if not p.is_floor]
    columns = dict(zip(smooth, derivatives(model, smooth).T, strict=True))
    pairs = []
    for a, b in itertools.combinations(pool, 2):
        if a.is_floor or b.is_floor or _distinct(columns[a], columns[b]):
            pairs.append((a, b))
    return pairs


def _distinct(a: np.ndarray, b: np.ndarray) -> bool:
    """Neither derivative within :data:`COLLINEAR` of the other's direction."""
    for u, v in ((a, b), (b, a)):
        along = u * float(u @ v) / float(u @ u) if float(u @ u) > 0 else 0 * u
        if np.linalg.norm(v - along) <= COLLINEAR * np.linalg.norm(v):
            return False
    return True


def _score(model: RunModel, terms: tuple[Parameter, ...], folds: int) -> Scored:
    """``terms`` fitted to every run, and each of ``folds`` groups of runs predicted by a
    fit without it (started from the fit on every run)."""
    values = fit_terms(model, list(terms))
    in_sample = tuple(map(float, model.predict(values)))
    if not terms:
        return Scored(terms, values, in_sample, in_sample)
    held_out = cross_validated(len(model.planned), folds, lambda rest, left: model.predict(
        fit_terms(model, list(terms), rest, values), left))
    return Scored(terms, values, in_sample, tuple(held_out))


def _choose(tried: list[Scored], measured: tuple[float, ...]) -> Scored:
    """Of the sets significantly better than none (``tried[0]``), the simplest whose held-out
    error is within the noise of the lowest; none if there is no such set."""
    better = [s for s in tried[1:] if significantly_better(s, tried[0], measured)]
    if not better:
        return tried[0]
    best = min(better, key=lambda s: mape(s.held_out_s, measured))
    close = [s for s in better if _within_noise(s, best, measured)]
    return min(close, key=lambda s: (len(s.terms), sum(not p.is_physical for p in s.terms),
                                     mape(s.held_out_s, measured)))


def _within_noise(scored: Scored, best: Scored, measured: tuple[float, ...]) -> bool:
    """``scored``'s held-out error exceeds ``best``'s by at most one standard error of the
    difference (and at most :data:`SIGNIFICANT` is always within)."""
    gap, standard_error = gain(best, scored, measured)
    # a set better on a single run only is exactly one standard error better: within
    return gap <= max(SIGNIFICANT, standard_error) * (1 + 1e-9)


def significantly_better(scored: Scored, reference: Scored, measured: Sequence[float]) -> bool:
    """``scored``'s held-out error lower than ``reference``'s by more than :data:`SIGNIFICANT`
    and by more than :func:`t_95` standard errors (a one-sided paired t-test at 5%)."""
    better, standard_error = gain(scored, reference, measured)
    return better > SIGNIFICANT and better > t_95(len(measured) - 1) * standard_error


def t_95(dof: int) -> float:
    """The one-sided 95% quantile of Student's t with ``dof`` degrees of freedom (NIST/SEMATECH
    e-Handbook of Statistical Methods, sec. 1.3.6.7.2; the normal's beyond 30)."""
    return T_95[dof - 1] if dof <= len(T_95) else 1.645


def gain(scored: Scored, reference: Scored, measured: Sequence[float]) -> tuple[float, float]:
    """How much lower ``scored``'s held-out MAPE is than ``reference``'s, and the standard
    error of that difference (of the runs' absolute errors, run by run)."""
    gaps = (np.abs(relative_errors(reference.held_out_s, measured))
            - np.abs(relative_errors(scored.held_out_s, measured)))
    return float(np.mean(gaps)), float(np.std(gaps, ddof=1)) / math.sqrt(len(gaps))


def _silent(fraction: float, what: str) -> None:
    """No progress shown."""
