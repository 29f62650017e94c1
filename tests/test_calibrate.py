"""potluck calibrate: fit the cost model's inputs to a measured run, and show the error
before and after (on synthetic runs whose true inputs are known: ``calibkit``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from calibkit import (
    CLAIMED,
    CLUSTER_TEXT,
    TRUE_EFFICIENCY,
    TRUE_LINK_BANDWIDTH,
    TRUE_MEMORY_BANDWIDTH,
    plan_on,
    synthetic_run,
    true_cluster,
)
from potluck.calibrate.calibrate_run import calibrate_run
from potluck.calibrate.run import load_run
from potluck.cli import app
from potluck.cluster.spec import load_cluster, parse_cluster
from potluck.errors import ConfigError
from potluck.planner.cost import CostModel
from potluck.planner.evaluate import predict
from potluck.plans import Pipeline, Plan, Stage, save_plan


def step_s(plan: Plan) -> float:
    return predict(plan).iteration_time_s


def test_calibration_recovers_the_true_efficiency_and_bandwidths(tmp_path) -> None:
    outcome = calibrate_run(synthetic_run(tmp_path / "run", dp=2, pp=1))
    (device,) = outcome.fit.devices
    assert device.matmul_efficiency == pytest.approx(TRUE_EFFICIENCY, rel=1e-3)
    assert device.memory_bandwidth_bytes_per_s == pytest.approx(TRUE_MEMORY_BANDWIDTH, rel=1e-3)
    (link,) = outcome.fit.links
    assert (link.key.kind, link.key.group) == ("pcie", "cpu")
    assert link.bandwidth_bytes_per_s == pytest.approx(TRUE_LINK_BANDWIDTH, rel=0.01)


def test_an_overlapped_all_reduce_is_fitted_from_its_exposed_rest(tmp_path) -> None:
    slow = TRUE_LINK_BANDWIDTH / 8  # the all-reduce outlasts the last backward
    outcome = calibrate_run(synthetic_run(tmp_path / "run", dp=2, pp=1, overlap=True,
                                          link_bandwidth=slow))
    (link,) = outcome.fit.links
    assert link.bandwidth_bytes_per_s == pytest.approx(slow, rel=0.02)


def test_a_hidden_all_reduce_leaves_the_links_alone(tmp_path) -> None:
    outcome = calibrate_run(synthetic_run(tmp_path / "run", dp=2, pp=1, overlap=True))
    assert outcome.fit.links == ()
    assert outcome.fit.devices[0].matmul_efficiency == pytest.approx(TRUE_EFFICIENCY, rel=1e-3)


def test_the_calibrated_file_loads_and_predicts_like_the_true_cluster(tmp_path) -> None:
    outcome = calibrate_run(synthetic_run(tmp_path / "run", dp=2, pp=1),
                            out=tmp_path / "calibrated.yaml")
    calibrated = load_cluster(tmp_path / "calibrated.yaml")
    assert calibrated.device_type("cpu").matmul_efficiency == pytest.approx(TRUE_EFFICIENCY, rel=1e-3)
    before = step_s(plan_on(CLAIMED, 2, 1))
    after = step_s(plan_on(calibrated, 2, 1))
    truth = step_s(plan_on(true_cluster(), 2, 1))
    assert before < after == pytest.approx(truth, rel=0.01)  # the claim was too fast
    assert abs(outcome.after.step_error) < 0.02 < abs(outcome.before.step_error)


def test_calibration_generalizes_to_another_layout_of_the_same_cluster(tmp_path) -> None:
    outcome = calibrate_run(synthetic_run(tmp_path / "run", dp=2, pp=1))
    pipelined = plan_on(outcome.calibrated, 1, 4)
    assert step_s(pipelined) == pytest.approx(step_s(plan_on(true_cluster(), 1, 4)), rel=0.03)


def test_a_pipelined_run_fits_the_efficiency_and_matches_its_step(tmp_path) -> None:
    outcome = calibrate_run(synthetic_run(tmp_path / "run", dp=1, pp=2))
    assert outcome.fit.devices[0].matmul_efficiency == pytest.approx(TRUE_EFFICIENCY, rel=1e-3)
    assert abs(outcome.after.cost_model_error) < 0.01


def test_an_existing_cluster_file_keeps_its_text_and_gets_a_new_section(tmp_path) -> None:
    cluster = tmp_path / "lab.yaml"
    cluster.write_text("# our lab\n" + CLUSTER_TEXT
                       + "calibration:\n  devices:\n    cpu: {memory_bandwidth_factor: 2.0}\n")
    run = synthetic_run(tmp_path / "run", dp=2, pp=1)
    outcome = calibrate_run(run, cluster=cluster)
    assert outcome.cluster_file == tmp_path / "lab-calibrated.yaml"
    text = outcome.cluster_file.read_text()
    assert text.startswith("# our lab\n") and text.count("calibration:") == 1
    # the factor is relative to the file's own (uncalibrated) 20 GB/s
    spec = load_cluster(outcome.cluster_file)
    assert spec.device_type("cpu").memory_bandwidth_bytes_per_s == pytest.approx(
        TRUE_MEMORY_BANDWIDTH, rel=1e-3)


def test_a_cluster_file_of_other_devices_is_refused(tmp_path) -> None:
    other = tmp_path / "other.yaml"
    other.write_text("nodes:\n  - {name: box, gpu: rtx3090, gpus_per_node: 4}\n")
    with pytest.raises(ConfigError, match="cpu"):
        calibrate_run(synthetic_run(tmp_path / "run", dp=2, pp=1), cluster=other)


@pytest.mark.parametrize("setup, message", [
    (lambda d: None, "not found"),
    (lambda d: d.mkdir(), "no plan.json"),
    (lambda d: (d.mkdir(), save_plan(plan_on(CLAIMED, 2, 1), d / "plan.json")), "--trace"),
])
def test_bad_run_directories_are_one_clear_line(tmp_path, setup, message) -> None:
    run_dir = tmp_path / "run"
    setup(run_dir)
    with pytest.raises(ConfigError, match=message):
        load_run(run_dir)


def test_the_cli_says_what_is_wrong_in_one_line(tmp_path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    ran = subprocess.run([sys.executable, "-m", "potluck", "calibrate", str(tmp_path / "none")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert ran.returncode == 2
    assert ran.stderr.startswith("potluck: error: run directory") and ran.stderr.count("\n") == 1


def test_cli_calibrate_json(tmp_path) -> None:
    run = synthetic_run(tmp_path / "run", dp=2, pp=1)
    ran = CliRunner().invoke(app, ["calibrate", str(run), "-o", str(tmp_path / "c.yaml"), "--json"])
    assert ran.exit_code == 0, ran.output
    result = json.loads(ran.stdout)
    assert result["devices"][0]["matmul_efficiency"] == pytest.approx(TRUE_EFFICIENCY, rel=1e-3)
    assert abs(result["after"]["step_error"]) < abs(result["before"]["step_error"])
    assert (tmp_path / "c.yaml").is_file()


def test_an_emulated_run_is_read_as_the_emulator_padded_it() -> None:
    from potluck.calibrate import expected

    plan = plan_on(CLAIMED, 1, 2)
    devices = list(plan.devices)
    sends = expected.compute_s(plan, devices, emulated=True) - expected.compute_s(plan, devices)
    cost = CostModel.for_plan(plan)
    a, b = (cost.cluster.device(d) for d in devices)
    assert sends == pytest.approx(2 * 2 * cost.send_s((a,), (b,), 2))  # 2 micro-batches, 2 ways
    slowest = predict(plan, cost).breakdown.optimizer_s
    assert expected.optimizer_s(plan, devices, emulated=True) == pytest.approx(2 * slowest)


def test_calibration_expects_what_the_emulator_pads_where_pipelines_share_a_card() -> None:
    """dp=2 pipelines from one machine to another share the card: every rank's padded
    forward and backward (the emulator's targets) is what calibration reads them as."""
    from potluck.calibrate import expected
    from potluck.runtime.layout import Layout
    from potluck.runtime.timing.emulate import stage_targets

    spec = parse_cluster("nodes:\n  - {name: a, gpu: a100-80g-sxm, gpus_per_node: 2}\n"
                         "  - {name: b, gpu: rtx3090, gpus_per_node: 2}\n", "two.yaml")
    stages = lambda k: tuple(Stage((f"{g}.0:{k}",), ((2 * i, 2 * i + 2),))  # noqa: E731
                             for i, g in enumerate("ab"))
    plan = replace(plan_on(spec, 1, 2), pipelines=(Pipeline(stages(0), 2, 2),
                                                   Pipeline(stages(1), 2, 2)),
                   training=replace(plan_on(spec, 1, 2).training, global_batch=8))
    for rank, device in enumerate(plan.devices):
        targets = stage_targets(plan, Layout.for_local_ranks(plan, rank)).values()
        padded = 2 * sum(t.forward_s + t.backward_s for t in targets)  # 2 micro-batches
        assert expected.compute_s(plan, [device], emulated=True) == pytest.approx(padded)


def test_an_emulated_runs_sends_give_the_pipeline_link_its_figures() -> None:
    """Forward and backward padded with sends 2.5x as long as the cluster file says: the
    fit finds the link 2.5x slower (bandwidth divided, latency multiplied), and compute,
    already right, is left with nothing to absorb."""
    from potluck.calibrate.fit_sends import fit_sends
    from potluck.cluster.topology import Cluster
    from potluck.planner.evaluate import stage_op_times, stage_send_s
    from potluck.traces import Trace, TraceEvent

    spec = parse_cluster("nodes:\n  - {name: a, gpu: a100-80g-sxm, gpus_per_node: 1}\n"
                         "  - {name: b, gpu: rtx3090, gpus_per_node: 1}\n", "two.yaml")
    plan = replace(plan_on(spec, 1, 2), pipelines=(Pipeline(
        (Stage(("a.0:0",), ((0, 2),)), Stage(("b.0:0",), ((2, 4),))), 2, 2),))
    times, slow = stage_op_times(plan), 2.5
    events = []
    for step in range(3):
        for i, device in enumerate(plan.devices):
            sends = {"forward": stage_send_s(plan, 0, 0, 1) if i == 0 else 0.0,
                     "backward": stage_send_s(plan, 0, 1, 0) if i == 1 else 0.0}
            compute = {"forward": times[0][i].forward_s, "backward": times[0][i].backward_s}
            for kind in ("forward", "backward"):
                events += [TraceEvent(device, "compute", kind, 0.0, compute[kind] + slow * sends[kind],
                                      0, i, mb, 0, step) for mb in range(2)]
    (fit,) = fit_sends(plan, Trace(list(plan.devices), events))
    link = Cluster(spec).link(*(Cluster(spec).device(d) for d in plan.devices))
    assert fit.key.between == ("a", "b")
    assert fit.bandwidth_bytes_per_s == pytest.approx(link.bandwidth_bytes_per_s / slow, rel=1e-6)
    assert fit.latency_s == pytest.approx(link.latency_s * slow, rel=1e-6)


@pytest.mark.parametrize("where", ["a directory", "read-only"])
def test_a_calibration_output_that_cannot_be_written_is_one_line(tmp_path, where,
                                                                 request) -> None:
    run = synthetic_run(tmp_path / "run", dp=2, pp=1)
    if where == "read-only":
        folder = request.getfixturevalue("read_only_folder")
        out, says = folder / "calibrated.yaml", "permission denied"
    else:
        folder = out = tmp_path / "out"
        folder.mkdir()
        says = "it is a directory: give a file name"
    with pytest.raises(ConfigError, match=says) as refused:
        calibrate_run(run, out=out)
    assert str(folder) in str(refused.value) and "\n" not in str(refused.value)
    assert list(folder.iterdir()) == []
