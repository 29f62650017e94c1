"""One-dimensional fits: the input value at which a monotone prediction meets a measurement."""

from __future__ import annotations

import math
from collections.abc import Callable

STEPS = 50


def log_bisect(value_of: Callable[[float], float], target: float, low: float, high: float, *,
               increasing: bool = True) -> float:
    """The ``x`` in ``[low, high]`` (bisected on a log scale) where the monotone
    ``value_of(x)`` crosses ``target``; the caller checks that it does."""
    for _ in range(STEPS):
        middle = math.sqrt(low * high)
        below = value_of(middle) < target
        low, high = (middle, high) if below == increasing else (low, middle)
    return math.sqrt(low * high)
