"""An elastic run across machines: the torchrun commands meet through torchrun's c10d
rendezvous, and ranks that torchrun's agents restarted without one machine agree on a
plan for the machines that came back and continue from the newest checkpoint."""

import json
import shlex

from potluck.cluster.spec import parse_cluster
from potluck.model.loading import load_model
from potluck.planner.search import search
from potluck.plans import TrainingShape, load_plan, save_plan
from potluck.runtime.elastic.replans import read_replans
from potluck.runtime.launch.local import run_local
from potluck.runtime.launch.torchrun import torchrun_commands
from potluck.runtime.worker import main as worker_main

TWO_MACHINES = "nodes: [{name: cpu, gpu: cpu, gpus_per_node: 2, count: 2}]\n"


def _plan():
    return search(parse_cluster(TWO_MACHINES), load_model("tiny-llama"),
                  TrainingShape(8, 32)).best


def test_elastic_commands_meet_through_c10d_and_restart():
    plan = _plan()
    commands = torchrun_commands(plan, "plan.json", "10.0.0.1", 29500, ["--elastic"],
                                 max_restarts=3)
    assert len(commands) == 2
    ids = set()
    for command in commands:
        words = shlex.split(command.command)
        assert {"--nnodes=1:2", "--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.1:29500",
                "--max-restarts=3"} <= set(words)
        assert not any(w.startswith(("--node-rank", "--master-addr")) for w in words)
        ids |= {w for w in words if w.startswith("--rdzv-id=")}
    assert len(ids) == 1  # one rendezvous for every machine


def test_ranks_restarted_without_a_machine_replan_and_continue(tmp_path):
    plan = _plan()
    assert plan.num_gpus == 4
    path, run = tmp_path / "plan.json", tmp_path / "run"
    save_plan(plan, path)
    argv = ["--plan", str(path), "--out-dir", str(run), "--checkpoint-every", "2",
            "--elastic", "--no-progress"]
    first = run_local(worker_main, plan.devices, (argv + ["--steps", "4"],),
                      env={"TORCHELASTIC_RESTART_COUNT": "0"}, timeout_s=300)
    assert first == [0] * 4
    # torchrun's agent restarts the ranks of machine cpu.0 only: cpu.1 is gone
    again = run_local(worker_main, ("cpu.0:0", "cpu.0:1"), (argv + ["--steps", "8"],),
                      env={"TORCHELASTIC_RESTART_COUNT": "1"}, timeout_s=300)
    assert again == [0, 0]

    (replan,) = read_replans(run)
    assert replan["lost_devices"] == ["cpu.1:0", "cpu.1:1"] and replan["step"] == 4
    after = load_plan(run / "plan.json")
    assert set(after.devices) <= {"cpu.0:0", "cpu.0:1"}
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(8))
