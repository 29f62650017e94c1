"""``potluck train --elastic`` as a user meets it on four CPU ranks: a rank killed mid-run
is planned around and the run finishes every step once, its losses after the restart
those of a plain ``--resume`` under the new plan from the same checkpoint; a device that
joins moves the run to the faster plan at a checkpoint."""

import json
import shutil

import pytest
from runtime_helpers import potluck

from potluck.plans import load_plan
from potluck.runtime.elastic.joins import register

CLUSTER = "nodes: [{name: cpu, gpu: cpu, gpus_per_node: 4}]\n"
STEPS = 8


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("elastic")
    (folder / "cpus.yaml").write_text(CLUSTER)
    return folder


def _plan(folder, name, *pins):
    path = folder / name
    made = potluck("plan", "-c", str(folder / "cpus.yaml"), "-m", "tiny-llama",
                   "--global-batch", "8", "--seq-len", "32", "--dtype", "fp32", *pins,
                   "-o", str(path))
    assert made.returncode == 0, made.stderr
    return path


def _train(plan, out, *extra):
    result = potluck("train", "--plan", str(plan), "--out", str(out), "--checkpoint-every",
                     "2", *extra)
    assert result.returncode == 0, result.stderr
    return result


def _losses(run):
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows}, [row["step"] for row in rows]


def _replans(run):
    return [json.loads(line) for line in (run / "replans.jsonl").read_text().splitlines()]


def test_a_killed_rank_is_planned_around_and_the_run_ends_like_a_resume(folder):
    plan = _plan(folder, "four.json", "--dp", "2", "--pp", "2", "--tp", "1")
    run = folder / "killed"
    said = _train(plan, run, "--steps", str(STEPS), "--elastic", "--inject-failure", "1@5")

    (replan,) = _replans(run)
    assert replan["reason"] == "lost" and replan["lost_devices"] == ["cpu.0:1"]
    # rank 1 dies having finished steps 0-4; rank 0 may or may not have logged step 4 yet
    assert replan["step"] == 4 and replan["steps_lost"] in (0, 1)
    assert "cpu.0:1" not in replan["new_devices"] and replan["old_layout"] == "dp=2 pp=2 tp=1"
    assert "elastic: lost cpu.0:1" in said.stderr
    losses, steps = _losses(run)
    assert steps == list(range(STEPS))  # every step once, none skipped
    final = load_plan(run / "plan.json")
    assert final.layout() == replan["new_layout"] and "cpu.0:1" not in final.devices

    plain = folder / "plain"
    _train(plan, plain, "--steps", "4")
    shutil.copy(run / "plan.json", folder / "after.json")
    _train(folder / "after.json", plain, "--steps", str(STEPS), "--resume")
    resumed, _ = _losses(plain)
    for step in range(STEPS):
        assert resumed[step] == pytest.approx(losses[step], abs=2e-3), step


def test_a_device_that_joins_moves_the_run_to_the_faster_plan(folder):
    plan = _plan(folder, "two.json", "--dp", "1", "--pp", "2", "--tp", "1")
    run = folder / "joined"
    register(run, load_plan(plan), ["cpu.0:2", "cpu.0:3"])
    said = _train(plan, run, "--steps", "6", "--elastic")

    (replan,) = _replans(run)
    assert replan["reason"] == "joined" and replan["step"] == 2 and replan["steps_lost"] == 0
    assert sorted(replan["joined_devices"]) == ["cpu.0:2", "cpu.0:3"]
    assert replan["new_predicted_step_s"] < 0.9 * replan["old_predicted_step_s"]
    final = load_plan(run / "plan.json")
    assert {"cpu.0:2", "cpu.0:3"} <= set(final.devices)
    assert _losses(run)[1] == list(range(6))
    assert "cpu.0:2, cpu.0:3 joined" in said.stderr
