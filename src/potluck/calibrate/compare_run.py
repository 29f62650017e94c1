"""Predicted against measured for one run: the plan's simulated iteration against its trace.

The prediction is the simulator's trace of the plan (every op's duration from
the cost model, in the runtime's schedule order) plus the cost model's own
step time; the measurement is the run's trace in device seconds
(:mod:`potluck.calibrate.run`). :func:`write_traces` leaves the predicted trace
and one trace with both timelines (predicted devices above measured ones)
next to each other for Perfetto.

Two run directories are compared by their step time on the devices they ran
for (:func:`compare_runs`): an emulated run's ``device_step_time_s`` from
``metrics.jsonl`` (its measured step over its own dilation), a real run's
``step_time_s``. Two emulated runs each calibrate their own dilation, so
their measured step times alone say nothing about which plan is faster.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from potluck.calibrate.run import RunRecord, device_seconds, load_run, record_of
from potluck.errors import ConfigError
from potluck.planner.evaluate import predict
from potluck.plans import Plan, load_plan
from potluck.safe_files import real_dir
from potluck.sim import simulate
from potluck.sim.compare import TraceComparison, compare_traces, side_by_side
from potluck.sim.trace import simulation_trace
from potluck.traces import Trace, read_trace, write_trace
from potluck.yamlio import MAX_LOG_BYTES, read_text

PREDICTED_FILE = "predicted.json"
SIDE_BY_SIDE_FILE = "side_by_side.json"
METRICS_FILE = "metrics.jsonl"


def predicted_trace(plan: Plan) -> Trace:
    """The simulator's trace of one iteration of ``plan``."""
    return simulation_trace(simulate(plan))


def compare_run(record: RunRecord, plan: Plan | None = None) -> TraceComparison:
    """``plan`` (default: the run's own) predicted against what the run measured."""
    plan = plan or record.plan
    comparison = compare_traces(predicted_trace(plan), record.measured)
    cost_model_s = predict(plan).iteration_time_s
    return replace(comparison, cost_model_step_s=cost_model_s)


def write_traces(record: RunRecord, out_dir: str | Path) -> list[Path]:
    """Write ``predicted.json`` and ``side_by_side.json`` into ``out_dir``."""
    out_dir = real_dir(out_dir)
    predicted = predicted_trace(record.plan)
    paths = [out_dir / PREDICTED_FILE, out_dir / SIDE_BY_SIDE_FILE]
    write_trace(predicted, paths[0])
    write_trace(side_by_side(predicted, record.measured), paths[1])
    return paths


def compare_paths(target: str | Path, measured: str | Path | None = None,
                  out_dir: str | Path | None = None) -> tuple[TraceComparison, list[Path]]:
    """``potluck compare``: ``target`` is a run directory, a plan file or a predicted trace;
    ``measured`` a runtime trace (default: the run directory's). Writes the predicted and
    side-by-side traces into ``out_dir`` (default: where the measured trace is), except
    when two traces are given without ``out_dir``."""
    target = Path(target)
    if target.is_dir():
        record = load_run(target, measured)
    elif measured is None:
        raise ConfigError(f"give the measured trace too: potluck compare {target} RUN_DIR/trace.json")
    elif _is_trace(target):
        return _compare_two_traces(read_trace(target), read_trace(measured), out_dir)
    else:
        record = record_of(load_plan(target), read_trace(measured), Path(measured).parent)
    comparison = compare_run(record)
    return comparison, write_traces(record, out_dir or (Path(measured).parent if measured
                                                        else record.run_dir))


def _compare_two_traces(predicted: Trace, measured: Trace, out_dir: str | Path | None
                        ) -> tuple[TraceComparison, list[Path]]:
    measured = device_seconds(measured, measured.metadata.get("dilation"))
    comparison = compare_traces(predicted, measured)
    if out_dir is None:
        return comparison, []
    path = real_dir(out_dir) / SIDE_BY_SIDE_FILE
    write_trace(side_by_side(predicted, measured), path)
    return comparison, [path]


def _is_trace(path: Path) -> bool:
    """Whether a file is a Chrome trace (rather than a plan)."""
    if not path.is_file():
        raise ConfigError(f"{str(path)!r} not found: give a run directory, a plan file or a trace")
    try:
        data = json.loads(read_text(path, "plan or trace", MAX_LOG_BYTES))
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}:{err.lineno}: malformed JSON: {err.msg}") from None
    return isinstance(data, dict) and "traceEvents" in data


@dataclass(frozen=True)
class RunStepTime:
    """A run's step time on its devices: the median over the later half of its steps."""

    run_dir: Path
    step_s: float
    dilation: float | None  # an emulated run's (median) time stretch; None: a real run

    def describe(self) -> str:
        where = (f"on its emulated devices (dilation {self.dilation:.3g})" if self.dilation
                 else "measured")
        return f"{self.run_dir}: {self.step_s:.4g} s per step {where}"


@dataclass(frozen=True)
class RunsComparison:
    first: RunStepTime
    second: RunStepTime

    @property
    def speedup(self) -> float:
        """How many times faster the first run's step is than the second's."""
        return self.second.step_s / self.first.step_s

    def as_dict(self) -> dict[str, Any]:
        def run(r: RunStepTime) -> dict[str, Any]:
            return {"run_dir": str(r.run_dir), "step_s": r.step_s, "dilation": r.dilation}

        return {"first": run(self.first), "second": run(self.second), "speedup": self.speedup}


def run_step_time(run_dir: str | Path) -> RunStepTime:
    """The device step time of a run directory's ``metrics.jsonl``."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise ConfigError(f"{run_dir} has no {METRICS_FILE}: give run directories of "
                          "potluck train --out DIR")
    rows = _rows(path)
    later = rows[len(rows) // 2:]  # the first steps warm up
    emulated = all("device_step_time_s" in row for row in later)
    key = "device_step_time_s" if emulated else "step_time_s"
    dilation = statistics.median(row["dilation"] for row in later) if emulated else None
    return RunStepTime(Path(run_dir), statistics.median(row[key] for row in later), dilation)


def _rows(path: Path) -> list[dict[str, Any]]:
    rows = []
    for number, line in enumerate(read_text(path, METRICS_FILE, MAX_LOG_BYTES).splitlines(), 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}:{number}: malformed JSON: {err.msg}") from None
        if not isinstance(row, dict) or "step_time_s" not in row:
            raise ConfigError(f"{path}:{number}: not a metrics row (no step_time_s)")
        rows.append(row)
    if not rows:
        raise ConfigError(f"{path} has no steps; train at least one step")
    return rows


def compare_runs(first: str | Path, second: str | Path) -> RunsComparison:
    """Two runs' step times on the devices they ran for (emulated: measured over dilation)."""
    return RunsComparison(run_step_time(first), run_step_time(second))
