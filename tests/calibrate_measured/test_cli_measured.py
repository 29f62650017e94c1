"""``potluck calibrate --measured`` as a user meets it: exit codes, one-line errors, and a
calibrated file ``potluck plan`` then predicts the runs with."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from measuredkit import CLAIMED_TEXT, LAYOUTS, MODEL_NAME, true_times, write_claimed, write_runs

SRC = Path(__file__).resolve().parents[2] / "src"
HUNG_S = 600  # not a speed check: see tests/test_cli.py


def potluck(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(SRC), "COLUMNS": "160"}
    return subprocess.run([sys.executable, "-m", "potluck", *args], capture_output=True, text=True,
                          env=env, timeout=HUNG_S)


def test_calibrate_then_plan_predicts_the_measured_runs(tmp_path) -> None:
    runs = write_runs(tmp_path / "runs.csv", true_times(overhead_s=0.0))
    cluster, out = write_claimed(tmp_path / "lab.yaml"), tmp_path / "calibrated.yaml"
    done = potluck("calibrate", "--measured", str(runs), "-m", MODEL_NAME, "-c", str(cluster),
                   "-o", str(out))
    assert done.returncode == 0, done.stderr
    for text in ("a100-80g-sxm matmul_efficiency", "network bandwidth factor", "leave-one-out",
                 "Spearman", f"calibrated cluster file: {out}",
                 "inputs chosen by the error of runs left out in turn: "):
        assert text in done.stdout
    tp, pp, dp, mbs, batch, seq = LAYOUTS[1]
    planned = potluck("plan", "-c", str(out), "-m", MODEL_NAME, "--tp", str(tp), "--pp", str(pp),
                      "--dp", str(dp), "--micro-batch-size", str(mbs), "--global-batch", str(batch),
                      "--seq-len", str(seq), "--json")
    assert planned.returncode == 0, planned.stderr
    measured = true_times([LAYOUTS[1]], overhead_s=0.0)[0]
    assert json.loads(planned.stdout)["iteration_time_s"] == pytest.approx(measured, rel=0.01)


def test_calibrate_measured_json(tmp_path) -> None:
    runs = write_runs(tmp_path / "runs.csv", true_times())
    done = potluck("calibrate", "--measured", str(runs), "-m", MODEL_NAME, "-c",
                   str(write_claimed(tmp_path / "lab.yaml")), "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["cluster_file"] == str(tmp_path / "lab-calibrated.yaml")
    assert len(data["runs"]) == len(LAYOUTS) and data["mape_after"] < data["mape_before"]
    assert {"mape_leave_one_out", "spearman_leave_one_out", "fitted"} <= set(data)
    selection = data["selection"]
    assert selection["chosen"] == [fitted["parameter"] for fitted in data["fitted"]]
    assert selection["folds"] == len(LAYOUTS) and data["notes"] == []
    assert selection["held_out_mape"] == pytest.approx(data["mape_leave_one_out"])
    assert selection["tried"][0] == {"inputs": [], "held_out_mape": data["mape_before"]}


def test_a_refused_fit_is_one_line_and_writes_nothing(tmp_path) -> None:
    layouts = LAYOUTS[:4]
    runs = write_runs(tmp_path / "runs.csv", true_times(layouts, overhead_s=0.0,
                                                        cluster_text=CLAIMED_TEXT), layouts)
    out = tmp_path / "calibrated.yaml"
    done = potluck("calibrate", "--measured", str(runs), "-m", MODEL_NAME, "-c",
                   str(write_claimed(tmp_path / "lab.yaml")), "-o", str(out))
    assert done.returncode == 2
    *progress, line = done.stderr.strip().splitlines()
    assert all(earlier.startswith("calibrate: ") for earlier in progress)
    assert line.startswith("potluck: error: no fit predicts runs left out of it significantly "
                           "better than the cluster file: held-out error 0.0%")
    assert not out.exists()


@pytest.mark.parametrize(("args", "message"), [
    (("RUN", "--measured", "runs.csv", "-m", MODEL_NAME, "-c", "lab.yaml"),
     "give either a run directory or --measured runs.csv, not both"),
    (("--measured", "runs.csv", "-c", "lab.yaml"), "--measured needs --model"),
    ((), "give a run directory of potluck train --trace, or --measured runs.csv"),
])
def test_wrong_arguments_are_one_line(args, message) -> None:
    done = potluck("calibrate", *args)
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"potluck: error: {message}")


def test_a_bad_csv_row_is_one_line(tmp_path) -> None:
    runs = tmp_path / "runs.csv"
    runs.write_text("tp,pp,dp,micro_batch_size,global_batch,seq_len,iteration_time_s\n"
                    "1,1,4,2,12,512,0.5\n")
    done = potluck("calibrate", "--measured", str(runs), "-m", MODEL_NAME, "-c",
                   str(write_claimed(tmp_path / "lab.yaml")))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"potluck: error: {runs}:2: global_batch 12 is not divisible by dp*micro_batch_size = 8; "
        "give the run's global batch (a multiple of 8)"]
