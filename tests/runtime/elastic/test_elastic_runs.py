"""Elastic training as a user's run meets it, on four CPU ranks: a rank killed mid-run is
planned around and the run finishes every step once, its losses after the restart those
of a plain resume under the new plan from the same checkpoint; devices offered or taken
away before the start change the plan before the first step (while the ranks train they
do so at a checkpoint: tests/runtime/elastic/test_supervisor.py)."""

import json

import pytest

from potluck.cluster.spec import parse_cluster
from potluck.model.loading import load_model
from potluck.planner.options import SearchOptions
from potluck.planner.search import search
from potluck.plans import TrainingShape, load_plan
from potluck.runtime.elastic.joins import register, release
from potluck.runtime.elastic.replans import read_replans
from potluck.runtime.elastic.supervisor import ElasticSettings
from potluck.runtime.options import TrainOptions
from potluck.runtime.training import train

CLUSTER = parse_cluster("nodes: [{name: cpu, gpu: cpu, gpus_per_node: 4}]\n")
STEPS = 6


def _plan(dp, pp):
    options = SearchOptions(dp=dp, pp=pp, tp=1)
    return search(CLUSTER, load_model("tiny-llama"), TrainingShape(8, 32), options).best


def _options(run, **fields):
    return TrainOptions(out_dir=str(run), checkpoint_every=2, progress=False, **fields)


def _steps(run):
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows}, [row["step"] for row in rows]


def test_a_killed_rank_is_planned_around_and_the_run_ends_like_a_resume(tmp_path):
    plan, run, said = _plan(2, 2), tmp_path / "killed", []
    train(plan, _options(run, steps=STEPS, elastic=True, inject_failure="1@3"),
          elastic=ElasticSettings(report=said.append))

    (replan,) = read_replans(run)
    assert replan["reason"] == "lost" and replan["lost_devices"] == ["cpu.0:1"]
    # rank 1 dies having finished steps 0-2; rank 0 may or may not have logged step 2 yet
    assert replan["step"] == 2 and replan["steps_lost"] in (0, 1)
    assert "cpu.0:1" not in replan["new_devices"] and replan["old_layout"] == "dp=2 pp=2 tp=1"
    assert [r.lost_devices for r in said] == [("cpu.0:1",)]
    losses, steps = _steps(run)
    assert steps == list(range(STEPS))  # every step once, none skipped
    after = load_plan(run / "plan.json")
    assert after.layout() == replan["new_layout"] and "cpu.0:1" not in after.devices

    plain = tmp_path / "plain"
    train(plan, _options(plain, steps=2))
    train(after, _options(plain, steps=STEPS, resume=True))
    resumed, _ = _steps(plain)
    for step in range(STEPS):
        assert resumed[step] == pytest.approx(losses[step], abs=2e-3), step


def test_devices_offered_before_the_start_are_planned_with_from_the_first_step(tmp_path):
    plan, run = _plan(1, 2), tmp_path / "joined"
    register(run, plan, ["cpu.0:2", "cpu.0:3"])
    train(plan, _options(run, steps=4, elastic=True))

    (replan,) = read_replans(run)
    assert replan["reason"] == "joined" and replan["step"] == 0 and replan["steps_lost"] == 0
    assert sorted(replan["joined_devices"]) == ["cpu.0:2", "cpu.0:3"]
    assert replan["new_predicted_step_s"] < 0.9 * replan["old_predicted_step_s"]
    assert {"cpu.0:2", "cpu.0:3"} <= set(load_plan(run / "plan.json").devices)
    assert _steps(run)[1] == list(range(4))


def test_a_device_taken_away_before_the_start_is_not_used(tmp_path):
    plan, run = _plan(2, 2), tmp_path / "left"
    register(run, plan, ["cpu.0:3"])
    release(run, plan, ["cpu.0:3"])  # offered, then needed back: the last word stands
    assert not (run / "joined" / "cpu.0:3").exists()
    train(plan, _options(run, steps=4, elastic=True))

    (replan,) = read_replans(run)
    assert replan["reason"] == "left" and replan["lost_devices"] == ["cpu.0:3"]
    assert replan["step"] == 0 and replan["steps_lost"] == 0
    assert "cpu.0:3" not in load_plan(run / "plan.json").devices
    assert _steps(run)[1] == list(range(4))
