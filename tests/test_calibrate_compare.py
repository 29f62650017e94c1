"""potluck compare on runs: a plan's prediction against its measured trace, per op kind and
stage, with the traces written side by side."""

from __future__ import annotations

import json

import pytest

from calibkit import CLAIMED, plan_on, synthetic_run
from potluck.calibrate.compare_run import compare_paths
from potluck.errors import ConfigError
from potluck.plans import save_plan
from potluck.sim.compare import compare_traces, step_time_s
from potluck.traces import COMM, COMPUTE, Trace, TraceEvent, read_trace, write_trace

DEVICES = ["cpu.0:0", "cpu.0:1"]


def hand_made(forward_s: float, backward_s: float, allreduce_s: float, steps: int = 1) -> Trace:
    """Two one-stage replicas: two micro-batches each, then an all-reduce and the optimizer."""
    events = []
    for step in range(steps):
        origin = 10.0 * step
        for k, device in enumerate(DEVICES):
            t = origin
            for mb in range(2):
                events.append(TraceEvent(device, COMPUTE, "forward", t, forward_s, k, 0, mb, 0, step))
                t += forward_s
                events.append(TraceEvent(device, COMPUTE, "backward", t, backward_s, k, 0, mb, 0,
                                         step))
                t += backward_s
            events.append(TraceEvent(device, COMM, "dp_allreduce", t, allreduce_s, k, 0, step=step))
            events.append(TraceEvent(device, COMPUTE, "optimizer", t + allreduce_s, 0.001, k, 0,
                                     step=step))
    return Trace(list(DEVICES), events, metadata={"source": "runtime"})


def test_per_kind_errors_on_hand_made_traces() -> None:
    comparison = compare_traces(hand_made(0.010, 0.020, 0.005), hand_made(0.0125, 0.020, 0.010))
    errors = {c.kind: c.error for c in comparison.by_kind}
    assert errors["forward"] == pytest.approx(-0.2)  # 10 ms predicted, 12.5 ms measured
    assert errors["backward"] == pytest.approx(0.0)
    assert errors["dp_allreduce"] == pytest.approx(-0.5)
    assert comparison.predicted_step_s == pytest.approx(0.066)
    assert comparison.measured_step_s == pytest.approx(0.076)
    assert comparison.step_error == pytest.approx(0.066 / 0.076 - 1)
    by_stage = {(c.pipeline, c.stage, c.kind): c.error for c in comparison.by_stage}
    assert by_stage[(1, 0, "forward")] == pytest.approx(-0.2)


def test_the_step_time_is_the_median_step_after_the_first() -> None:
    trace = hand_made(0.010, 0.020, 0.005, steps=4)
    slow = [e for e in trace.events if e.step == 2]
    trace.events = [e for e in trace.events if e.step != 2] + [
        TraceEvent(e.device, e.stream, e.kind, e.start_s, 5 * e.duration_s, e.pipeline, e.stage,
                   e.micro_batch, e.chunk, e.step) for e in slow]
    assert step_time_s(trace) == pytest.approx(0.066)


def test_a_run_directory_is_compared_with_its_plan_and_written_side_by_side(tmp_path) -> None:
    run = synthetic_run(tmp_path / "run", dp=2, pp=1)
    comparison, files = compare_paths(run)
    assert comparison.measured_step_s > comparison.predicted_step_s  # the claim is too fast
    assert comparison.cost_model_step_s == pytest.approx(comparison.predicted_step_s, rel=0.05)
    assert [f.name for f in files] == ["predicted.json", "side_by_side.json"]
    both = read_trace(run / "side_by_side.json")
    assert both.devices == [f"predicted {d}" for d in DEVICES] + [f"measured {d}" for d in DEVICES]
    assert min(e.start_s for e in both.events if e.device.startswith("measured")) == 0.0


def test_a_plan_and_a_trace_compare_as_a_run_does(tmp_path) -> None:
    run = synthetic_run(tmp_path / "run", dp=2, pp=1)
    by_run, _ = compare_paths(run)
    by_files, _ = compare_paths(run / "plan.json", run / "trace.json", tmp_path / "out")
    assert by_files.as_dict() == by_run.as_dict()
    assert (tmp_path / "out" / "side_by_side.json").is_file()


def test_an_emulated_trace_is_compared_in_device_seconds(tmp_path) -> None:
    run = synthetic_run(tmp_path / "run", dp=2, pp=1)
    plain, _ = compare_paths(run)
    trace = read_trace(run / "trace.json")
    stretched = [TraceEvent(e.device, e.stream, e.kind, 40 * e.start_s, 40 * e.duration_s,
                            e.pipeline, e.stage, e.micro_batch, e.chunk, e.step) for e in trace.events]
    write_trace(Trace(trace.devices, stretched, metadata={"source": "runtime", "dilation": 40.0}),
                run / "trace.json")
    emulated, _ = compare_paths(run)
    assert emulated.measured_step_s == pytest.approx(plain.measured_step_s)


def test_a_trace_of_other_devices_is_refused(tmp_path) -> None:
    path = tmp_path / "trace.json"
    write_trace(Trace(["elsewhere:0"], [TraceEvent("elsewhere:0", COMPUTE, "forward", 0, 1)],
                      metadata={"source": "runtime"}), path)
    save_plan(plan_on(CLAIMED, 2, 1), tmp_path / "plan.json")
    with pytest.raises(ConfigError, match="devices"):
        compare_paths(tmp_path)


def test_a_plan_needs_the_measured_trace(tmp_path) -> None:
    run = synthetic_run(tmp_path / "run", dp=2, pp=1)
    with pytest.raises(ConfigError, match="measured trace"):
        compare_paths(run / "plan.json")


def test_the_cli_compares_a_run_directory(tmp_path) -> None:
    from typer.testing import CliRunner

    from potluck.cli import app

    run = synthetic_run(tmp_path / "run", dp=2, pp=1)
    ran = CliRunner().invoke(app, ["compare", str(run), "--json"])
    assert ran.exit_code == 0, ran.output
    result = json.loads(ran.stdout)
    assert {"step_error", "cost_model_error", "by_kind", "by_stage"} <= result.keys()
    assert {row["kind"] for row in result["by_kind"]} >= {"forward", "backward", "dp_allreduce",
                                                          "optimizer"}


@pytest.mark.parametrize("name", ["predicted.json", "side_by_side.json"])
def test_compare_never_writes_through_a_link_in_the_run_directory(tmp_path, name) -> None:
    """A link planted in a shared run directory must not carry compare's writes elsewhere."""
    run = synthetic_run(tmp_path / "run", dp=2, pp=1)
    victim = tmp_path / "victim.txt"
    victim.write_text("mine\n")
    (run / name).symlink_to(victim)
    with pytest.raises(ConfigError, match=f"{name} is a symbolic link"):
        compare_paths(run)
    assert victim.read_text() == "mine\n"
