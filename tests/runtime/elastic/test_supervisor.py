"""The elastic supervisor's decisions, with a stand-in for the ranks: which failures it
replans around and which it stops on, where it restarts from, what it logs."""

import json

import pytest
import torch
from runtime_helpers import CPU_CLUSTER

from potluck.errors import InfeasibleError
from potluck.model.loading import load_model
from potluck.planner.options import SearchOptions
from potluck.planner.search import search
from potluck.plans import TrainingShape
from potluck.runtime.checkpoints.storage import PARTIAL_SUFFIX, checkpoint_path, save_checkpoint
from potluck.runtime.elastic.joins import register, release
from potluck.runtime.elastic.replans import read_replans
from potluck.runtime.elastic.supervisor import ElasticSettings, restart_step, train_elastic
from potluck.runtime.launch.watchdog import RankFailure
from potluck.runtime.loop.trainer import StepMetrics
from potluck.runtime.options import TrainOptions


@pytest.fixture(scope="module")
def plan():
    """tiny-llama on four of the eight CPU ranks (dp=2 pp=2)."""
    pins = SearchOptions(dp=2, pp=2, tp=1)
    return search(CPU_CLUSTER, load_model("tiny-llama"), TrainingShape(8, 32), pins).best


def _metrics(step):
    return StepMetrics(step=step, loss=5.0 - step / 10, tokens=256, tokens_per_s=1.0,
                       step_time_s=1.0, predicted_step_time_s=None, peak_memory_gb=0.0,
                       grad_norm=1.0, lr=3e-4)


def _checkpoint(run, step):
    save_checkpoint(run, step, {"model": {"w": torch.zeros(2)}}, {"step": step})


def _log(run, steps):
    with (run / "metrics.jsonl").open("w") as out:
        for step in steps:
            out.write(json.dumps(_metrics(step).as_dict()) + "\n")


class Ranks:
    """Stands in for launching: each attempt fails as told, or trains to the end."""

    def __init__(self, run, failures):
        self.run, self.failures, self.attempts = run, list(failures), []

    def __call__(self, plan, options, watch):
        self.attempts.append((plan, options))
        start = 4 if options.resume else 0
        if self.failures:
            _checkpoint(self.run, 4)
            _log(self.run, range(6))
            raise self.failures.pop(0)
        _checkpoint(self.run, options.steps)
        return [_metrics(step) for step in range(start, options.steps)]


def _options(run, **fields):
    return TrainOptions(steps=8, out_dir=str(run), checkpoint_every=2, elastic=True, **fields)


def test_a_lost_device_is_planned_around_from_the_newest_checkpoint(plan, tmp_path):
    lost = plan.devices[1]
    ranks = Ranks(tmp_path, [RankFailure(f"rank 1 ({lost}) was killed", (lost,))])
    final, history = train_elastic(plan, _options(tmp_path, inject_failure="1@5"), ranks)

    (first, _), (second, resumed) = ranks.attempts
    assert lost not in second.devices and lost in second.unused_devices
    assert resumed.resume and resumed.inject_failure is None  # the drill fired once
    assert final is second
    assert [m.step for m in history] == list(range(8))
    (record,) = read_replans(tmp_path)
    assert record["lost_devices"] == [lost] and record["step"] == 4
    assert record["steps_lost"] == 2 and record["old_layout"] == first.layout()
    assert record["new_devices"] == list(second.devices)


def test_an_error_of_a_rank_itself_or_too_many_deaths_stop_the_run(plan, tmp_path):
    ranks = Ranks(tmp_path, [RankFailure("rank 0 (cpu.0:0) failed: ValueError: bad")])
    with pytest.raises(RankFailure, match="ValueError"):
        train_elastic(plan, _options(tmp_path), ranks)
    assert len(ranks.attempts) == 1 and read_replans(tmp_path) == []

    deaths = [RankFailure("killed", (device,)) for device in plan.devices[:2]]
    ranks = Ranks(tmp_path, deaths)
    with pytest.raises(RankFailure):
        train_elastic(plan, _options(tmp_path), ranks, ElasticSettings(max_restarts=1))
    assert len(ranks.attempts) == 2


def test_a_run_left_with_no_device_that_fits_says_so(plan, tmp_path):
    ranks = Ranks(tmp_path, [RankFailure("all gone", tuple(plan.devices))])
    with pytest.raises(InfeasibleError, match="all gone; no plan fits the 0 devices left"):
        train_elastic(plan, _options(tmp_path), ranks)


def test_a_save_cut_short_is_never_the_restart_point(tmp_path):
    _checkpoint(tmp_path, 4)
    _checkpoint(tmp_path, 6)
    newest = checkpoint_path(tmp_path, 6)
    newest.rename(newest.with_name(newest.name + PARTIAL_SUFFIX))  # killed before its commit
    _checkpoint(tmp_path, 8)
    next(checkpoint_path(tmp_path, 8).glob("*.safetensors")).write_bytes(b"torn")
    assert restart_step(_options(tmp_path)) == 4


class Notes:
    """Stands in for the launcher's notes to the ranks."""

    def __init__(self):
        self.requests = 0

    def request_replan(self):
        self.requests += 1


class RanksAsked:
    """Stands in for ranks that see devices offered or taken while they train: the first
    attempt registers them, hears the watcher out and stops at its checkpoint of step 4."""

    def __init__(self, run, mark):
        self.run, self.mark, self.attempts, self.notes = run, mark, [], Notes()

    def __call__(self, plan, options, watch):
        self.attempts.append((plan, options))
        if len(self.attempts) == 1:
            self.mark(self.run, plan)
            watch(self.notes)
            watch(self.notes)  # asked once, however often it looks
            _checkpoint(self.run, 4)
            _log(self.run, range(4))
            return [_metrics(step) for step in range(4)]
        _checkpoint(self.run, options.steps)
        return [_metrics(step) for step in range(4, options.steps)]


@pytest.mark.parametrize(("devices", "mark", "reason"), [
    (("cpu.0:4", "cpu.0:5", "cpu.0:6", "cpu.0:7"), register, "joined"),
    (("cpu.0:1",), release, "left")])
def test_devices_offered_or_taken_while_the_ranks_train_move_the_run_at_a_checkpoint(
        plan, tmp_path, devices, mark, reason):
    ranks = RanksAsked(tmp_path, lambda run, p: mark(run, p, devices))
    final, history = train_elastic(plan, _options(tmp_path), ranks)

    assert ranks.notes.requests == 1 and len(ranks.attempts) == 2
    (_, resumed) = ranks.attempts[1]
    assert resumed.resume
    assert bool(set(devices) & set(final.devices)) == (reason == "joined")
    (record,) = read_replans(tmp_path)
    assert record["reason"] == reason and record["step"] == 4 and record["steps_lost"] == 0
    assert [m.step for m in history] == list(range(8))
