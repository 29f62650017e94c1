"""Predicted against measured for one run: the plan's simulated iteration against its trace.

The prediction is the simulator's trace of the plan (every op's duration from
the cost model, in the runtime's schedule order) plus the cost model's own
step time; the measurement is the run's trace in device seconds
(:mod:`potluck.calibrate.run`). :func:`write_traces` leaves the predicted trace
and one trace with both timelines (predicted devices above measured ones)
next to each other for Perfetto.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from potluck.calibrate.run import RunRecord, device_seconds, load_run, record_of
from potluck.errors import ConfigError
from potluck.planner.evaluate import predict
from potluck.plans import Plan, load_plan
from potluck.sim import simulate
from potluck.sim.compare import TraceComparison, compare_traces, side_by_side
from potluck.sim.trace import simulation_trace
from potluck.traces import Trace, read_trace, write_trace

PREDICTED_FILE = "predicted.json"
SIDE_BY_SIDE_FILE = "side_by_side.json"


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
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
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
    path = Path(out_dir) / SIDE_BY_SIDE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    write_trace(side_by_side(predicted, measured), path)
    return comparison, [path]


def _is_trace(path: Path) -> bool:
    """Whether a file is a Chrome trace (rather than a plan)."""
    if not path.is_file():
        raise ConfigError(f"{str(path)!r} not found: give a run directory, a plan file or a trace")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}:{err.lineno}: malformed JSON: {err.msg}") from None
    return isinstance(data, dict) and "traceEvents" in data
