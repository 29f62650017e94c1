"""Failures are one clear line, and a dead rank never leaves the others hanging."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from runtime_helpers import TINY_LLAMA, make_plan, pipe

from potluck.errors import ConfigError
from potluck.runtime.launch.checks import check_local
from potluck.runtime.launch.local import run_local
from potluck.runtime.launch.session import start
from potluck.runtime.launch.watchdog import RankFailure
from potluck.runtime.loop.batches import RandomTokens
from potluck.runtime.loop.trainer import Trainer
from potluck.runtime.models.build import build_model
from potluck.runtime.options import TrainOptions
from potluck.runtime.parallel_model import parallelize

BOUND_S = 30.0


def _dies_at_step(plan, victim: int, step: int, notes: str, how: str) -> None:
    session = start(plan, timeout_s=BOUND_S)
    model = parallelize(build_model(plan.model), session)
    trainer = Trainer(model, lr=1e-3)
    data = RandomTokens(plan.model.vocab_size, plan.training.seq_len, plan.training.global_batch)
    start_row, count = session.layout.batch_rows
    try:
        for k in range(4):
            if k == step and session.rank == victim:
                if how == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                with session.guard():
                    raise ValueError("injected failure")
            trainer.step(data.replica_rows(k, start_row, count))
    except RankFailure as err:
        Path(notes, f"rank{session.rank}.txt").write_text(str(err))
        raise


@pytest.mark.parametrize("how", ["kill", "raise"])
def test_a_dead_rank_stops_the_others_with_an_error_naming_it(tmp_path, how):
    plan = make_plan(TINY_LLAMA, [pipe([(1, (0, 2)), (1, (2, 4))], 1, 2),
                                  pipe([(1, (0, 2)), (1, (2, 4))], 1, 2)])
    began = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 1 \(cpu\.0:1\)"):
        run_local(_dies_at_step, plan.devices, (plan, 1, 1, str(tmp_path), how),
                  timeout_s=4 * BOUND_S)
    assert time.monotonic() - began < 2 * BOUND_S
    notes = {p.name: p.read_text() for p in tmp_path.iterdir()}
    assert notes, "the surviving ranks should have stopped with a RankFailure"
    for text in notes.values():
        assert "rank 1 (cpu.0:1)" in text
        assert ("injected failure" in text) == (how == "raise")


def test_world_size_that_does_not_match_the_plan_is_one_clear_error(monkeypatch):
    plan = make_plan(TINY_LLAMA, [pipe([(1, (0, 2)), (1, (2, 4))], 1, 2)])
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError) as err:
        start(plan)
    message = str(err.value)
    assert "\n" not in message
    assert "uses 2 devices" in message and "3 rank(s)" in message


def test_plan_for_gpus_on_a_machine_without_them_is_one_clear_error():
    from potluck.cluster.spec import parse_cluster

    cluster = parse_cluster("nodes:\n  - name: box\n    gpu: rtx3090\n    gpus_per_node: 2\n")
    plan = make_plan(TINY_LLAMA, [pipe([(1, (0, 2)), (1, (2, 4))], 1, 2)], cluster=cluster,
                     device_ids=["box.0:0", "box.0:1"])
    if _has_cuda():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ConfigError, match="no CUDA GPU; dry-run it on CPU with --emulate"):
        check_local(plan, TrainOptions())
    check_local(plan, TrainOptions(emulate=True))


def test_plan_over_several_machines_asks_for_torchrun_or_emulation():
    from potluck.cluster.spec import parse_cluster

    cluster = parse_cluster("nodes:\n  - name: box\n    gpu: cpu\n    gpus_per_node: 1\n"
                            "    count: 2\n")
    plan = make_plan(TINY_LLAMA, [pipe([(1, (0, 2)), (1, (2, 4))], 1, 2)], cluster=cluster,
                     device_ids=["box.0:0", "box.1:0"])
    with pytest.raises(ConfigError, match="spans 2 machines"):
        check_local(plan, TrainOptions())


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def test_ranks_that_cannot_fit_in_host_memory_are_refused_before_any_starts(monkeypatch):
    """64 emulated ranks in 3 GB: one line with what they need and what there is, instead
    of the kernel's OOM killer ending the run without a word."""
    from potluck.cluster.spec import parse_cluster
    from potluck.runtime.launch import host_memory

    cluster = parse_cluster("nodes:\n  - {name: box, gpu: rtx3090, gpus_per_node: 8, count: 8}\n")
    ids = [f"box.{node}:{gpu}" for node in range(8) for gpu in range(8)]
    plan = make_plan(TINY_LLAMA, [pipe([(1, (0, 4))], 1, 1)] * 64, cluster=cluster,
                     device_ids=ids)
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 3e9)
    with pytest.raises(ConfigError) as err:
        check_local(plan, TrainOptions(emulate=True))
    message = str(err.value)
    assert "\n" not in message
    assert "64 ranks need at least 21.8 GB of host memory" in message
    assert "3.0 GB is available" in message
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 64e9)
    check_local(plan, TrainOptions(emulate=True))
