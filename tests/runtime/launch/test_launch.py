"""Starting ranks: per-machine torchrun commands, worker flags, device mapping."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from runtime_helpers import LR, TINY_LLAMA, make_plan, pipe, reference_losses

from potluck.cluster.spec import parse_cluster
from potluck.plans import save_plan
from potluck.runtime.launch.local import free_port
from potluck.runtime.launch.session import local_device_id
from potluck.runtime.launch.torchrun import plan_nodes, torchrun_commands
from potluck.runtime.options import TrainOptions
from potluck.runtime.worker import parse_options, worker_args

TWO_MACHINES = parse_cluster(
    "nodes:\n"
    "  - {name: big, gpu: cpu, gpus_per_node: 2}\n"
    "  - {name: small, gpu: cpu, gpus_per_node: 1}\n",
    "two.yaml",
)


def two_machine_plan():
    # pipeline 0 crosses machines (big.0:0 -> small.0:0); pipeline 1 stays on big.0:1
    return make_plan(TINY_LLAMA, [pipe([(1, (0, 1)), (1, (1, 4))], 1, 2),
                                  pipe([(1, (0, 4))], 2, 1)],
                     cluster=TWO_MACHINES, device_ids=["big.0:0", "small.0:0", "big.0:1"])


def test_one_torchrun_command_per_machine_with_its_own_rank_count():
    plan = two_machine_plan()
    assert plan_nodes(plan) == [("big.0", 2), ("small.0", 1)]
    commands = torchrun_commands(plan, "plan.json", "10.0.0.1", 29400, ["--steps", "7"])
    assert [c.nproc for c in commands] == [2, 1]
    first = commands[0].command
    assert first.startswith("POTLUCK_NODE=big.0 torchrun --nnodes=2 --node-rank=0")
    assert "--nproc-per-node=2" in first and "--master-addr=10.0.0.1" in first
    assert first.endswith("-m potluck.runtime.worker --plan plan.json --steps 7")


def test_every_value_of_a_command_is_quoted_for_the_shell():
    plan = two_machine_plan()
    commands = torchrun_commands(plan, "my plans/it's.json", "head;reboot", 29400,
                                 ["--out-dir", "runs/a b"])
    words = shlex.split(commands[1].command)
    assert words[0] == "POTLUCK_NODE=small.0" and "--master-addr=head;reboot" in words
    assert words[-4:] == ["--plan", "my plans/it's.json", "--out-dir", "runs/a b"]


def test_node_and_local_rank_pick_the_plans_device(monkeypatch):
    plan = two_machine_plan()
    monkeypatch.delenv("POTLUCK_DEVICE", raising=False)
    monkeypatch.setenv("POTLUCK_NODE", "big.0")
    assert local_device_id(plan, rank=2, local_rank=1) == "big.0:1"
    monkeypatch.setenv("POTLUCK_NODE", "small.0")
    assert local_device_id(plan, rank=1, local_rank=0) == "small.0:0"


def test_worker_flags_round_trip():
    options = TrainOptions(steps=7, lr=1e-3, out_dir="runs/x", emulate=True, progress=False,
                           max_grad_norm=None)
    args = worker_args(options)
    assert parse_options(["--plan", "p.json", *args]) == ("p.json", options)


@pytest.mark.slow
def test_torchrun_commands_start_a_job_across_machines_with_different_rank_counts(tmp_path):
    """Both 'machines' are this one: run each printed command, check the loss curve."""
    plan = two_machine_plan()
    plan_path = tmp_path / "plan.json"
    save_plan(plan, plan_path)
    options = TrainOptions(steps=3, lr=LR, out_dir=str(tmp_path / "run"), progress=False,
                           timeout_s=60)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[3] / "src"),
           "OMP_NUM_THREADS": "1"}
    processes = []
    for node in torchrun_commands(plan, str(plan_path), "127.0.0.1", port, worker_args(options)):
        words = shlex.split(node.command)
        node_env = {**env, **dict([words[0].split("=", 1)])}
        command = [sys.executable, "-m", "torch.distributed.run", *words[2:]]
        processes.append(subprocess.Popen(command, env=node_env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
    for process in processes:
        output, _ = process.communicate(timeout=180)
        assert process.returncode == 0, output[-3000:]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    losses = [json.loads(line)["loss"] for line in lines]
    assert losses == pytest.approx(reference_losses(TINY_LLAMA, 4), abs=2e-5)
