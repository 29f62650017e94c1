"""Starting ranks: per-machine torchrun commands, worker flags, device mapping."""

from __future__ import annotations

import json
import multiprocessing.forkserver as forkserver
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import fields, replace
from pathlib import Path

import pytest
from runtime_helpers import LR, TINY_LLAMA, make_plan, pipe, reference_losses

from potluck.cluster.spec import parse_cluster
from potluck.plans import save_plan
from potluck.runtime.launch.local import free_port, run_local
from potluck.runtime.launch.session import local_device_id
from potluck.runtime.launch.torchrun import plan_nodes, torchrun_commands, torchrun_rank_order
from potluck.runtime.loop.batches import batch_source
from potluck.runtime.loop.schedule import LRSchedule
from potluck.runtime.options import LAUNCHER_ONLY, TrainOptions
from potluck.runtime.worker import _defaults, parse_options, worker_args

SRC = Path(__file__).parents[3] / "src"
HUNG_S = 180  # not a speed check: commands that have not ended by then are hung

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
    assert first.startswith("POTLUCK_NODE=big.0 CUDA_DEVICE_ORDER=PCI_BUS_ID torchrun "
                            "--nnodes=2 --node-rank=0")
    assert "--nproc-per-node=2" in first and "--master-addr=10.0.0.1" in first
    assert first.endswith("-m potluck.runtime.worker --plan plan.json --steps 7")


def test_every_command_numbers_gpus_in_pci_bus_order_before_torchrun_starts():
    """CUDA reads CUDA_DEVICE_ORDER once, when first used: it must reach torchrun's ranks
    from their start, not be set inside a rank after some import may have used CUDA."""
    for max_restarts in (None, 2):
        for command in torchrun_commands(two_machine_plan(), "plan.json", "10.0.0.1",
                                         max_restarts=max_restarts):
            words = shlex.split(command.command)
            env = words[:words.index("torchrun")]
            assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in env


def _device_order() -> str | None:
    return os.environ.get("CUDA_DEVICE_ORDER")


@pytest.mark.parametrize("server", ["launcher's", "started before"])
def test_local_ranks_start_with_gpus_in_pci_bus_order(monkeypatch, server):
    """Whoever started the fork server: a fork server started outside the launcher (by
    another pool of this process) has not the variable to pass on."""
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    forkserver._forkserver._stop()
    if server == "started before":
        forkserver.ensure_running()
    assert run_local(_device_order, ["cpu.0:0"], timeout_s=120) == ["PCI_BUS_ID"]
    assert "CUDA_DEVICE_ORDER" not in os.environ  # the launcher's own environment is kept
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "FASTEST_FIRST")  # the user's choice wins
    assert run_local(_device_order, ["cpu.0:0"], timeout_s=120) == ["FASTEST_FIRST"]


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


THREE_AND_ONE = parse_cluster(
    "nodes:\n"
    "  - {name: big, gpu: cpu, gpus_per_node: 3}\n"
    "  - {name: small, gpu: cpu, gpus_per_node: 1}\n",
    "three-one.yaml",
)


def wrap_around_plan():
    """Pipeline 0 leaves big.0 and comes back (big.0:0 -> small.0:0 -> big.0:1), so its
    head shares a machine with its embedding; pipeline 1 is big.0:2 alone."""
    return make_plan(TINY_LLAMA, [pipe([(1, (0, 1)), (1, (1, 3)), (1, (3, 4))], 1, 3),
                                  pipe([(1, (0, 4))], 1, 1)],
                     cluster=THREE_AND_ONE,
                     device_ids=["big.0:0", "small.0:0", "big.0:1", "big.0:2"])


def test_torchrun_numbers_ranks_machine_by_machine(monkeypatch):
    """Global rank = the ranks of the machines before it + LOCAL_RANK; each rank then runs
    the device session.local_device_id picks from POTLUCK_NODE and LOCAL_RANK."""
    plan = wrap_around_plan()
    order = torchrun_rank_order(plan)
    assert order == ("big.0:0", "big.0:1", "big.0:2", "small.0:0") != plan.devices
    monkeypatch.delenv("POTLUCK_DEVICE", raising=False)
    rank = 0
    for node in torchrun_commands(plan, "plan.json", "127.0.0.1"):
        monkeypatch.setenv("POTLUCK_NODE", node.node)
        for local_rank in range(node.nproc):
            assert local_device_id(plan, rank, local_rank) == order[rank]
            rank += 1
    assert rank == plan.num_gpus


# A value other than potluck train's default for every TrainOptions field.
NON_DEFAULT = {
    "steps": 7, "lr": 1e-3, "seed": 5, "max_grad_norm": None, "out_dir": "runs/x",
    "lr_schedule": LRSchedule.COSINE, "warmup_steps": 2, "min_lr": 1e-5, "weight_decay": 0.1,
    "data": None, "tokenizer": "tok dir", "init_from": "hf dir", "emulate": True,
    "dilation": 2.5, "stand_in": "tiny",
    "seq_len": 32, "timeout_s": 30.0, "tensorboard": True, "progress": False,
    "checkpoint_every": 3, "keep_checkpoints": 0, "resume": True, "trace_steps": 2,
    "elastic": True, "inject_failure": "1@2", "count_memory": True,
}


def effective(options: TrainOptions) -> TrainOptions:
    """What a worker started with ``worker_args(options)`` trains with."""
    plan_path, parsed = parse_options(["--plan", "p.json", *worker_args(options)])
    assert plan_path == "p.json"
    return parsed


def test_every_option_reaches_the_worker_alone_and_together():
    assert set(NON_DEFAULT) | LAUNCHER_ONLY == {f.name for f in fields(TrainOptions)}
    for name, value in NON_DEFAULT.items():
        options = replace(_defaults(), **{name: value})
        assert options != _defaults(), name
        got = effective(options)
        assert got == options and type(getattr(got, name)) is type(value), name
    everything = replace(_defaults(), **NON_DEFAULT)
    assert effective(everything) == everything
    assert effective(_defaults()) == _defaults() and worker_args(_defaults()) == []


def potluck(*args, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(SRC), "COLUMNS": "80"}
    return subprocess.run([sys.executable, "-m", "potluck", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, env=env, timeout=HUNG_S)


def printed_commands(result: subprocess.CompletedProcess) -> list[str]:
    assert result.returncode == 0, result.stderr
    return [line for line in result.stdout.splitlines() if line.startswith("POTLUCK_NODE=")]


def worker_options(command: str) -> TrainOptions:
    words = shlex.split(command)
    return parse_options(words[words.index("potluck.runtime.worker") + 1:])[1]


# potluck train's flags for TrainOptions fields, each with a value other than its default.
TRAIN_FLAGS = {
    "steps": ["--steps", "3"], "lr": ["--lr", "0.01"], "seed": ["--seed", "5"],
    "out_dir": ["--out", "run"], "data": ["--data", "corpus"], "tokenizer": ["--tokenizer", "tok"],
    "init_from": ["--init-from", "hf"],
    "emulate": ["--emulate"], "dilation": ["--dilation", "2.5"], "stand_in": ["--stand-in", "tiny"],
    "timeout_s": ["--timeout", "30"], "tensorboard": ["--tensorboard"],
    "checkpoint_every": ["--checkpoint-every", "2"], "resume": ["--resume"],
    "trace_steps": ["--trace", "--trace-steps", "2"], "elastic": ["--elastic"],
    "inject_failure": ["--inject-failure", "1@2"], "count_memory": ["--count-memory"],
    "lr_schedule": ["--lr-schedule", "linear"], "warmup_steps": ["--warmup-steps", "1"],
    "min_lr": ["--min-lr", "1e-4"], "weight_decay": ["--weight-decay", "0.1"],
    "max_grad_norm": ["--max-grad-norm", "0"],
}
NOT_TRAIN_FLAGS = {"seq_len", "progress", "keep_checkpoints"}


def test_every_train_flag_reaches_the_workers_of_the_printed_commands(tmp_path):
    """Each machine's worker trains with the options potluck train's command line gave."""
    assert set(TRAIN_FLAGS) | NOT_TRAIN_FLAGS | LAUNCHER_ONLY == {
        f.name for f in fields(TrainOptions)}
    save_plan(two_machine_plan(), tmp_path / "plan.json")
    (tmp_path / "hf").mkdir()  # --init-from is checked to hold safetensors weights
    (tmp_path / "hf" / "model.safetensors").write_bytes(len(b"{}").to_bytes(8, "little") + b"{}")
    flags = [word for words in TRAIN_FLAGS.values() for word in words]
    commands = printed_commands(potluck("train", "--plan", "plan.json", "--print-commands",
                                        *flags, cwd=tmp_path))
    expected = replace(_defaults(), steps=3, lr=0.01, seed=5, out_dir="run", data="corpus",
                       tokenizer="tok", init_from="hf", emulate=True, dilation=2.5,
                       stand_in="tiny",
                       timeout_s=30.0, tensorboard=True, checkpoint_every=2, resume=True,
                       trace_steps=2, elastic=True, inject_failure="1@2", count_memory=True,
                       lr_schedule=LRSchedule.LINEAR, warmup_steps=1, min_lr=1e-4,
                       weight_decay=0.1, max_grad_norm=None)
    assert {f.name for f in fields(TrainOptions)
            if getattr(expected, f.name) != getattr(_defaults(), f.name)} == set(TRAIN_FLAGS)
    assert len(commands) == 2
    for command in commands:
        assert worker_options(command) == expected


def run_side_by_side(commands: list[str], cwd: Path) -> None:
    """Run each printed command (``POTLUCK_NODE=... torchrun ...``) in ``cwd`` as its own
    process group, torchrun as ``python -m torch.distributed.run``; fail with their logs
    unless all end well within HUNG_S, and leave no process behind."""
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    processes = []
    try:
        for index, command in enumerate(commands):
            words = shlex.split(command)
            start = words.index("torchrun")
            assigned = dict(word.split("=", 1) for word in words[:start])
            assert set(assigned) == {"POTLUCK_NODE", "CUDA_DEVICE_ORDER"}
            with open(cwd / f"node{index}.log", "w") as log:
                processes.append(subprocess.Popen(
                    [sys.executable, "-m", "torch.distributed.run", *words[start + 1:]],
                    env={**env, **assigned}, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True))
        _wait_all(processes, cwd)
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def _wait_all(processes: list[subprocess.Popen], logs: Path) -> None:
    deadline = time.monotonic() + HUNG_S
    try:
        codes = [process.wait(timeout=max(0.1, deadline - time.monotonic()))
                 for process in processes]
    except subprocess.TimeoutExpired:
        codes = None
    tails = "\n".join(log.read_text()[-2000:] for log in sorted(logs.glob("node*.log")))
    assert codes is not None, f"the commands had not ended after {HUNG_S} s:\n{tails}"
    assert codes == [0] * len(processes), f"exit codes {codes}:\n{tails}"


@pytest.mark.slow
def test_printed_torchrun_commands_train_a_wrap_around_pipeline_like_one_rank(tmp_path):
    """Both 'machines' are this one: the commands potluck train prints for a pipeline that
    comes back to its first machine, run side by side, train like a single process."""
    plan = wrap_around_plan()
    save_plan(plan, tmp_path / "plan.json")
    commands = printed_commands(potluck(
        "train", "--plan", "plan.json", "--print-commands", "--master-addr", "127.0.0.1",
        "--master-port", free_port(), "--steps", 3, "--lr", LR, "--seed", 3, "--out", "run",
        "--timeout", 60, cwd=tmp_path))
    assert [shlex.split(c)[0] for c in commands] == ["POTLUCK_NODE=big.0", "POTLUCK_NODE=small.0"]
    run_side_by_side(commands, tmp_path)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    losses = [json.loads(line)["loss"] for line in lines]
    data = batch_source(plan, worker_options(commands[0]))  # each worker's shipped corpus
    expected = reference_losses(TINY_LLAMA, 4, seed=3, data=data)
    assert losses == pytest.approx(expected, abs=2e-5)
