"""Comparing a predicted trace with a measured one, per op kind and per stage."""

from __future__ import annotations

from dataclasses import replace

import pytest
from rich.console import Console
from simkit import cluster, flat_model, make_plan

from potluck.errors import ConfigError
from potluck.sim import simulate
from potluck.sim.compare import (
    OpComparison,
    TraceComparison,
    compare_traces,
    error_text,
    render_comparison,
    step_time_s,
)
from potluck.sim.trace import simulation_trace
from potluck.traces import Trace, read_trace, write_trace


@pytest.fixture(scope="module")
def predicted() -> Trace:
    return simulation_trace(simulate(make_plan(cluster(), flat_model(8), pp=2, micro_batches=4,
                                               tp=2)))


def _measured(trace: Trace, stretch: dict[str, float], steps: int = 3) -> Trace:
    """The same events over ``steps`` steps, each op kind slowed by its factor."""
    events, step_s = [], step_time_s(trace)
    for step in range(steps):
        for e in trace.events:
            factor = stretch.get(e.kind, 1.0)
            events.append(replace(e, start_s=e.start_s * factor + step * 2 * step_s,
                                  duration_s=e.duration_s * factor, step=step))
    return Trace(trace.devices, events, metadata={"source": "runtime"})


def test_identical_traces_have_no_error(predicted: Trace) -> None:
    comparison = compare_traces(predicted, predicted)
    assert comparison.step_error == 0.0
    assert all(c.error == pytest.approx(0.0) for c in comparison.by_kind + comparison.by_stage)


def test_errors_per_op_kind_and_stage(predicted: Trace, tmp_path) -> None:
    path = tmp_path / "measured.json"
    write_trace(_measured(predicted, {"backward": 1.25}), path)
    comparison = compare_traces(predicted, read_trace(path))
    errors = {c.kind: c.error for c in comparison.by_kind}
    assert errors["backward"] == pytest.approx(1 / 1.25 - 1)  # predicted 20% too fast
    assert errors["forward"] == pytest.approx(0.0)
    stages = {(c.stage, c.kind) for c in comparison.by_stage}
    assert {(0, "forward"), (1, "forward"), (0, "backward"), (1, "backward")} <= stages
    assert comparison.measured_step_s > comparison.predicted_step_s


def test_the_first_of_several_steps_is_left_out_as_warm_up(predicted: Trace) -> None:
    measured = _measured(predicted, {})
    warm_up = [replace(e, duration_s=10 * e.duration_s) for e in measured.events if e.step == 0]
    measured.events = warm_up + [e for e in measured.events if e.step > 0]
    assert step_time_s(measured) == pytest.approx(step_time_s(predicted))


def test_traces_of_different_plans_do_not_compare(predicted: Trace) -> None:
    other = Trace(["elsewhere:0"], [], {})
    with pytest.raises(ConfigError, match="different devices"):
        compare_traces(predicted, other)


def test_cli_compare_json(predicted: Trace, tmp_path) -> None:
    import json

    from typer.testing import CliRunner

    from potluck.cli import app

    write_trace(predicted, tmp_path / "predicted.json")
    write_trace(_measured(predicted, {"forward": 2.0}), tmp_path / "measured.json")
    ran = CliRunner().invoke(app, ["compare", str(tmp_path / "predicted.json"),
                                   str(tmp_path / "measured.json"), "--json"])
    assert ran.exit_code == 0, ran.output
    errors = {row["kind"]: row["error"] for row in json.loads(ran.stdout)["by_kind"]}
    assert errors["forward"] == pytest.approx(-0.5)


def test_an_op_one_side_does_not_have_is_not_comparable_rather_than_minus_100_percent():
    """A gradient all-reduce the backward hides entirely is predicted at 0 s; the run still
    measures microseconds of waiting. No ratio says how far apart those are."""
    hidden = OpComparison("dp_allreduce", -1, -1, predicted_s=0.0, measured_s=1.2e-6)
    assert hidden.error is None and error_text(hidden.error) == "n/c"
    assert OpComparison("forward", -1, -1, 1.1, 1.0).error == pytest.approx(0.1)
    comparison = TraceComparison(1.0, 1.0, (hidden,), (hidden,))
    console = Console(record=True, width=120)
    render_comparison(console, comparison)
    text = console.export_text()
    assert "n/c" in text and "-100.0%" not in text and "n/c: not comparable" in text
    assert comparison.as_dict()["by_kind"][0]["error"] is None
