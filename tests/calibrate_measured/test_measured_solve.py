"""The bounded Levenberg-Marquardt solver of measured-runs fits, on small problems whose
optimum is known."""

from __future__ import annotations

import numpy as np

from potluck.calibrate.measured.solve import least_squares


def test_the_solver_holds_a_coordinate_the_gradient_pushes_out_of_its_bounds() -> None:
    """x0 wants 3, above its upper bound 1: it stays at 1 while x1 is solved for, in a few
    evaluations (a clipped step that cannot move x0 used to raise the damping a dozen times
    per step, and stop short of x1's optimum)."""
    calls = []

    def coupled(x: np.ndarray) -> np.ndarray:
        calls.append(x)
        return np.array([x[0] - 3.0, (x[1] - 0.5) * (1 + x[0]), np.sin(x[1]) - 0.45])

    lower, upper = np.array([-1.0, -1.0]), np.array([1.0, 1.0])
    x = least_squares(coupled, np.zeros(2), lower, upper)
    assert x[0] == 1.0 and len(calls) <= 20  # 94 before

    def curved(x: np.ndarray) -> np.ndarray:
        return np.array([np.exp(x[0]) - 20.0, np.exp(x[1]) - 1.5, x[1] * x[0] - 0.3])

    x = least_squares(curved, np.zeros(2), lower, upper)
    slope = (np.exp(x[1]) - 1.5) * np.exp(x[1]) + (x[1] - 0.3)  # d/dx1 of half the squares at x0 = 1
    assert x[0] == 1.0 and abs(slope) < 1e-3  # it stopped at x1 = 0.30 before (slope -0.19)
