"""potluck compare RUN_A RUN_B: two runs by their step time on the devices they ran for."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from potluck.calibrate.compare_run import compare_runs, run_step_time
from potluck.cli import app
from potluck.errors import ConfigError


def write_run(run_dir, steps_s: list[float], dilation: float | None = None):
    run_dir.mkdir()
    rows = []
    for step, step_s in enumerate(steps_s):
        row = {"step": step, "loss": 1.0, "step_time_s": step_s}
        if dilation is not None:
            row.update(dilation=dilation, device_step_time_s=step_s / dilation)
        rows.append(json.dumps(row))
    (run_dir / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    return run_dir


def test_emulated_runs_are_compared_on_their_devices_not_by_their_stretched_steps(tmp_path) -> None:
    # the planner's plan: 12.79 s steps at dilation 40 (0.32 s on its devices); the even
    # split: 2.84 s at dilation 5 (0.568 s): the planner's plan is faster
    planner = write_run(tmp_path / "planner", [20.0, 12.79, 12.79, 12.79], dilation=40.0)
    even = write_run(tmp_path / "even", [5.0, 2.84, 2.84, 2.84], dilation=5.0)
    runs = compare_runs(planner, even)
    assert runs.first.step_s == pytest.approx(12.79 / 40.0)
    assert runs.second.step_s == pytest.approx(2.84 / 5.0)
    assert runs.speedup == pytest.approx((2.84 / 5.0) / (12.79 / 40.0))


def test_a_real_run_is_compared_by_its_measured_step(tmp_path) -> None:
    run = run_step_time(write_run(tmp_path / "run", [9.0, 9.0, 0.5, 0.7, 0.6]))
    assert run.dilation is None and run.step_s == pytest.approx(0.6)  # median of the later half


def test_a_directory_without_metrics_is_one_clear_line(tmp_path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no metrics.jsonl"):
        run_step_time(tmp_path / "empty")


def test_cli_compare_two_run_directories(tmp_path) -> None:
    a = write_run(tmp_path / "a", [1.0, 1.0], dilation=10.0)
    b = write_run(tmp_path / "b", [1.0, 1.0], dilation=5.0)
    ran = CliRunner().invoke(app, ["compare", str(a), str(b), "--json"])
    assert ran.exit_code == 0, ran.output
    assert json.loads(ran.stdout)["speedup"] == pytest.approx(2.0)
    shown = CliRunner().invoke(app, ["compare", str(a), str(b)])
    assert "the first is 2.00x as fast" in shown.stdout
