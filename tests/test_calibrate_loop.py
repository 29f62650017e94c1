"""potluck calibrate RUN_DIR on runs like a CPU's: an optimizer step that is mostly host time
does not become the memory bandwidth, and a fit that predicts the run worse is refused."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from calibkit import CLAIMED, CLUSTER_TEXT, TRUE_MEMORY_BANDWIDTH, plan_on, synthetic_run
from potluck.calibrate import calibrate_run as calibrate_module
from potluck.calibrate.calibrate_run import calibrate_run
from potluck.calibrate.fit import Fit
from potluck.calibrate.fit_devices import DeviceFit
from potluck.errors import PotluckError
from potluck.planner.cost import CostModel
from potluck.planner.evaluate import stage_shape, stage_sharding
from potluck.planner.formulas import adam_step_time_s
from potluck.traces import read_trace, write_trace

HOST_S = 0.05  # a Python loop over the parameter tensors, far longer than their traffic


def with_host_time(run_dir: Path, host_s: float = HOST_S) -> Path:
    """The run with ``host_s`` more in every optimizer step (the last op of a step)."""
    trace = read_trace(run_dir / "trace.json")
    events = [replace(e, duration_s=e.duration_s + host_s) if e.kind == "optimizer" else e
              for e in trace.events]
    write_trace(replace(trace, events=events), run_dir / "trace.json")
    return run_dir


def params_per_device() -> float:
    plan = plan_on(CLAIMED, 2, 1)
    return CostModel.for_plan(plan).stage_params(stage_shape(plan, 0, 0), 1) / stage_sharding(
        plan).optimizer_shards


def test_a_host_bound_optimizer_step_keeps_the_bandwidth_and_becomes_host_time(tmp_path) -> None:
    run = with_host_time(synthetic_run(tmp_path / "run", dp=2, pp=1))
    outcome = calibrate_run(run, out=tmp_path / "c.yaml")
    (device,) = outcome.fit.devices
    assert device.memory_bandwidth_bytes_per_s is None  # kept, not read from the optimizer
    assert device.matmul_efficiency is not None
    claimed_bandwidth = CLAIMED.device_type("cpu").memory_bandwidth_bytes_per_s
    params = params_per_device()
    # the measured step: HOST_S plus its traffic at the true bandwidth; the fit keeps the
    # claimed bandwidth, so the host time is the rest
    expected_s = (HOST_S + adam_step_time_s(params, TRUE_MEMORY_BANDWIDTH)
                  - adam_step_time_s(params, claimed_bandwidth))
    assert outcome.fit.step_overhead_s == pytest.approx(expected_s, rel=1e-6)
    written = yaml.safe_load((tmp_path / "c.yaml").read_text())
    assert written["execution"]["step_overhead_s"] == pytest.approx(expected_s, rel=1e-4)
    optimizer = {c.kind: c for c in outcome.after.by_kind}["optimizer"]
    assert abs(optimizer.error) < 0.01
    assert abs(outcome.after.step_error) < abs(outcome.before.step_error)


def test_a_memory_bound_optimizer_step_still_gives_the_bandwidth(tmp_path) -> None:
    outcome = calibrate_run(synthetic_run(tmp_path / "run", dp=2, pp=1), out=tmp_path / "c.yaml")
    assert outcome.fit.devices[0].memory_bandwidth_bytes_per_s == pytest.approx(
        TRUE_MEMORY_BANDWIDTH, rel=1e-3)
    assert outcome.fit.step_overhead_s == pytest.approx(0.0, abs=1e-9)
    assert "execution" not in yaml.safe_load((tmp_path / "c.yaml").read_text())


def test_a_fit_that_predicts_the_run_worse_is_refused_and_nothing_written(tmp_path,
                                                                           monkeypatch) -> None:
    run = synthetic_run(tmp_path / "run", dp=2, pp=1)
    bad = Fit((DeviceFit("cpu", 1e-4, None),), ())  # compute 10,000x slower than the claim
    monkeypatch.setattr(calibrate_module, "fit_run", lambda record, source: bad)
    out = tmp_path / "c.yaml"
    with pytest.raises(PotluckError, match="calibration refused") as caught:
        calibrate_run(run, out=out)
    assert "\n" not in str(caught.value) and "nothing written" in str(caught.value)
    assert list(tmp_path.iterdir()) == [tmp_path / "run"]  # no file, no leftover


def test_the_cli_refuses_in_one_line_with_a_non_zero_exit(tmp_path, monkeypatch, capsys) -> None:
    from potluck import cli

    run = synthetic_run(tmp_path / "run", dp=2, pp=1)
    monkeypatch.setattr(calibrate_module, "fit_run",
                        lambda record, source: Fit((DeviceFit("cpu", 1e-4, None),), ()))
    monkeypatch.setattr("sys.argv", ["potluck", "calibrate", str(run), "-o",
                                     str(tmp_path / "c.yaml")])
    with pytest.raises(SystemExit) as exited:
        cli.main()
    assert exited.value.code != 0
    err = capsys.readouterr().err
    assert err.startswith("potluck: error: calibration refused") and err.count("\n") == 1
    assert not (tmp_path / "c.yaml").exists()



def test_calibrating_a_file_with_an_execution_section_updates_it_in_place(tmp_path) -> None:
    """The fitted host time replaces the file's own; its other keys stay; one section."""
    cluster = tmp_path / "lab.yaml"
    cluster.write_text(CLUSTER_TEXT + "execution:\n  step_overhead_s: 0.5\n"
                       "  micro_batch_overhead_s: 0.001\n")
    run = with_host_time(synthetic_run(tmp_path / "run", dp=2, pp=1))
    outcome = calibrate_run(run, cluster=cluster, out=tmp_path / "c.yaml")
    text = (tmp_path / "c.yaml").read_text()
    assert text.count("execution:") == 1
    section = yaml.safe_load(text)["execution"]
    assert section == {"step_overhead_s": pytest.approx(outcome.fit.step_overhead_s, rel=1e-4),
                       "micro_batch_overhead_s": 0.001}
    assert outcome.fit.step_overhead_s > HOST_S / 2
