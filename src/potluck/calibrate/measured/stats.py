"""Error figures over measured runs: mean absolute percentage error, Spearman's rank
correlation, and cross-validated (leave-one-out, or k-fold) predictions."""

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


def cross_validated(count: int, folds: int,
                    fit_and_predict: Callable[[list[int], list[int]], Sequence[float]]
                    ) -> list[float]:
    """Each of ``count`` rows predicted by ``fit_and_predict(other rows, left-out rows)``, the
    rows left out ``folds`` at a time: rows ``i, i + folds, i + 2 folds, ...`` together
    (``folds == count``: leave-one-out)."""
    predictions = [0.0] * count
    for fold in range(folds):
        left = list(range(fold, count, folds))
        rest = [i for i in range(count) if i % folds != fold]
        for i, value in zip(left, fit_and_predict(rest, left), strict=True):
            predictions[i] = float(value)
    return predictions
