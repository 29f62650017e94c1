"""`potluck schedule` end to end: --json, --gantt, --slurm scripts, and seeded traces."""

import json

import pytest
from typer.testing import CliRunner

from potluck import api
from potluck.cli import app
from potluck.cluster.topology import Cluster
from potluck.multijob.trace import MixEntry
from potluck.plans import load_plan

CLUSTER = """
name: tiny-lab
nodes:
  - {name: fast, gpu: a100-80g-sxm, gpus_per_node: 2, count: 1}
  - {name: slow, gpu: rtx3090, gpus_per_node: 2, count: 2}
"""
JOBS = """
jobs:
  - {name: big, model: gpt3-350m, global_batch: 16, seq_len: 2048, tokens: 600M}
  - {name: tiny, model: tiny-llama, global_batch: 16, seq_len: 256, tokens: 3B, arrival_h: 0.1}
hosts:
  fast: [gpu-a1]
  slow: [gpu-s1, gpu-s2]
"""
MIX = (MixEntry("gpt3-125m", 16, 1024, (200_000_000, 400_000_000), 0.5),
       MixEntry("tiny-llama", 16, 256, (1_000_000_000,), 0.5))


@pytest.fixture
def files(tmp_path):
    cluster, jobs = tmp_path / "lab.yaml", tmp_path / "jobs.yaml"
    cluster.write_text(CLUSTER)
    jobs.write_text(JOBS)
    return cluster, jobs


def invoke(*args):
    ran = CliRunner().invoke(app, ["schedule", *map(str, args)])
    assert ran.exit_code == 0, ran.output
    return ran


def test_json_holds_the_documented_fields(files):
    cluster, jobs = files
    data = json.loads(invoke("-c", cluster, "--jobs", jobs, "--policy", "throughput",
                             "--json").stdout)
    assert data["policy"] == "throughput"
    assert {"avg_completion_h", "makespan_h", "jobs"} <= set(data)
    names = [j["name"] for j in data["jobs"]]
    assert names == ["big", "tiny"]
    for entry in data["jobs"]:
        assert {"name", "devices", "layout", "tokens_per_s", "start_h", "end_h"} <= set(entry)
        assert entry["devices"] and all(":" in d for d in entry["devices"])
        assert entry["end_h"] > entry["start_h"] >= 0
    completions = [j["end_h"] - j["arrival_h"] for j in data["jobs"]]
    assert data["avg_completion_h"] == pytest.approx(sum(completions) / 2)


def test_slurm_scripts_pin_the_allocated_machines_and_launch_the_plan(files, tmp_path):
    cluster, jobs = files
    out, chart = tmp_path / "slurm", tmp_path / "gantt.png"
    data = json.loads(invoke("-c", cluster, "--jobs", jobs, "--policy", "fair", "--json",
                             "--slurm", out, "--gantt", chart).stdout)
    assert chart.read_bytes()[:4] == b"\x89PNG"
    hosts = {"fast.0": "gpu-a1", "slow.0": "gpu-s1", "slow.1": "gpu-s2"}
    for entry in data["jobs"]:
        sbatch = (out / f"{entry['name']}.sbatch").read_text()
        pinned = [hosts[m] for m in entry["machines"]]
        assert f"#SBATCH --nodelist={','.join(pinned)}\n" in sbatch
        assert f"#SBATCH --nodes={len(pinned)}\n" in sbatch
        launch = (out / f"{entry['name']}.launch.sh").read_text()
        assert launch.count("torchrun ") >= 1 and "-m potluck.runtime.worker" in launch
        plan_path = out / f"{entry['name']}.plan.json"
        assert f"--plan {plan_path}" in launch
        plan = load_plan(plan_path)
        assert plan.layout() == entry["layout"]
        assert plan.training.global_batch == 16
        # the plan's cluster is the job's machines only, numbered within it
        machines = {d.node for d in Cluster(plan.cluster).devices}
        assert len(machines) == len(entry["machines"])
        for host in pinned:
            assert f"  {host}) " in launch


def test_a_seeded_trace_is_the_same_trace_every_time(tmp_path):
    cluster = tmp_path / "lab.yaml"
    cluster.write_text(CLUSTER)
    first = api.schedule_trace(cluster, 12, seed=7, mix=MIX)
    again = api.schedule_trace(cluster, 12, seed=7, mix=MIX)
    other = api.schedule_trace(cluster, 12, seed=8, mix=MIX)
    assert first.jobs == again.jobs and first.jobs != other.jobs
    assert [r.result.policy.value for r in first.runs] == ["fifo", "equal", "throughput", "fair", "jct"]
    figures = [(r.result.avg_completion_h, r.result.makespan_h) for r in first.runs]
    assert figures == [(r.result.avg_completion_h, r.result.makespan_h) for r in again.runs]
    arrivals = [j.arrival_h for j in first.jobs]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0 and arrivals[-1] > 0


def test_trace_json_reports_every_policy(tmp_path, monkeypatch):
    cluster = tmp_path / "lab.yaml"
    cluster.write_text(CLUSTER)
    monkeypatch.setattr("potluck.multijob.trace.MIX", MIX)
    data = json.loads(invoke("-c", cluster, "--trace", 6, "--seed", 3, "--json").stdout)
    assert data["trace"] == 6 and data["seed"] == 3
    assert [p["policy"] for p in data["policies"]] == ["fifo", "equal", "throughput", "fair", "jct"]
    assert all(p["avg_completion_h"] > 0 and p["makespan_h"] > 0 for p in data["policies"])


def test_trace_and_jobs_exclude_each_other(files):
    cluster, jobs = files
    ran = CliRunner().invoke(app, ["schedule", "-c", str(cluster), "--jobs", str(jobs),
                                   "--trace", "5"])
    assert ran.exit_code != 0
