"""Predicted against measured: two traces of the same plan, per stage and per op kind.

Either trace may come from the simulator or the runtime (:mod:`potluck.traces`).
The *step time* of a trace is the span of its events in one step, the median
over its steps (the first one left out when there are several: it warms up;
the median, so that a step another process slowed down does not skew it).
Op durations are averaged per (pipeline, stage, kind) and per kind over all
devices (the devices of a tensor-parallel group run the same ops). The error
is ``predicted / measured - 1``: positive when the prediction is too slow; none (``n/c``,
not comparable) where either side is zero.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Any

from rich.console import Console

from potluck.errors import ConfigError
from potluck.tables import compact_table
from potluck.traces import Trace, TraceEvent


@dataclass(frozen=True)
class OpComparison:
    """Mean duration of one kind of op (on one stage, or everywhere) in both traces."""

    kind: str
    pipeline: int  # -1: all pipelines
    stage: int  # -1: all stages
    predicted_s: float
    measured_s: float

    @property
    def error(self) -> float | None:
        """Predicted over measured, minus one; None where the two are not comparable: one of
        them is zero (nothing predicted, or nothing measured: no ratio says how far apart)."""
        if self.predicted_s <= 0 or self.measured_s <= 0:
            return None
        return self.predicted_s / self.measured_s - 1.0


def error_text(error: float | None) -> str:
    """An error for a table: ``+12.3%``, or ``n/c`` (not comparable)."""
    return "n/c" if error is None else f"{error:+.1%}"


@dataclass(frozen=True)
class TraceComparison:
    predicted_step_s: float
    measured_step_s: float
    by_kind: tuple[OpComparison, ...]
    by_stage: tuple[OpComparison, ...]
    cost_model_step_s: float | None = None  # the cost model's own step time, when known

    @property
    def step_error(self) -> float:
        return self.predicted_step_s / self.measured_step_s - 1.0

    @property
    def cost_model_error(self) -> float | None:
        if self.cost_model_step_s is None:
            return None
        return self.cost_model_step_s / self.measured_step_s - 1.0

    def as_dict(self) -> dict[str, Any]:
        def row(c: OpComparison) -> dict[str, Any]:
            return {"kind": c.kind, "pipeline": c.pipeline, "stage": c.stage,
                    "predicted_s": c.predicted_s, "measured_s": c.measured_s, "error": c.error}

        return {"predicted_step_s": self.predicted_step_s, "measured_step_s": self.measured_step_s,
                "step_error": self.step_error, "cost_model_step_s": self.cost_model_step_s,
                "cost_model_error": self.cost_model_error,
                "by_kind": [row(c) for c in self.by_kind],
                "by_stage": [row(c) for c in self.by_stage]}


def step_time_s(trace: Trace) -> float:
    """Median span of one step's events (the first step left out when there are several)."""
    spans: dict[int, list[float]] = defaultdict(lambda: [float("inf"), float("-inf")])
    for event in trace.events:
        span = spans[event.step]
        span[0], span[1] = min(span[0], event.start_s), max(span[1], event.end_s)
    if not spans:
        raise ConfigError("the trace has no events")
    steps = sorted(spans)
    kept = steps[1:] if len(steps) > 1 else steps
    return statistics.median(spans[s][1] - spans[s][0] for s in kept)


def _mean_durations(events: list[TraceEvent], by_stage: bool) -> dict[tuple, float]:
    found: dict[tuple, list[float]] = defaultdict(list)
    for event in events:
        key = (event.kind, event.pipeline, event.stage) if by_stage else (event.kind, -1, -1)
        found[key].append(event.duration_s)
    return {key: statistics.fmean(values) for key, values in found.items()}


def compare_traces(predicted: Trace, measured: Trace) -> TraceComparison:
    """Step time and mean op durations of ``predicted`` against ``measured``."""
    if sorted(predicted.devices) != sorted(measured.devices):
        raise ConfigError("the two traces are of different devices; compare traces of one plan")
    tables = []
    for by_stage in (False, True):
        ours = _mean_durations(predicted.events, by_stage)
        theirs = _mean_durations(measured.events, by_stage)
        tables.append(tuple(
            OpComparison(kind, pipeline, stage, ours[(kind, pipeline, stage)],
                         theirs[(kind, pipeline, stage)])
            for kind, pipeline, stage in sorted(ours.keys() & theirs.keys(),
                                                key=lambda k: (k[1], k[2], k[0]))
        ))
    return TraceComparison(step_time_s(predicted), step_time_s(measured), tables[0], tables[1])


def side_by_side(predicted: Trace, measured: Trace) -> Trace:
    """One trace with the predicted devices above the measured ones (``predicted <id>``,
    ``measured <id>``), both starting at 0: opens side by side in Perfetto."""
    steps = sorted({e.step for e in measured.events})
    kept = set(steps[1:] if len(steps) > 1 else steps)
    shown = [e for e in measured.events if e.step in kept]
    origin_s = min((e.start_s for e in shown), default=0.0)
    return Trace(
        [f"predicted {d}" for d in predicted.devices] + [f"measured {d}" for d in measured.devices],
        [replace(e, device=f"predicted {e.device}") for e in predicted.events]
        + [replace(e, device=f"measured {e.device}", start_s=e.start_s - origin_s) for e in shown],
        metadata={"source": "comparison"},
    )


def render_comparison(console: Console, comparison: TraceComparison) -> None:
    console.print(f"step time: predicted {comparison.predicted_step_s:.4g} s, measured "
                  f"{comparison.measured_step_s:.4g} s, error {comparison.step_error:+.1%}")
    if comparison.cost_model_step_s is not None:
        console.print(f"cost model: {comparison.cost_model_step_s:.4g} s, error "
                      f"{comparison.cost_model_error:+.1%}")
    for title, rows in (("per op kind", comparison.by_kind), ("per stage", comparison.by_stage)):
        table = compact_table(title, ("pipeline", "stage", "op", "predicted ms", "measured ms",
                                      "error"), left=("op",))
        for c in rows:
            table.add_row("all" if c.pipeline < 0 else str(c.pipeline),
                          "all" if c.stage < 0 else str(c.stage), c.kind,
                          f"{c.predicted_s * 1e3:.4g}", f"{c.measured_s * 1e3:.4g}",
                          error_text(c.error))
        console.print(table)
    if any(c.error is None for c in comparison.by_kind + comparison.by_stage):
        console.print("n/c: not comparable, one side is zero (a gradient all-reduce the "
                      "backward hides entirely, say).", highlight=False)
    if any(c.kind.startswith(("send_", "recv_")) for c in comparison.by_kind):
        console.print("A measured send or receive is the time the rank waited for it (the bubble "
                      "and the peer's lateness included); a predicted one is the transfer alone.",
                      highlight=False)
