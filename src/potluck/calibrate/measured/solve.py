"""Bounded nonlinear least squares: Levenberg-Marquardt with forward-difference Jacobians,
each step clipped to the bounds (Nocedal & Wright, *Numerical Optimization*, 2nd ed.,
sec. 10.3; Marquardt's scaling by the diagonal of J^T J makes the steps independent of
each coordinate's unit). A coordinate at a bound that the gradient pushes outward is held
there for the step (an active-set rule, N&W sec. 16.7): a clipped step would not move it,
and raising the damping until the others' step gets small enough costs a dozen tries. A
few parameters and a few dozen residuals: no need for scipy.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

Residuals = Callable[[np.ndarray], np.ndarray]

FD_STEP = 1e-4  # forward-difference step, in the solver's coordinates
MAX_ITERATIONS = 30
TOLERANCE = 1e-4  # stop when a step lowers the sum of squares by less than this, relatively,
STEP_TOLERANCE = 1e-7  # or when the damped step moves no coordinate by more than this


def jacobian(residuals: Residuals, x: np.ndarray, r: np.ndarray, lower: np.ndarray,
             upper: np.ndarray) -> np.ndarray:
    """d residuals / d x by forward differences, stepping inward at an upper bound."""
    columns = []
    for j in range(len(x)):
        step = FD_STEP if x[j] + FD_STEP <= upper[j] else -FD_STEP
        moved = x.copy()
        moved[j] += step
        columns.append((residuals(moved) - r) / step)
    return np.column_stack(columns) if columns else np.zeros((len(r), 0))


def least_squares(residuals: Residuals, x0: np.ndarray, lower: np.ndarray,
                  upper: np.ndarray) -> np.ndarray:
    """The ``x`` within ``[lower, upper]`` (from ``x0``) minimising ``sum(residuals(x)**2)``;
    never worse than ``x0``."""
    x = np.clip(np.asarray(x0, dtype=float), lower, upper)
    r = residuals(x)
    loss = float(r @ r)
    damping = 1e-3
    for _ in range(MAX_ITERATIONS):
        jac = jacobian(residuals, x, r, lower, upper)
        free = _free(x, jac.T @ r, lower, upper)
        if not free.any():
            return x
        normal, gradient = jac[:, free].T @ jac[:, free], jac[:, free].T @ r
        scale = np.diag(normal) + 1e-12
        while damping < 1e10:
            step = np.zeros_like(x)
            step[free] = np.linalg.solve(normal + damping * np.diag(scale), -gradient)
            trial = np.clip(x + step, lower, upper)
            if np.max(np.abs(trial - x)) < STEP_TOLERANCE:
                return x
            trial_r = residuals(trial)
            trial_loss = float(trial_r @ trial_r)
            if trial_loss < loss:
                break
            damping *= 4.0
        else:
            return x
        gained = loss - trial_loss
        x, r, loss = trial, trial_r, trial_loss
        damping = max(damping / 3.0, 1e-9)
        if gained <= TOLERANCE * max(loss, 1e-300) or loss < 1e-24:
            return x
    return x


def _free(x: np.ndarray, gradient: np.ndarray, lower: np.ndarray, upper: np.ndarray) -> np.ndarray:
    """The coordinates a descent step may move: not at a bound the gradient pushes against."""
    return ~(((x <= lower) & (gradient > 0)) | ((x >= upper) & (gradient < 0)))
