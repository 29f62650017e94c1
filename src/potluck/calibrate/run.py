"""A traced training run as calibration reads it: its plan and its measured trace.

``potluck train --trace --out DIR`` leaves ``DIR/plan.json`` and
``DIR/trace.json``. :func:`load_run` reads both (one-line errors when either
is missing) and returns the measured trace in the *devices'* seconds: an
emulated run's ops were stretched by the emulation's dilation, so their
durations are divided by it (the trace records the dilation). Predicted and
measured can then be compared op by op, and calibration fits the cost
model's inputs to device time.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from potluck.errors import ConfigError
from potluck.plans import Plan, load_plan
from potluck.traces import Trace, read_trace

PLAN_FILE = "plan.json"
TRACE_FILE = "trace.json"


@dataclass(frozen=True)
class RunRecord:
    """A run's plan and its measured trace in device seconds."""

    run_dir: Path
    plan: Plan
    measured: Trace
    dilation: float | None  # an emulated run's time stretch (already divided out)


def load_run(run_dir: str | Path, trace: str | Path | None = None) -> RunRecord:
    """The plan and trace of a ``potluck train --trace --out RUN_DIR`` run."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"run directory {str(run_dir)!r} not found; give the --out DIR of "
                          "potluck train --trace")
    if not (run_dir / PLAN_FILE).is_file():
        raise ConfigError(f"{run_dir} has no {PLAN_FILE}: not a run directory of potluck train --out")
    trace_path = Path(trace) if trace is not None else run_dir / TRACE_FILE
    if trace is None and not trace_path.is_file():
        raise ConfigError(f"{run_dir} has no {TRACE_FILE}: train with --trace "
                          f"(potluck train ... --trace --out {run_dir})")
    return record_of(load_plan(run_dir / PLAN_FILE), read_trace(trace_path), run_dir)


def record_of(plan: Plan, trace: Trace, run_dir: str | Path = ".") -> RunRecord:
    """A record from a plan and a measured trace of it (checked to belong together)."""
    if trace.metadata.get("source") != "runtime":
        raise ConfigError("the measured trace is not from potluck train --trace (its source is "
                          f"{trace.metadata.get('source', 'unknown')!r})")
    if sorted(trace.devices) != sorted(plan.devices):
        raise ConfigError("the trace's devices are not the plan's: compare a run with its own plan")
    if not trace.events:
        raise ConfigError("the measured trace has no events; trace more steps (--trace-steps)")
    dilation = trace.metadata.get("dilation")
    return RunRecord(Path(run_dir), plan, device_seconds(trace, dilation), dilation)


def device_seconds(trace: Trace, dilation: float | None) -> Trace:
    """``trace`` with every time divided by ``dilation`` (unchanged without one)."""
    if not dilation:
        return trace
    events = [replace(e, start_s=e.start_s / dilation, duration_s=e.duration_s / dilation)
              for e in trace.events]
    return replace(trace, events=events)
