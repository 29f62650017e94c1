"""Error figures over measured runs: mean absolute percentage error, Spearman's rank
correlation, and leave-one-out predictions."""

from __future__ import annotations

from collections.abc import Callable, Sequence


def errors(predicted: Sequence[float], measured: Sequence[float]) -> list[float]:
    """Signed relative error of each prediction: (predicted - measured) / measured."""
    return [(p - m) / m for p, m in zip(predicted, measured, strict=True)]


def mape(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Mean absolute percentage error, as a fraction."""
    found = errors(predicted, measured)
    return sum(abs(e) for e in found) / len(found)


def ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    result = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for k in range(start, end + 1):
            result[order[k]] = (start + end) / 2 + 1
        start = end + 1
    return result


def spearman(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Spearman's rank correlation: Pearson's correlation of the ranks (Spearman 1904);
    ``None`` when fewer than two values or either side is constant."""
    if len(a) < 2:
        return None
    ra, rb = ranks(a), ranks(b)
    mean_a, mean_b = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - mean_a) * (y - mean_b) for x, y in zip(ra, rb, strict=True))
    var_a = sum((x - mean_a) ** 2 for x in ra)
    var_b = sum((y - mean_b) ** 2 for y in rb)
    if var_a == 0 or var_b == 0:
        return None
    return cov / (var_a * var_b) ** 0.5


def leave_one_out(count: int, fit_and_predict: Callable[[list[int], int], float],
                  done: Callable[[int], None] | None = None) -> list[float]:
    """For each row ``i``, ``fit_and_predict(other rows, i)``: row ``i`` predicted by a fit
    that never saw it; ``done(i)`` after each."""
    predictions = []
    for i in range(count):
        predictions.append(fit_and_predict([k for k in range(count) if k != i], i))
        if done is not None:
            done(i)
    return predictions
