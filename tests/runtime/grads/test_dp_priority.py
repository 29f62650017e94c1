"""The data-parallel priority schedule (``plan.comm.dp_priority_schedule``): no barrier
between a rank's optimizer step and its next forward, the same numbers as without it.

Each layout trains with the schedule off and on: losses and final parameters are the
plain path's and one process's. After a step the parameter all-gathers are still in
flight, and the next forward waits for each bucket where a module first uses it; between
an optimizer step and the next forward no collective is waited for and none spans the
world. A checkpoint saved mid-run resumes to the same losses, and metrics.jsonl holds
every step, with every rank's memory.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from dp_workers import SMALL_BUCKETS
from priority_workers import fit_plan, prioritized, record_collectives, watch_buckets
from runtime_helpers import LR, STEPS, TINY_LLAMA, make_plan, pipe, reference_model

from potluck.ops import OpKind
from potluck.runtime import TrainOptions
from potluck.runtime.launch.checks import check_execution
from potluck.runtime.launch.local import run_local
from potluck.runtime.training import train_rank

DP2 = [pipe([(1, (0, 4))], 2, 2)] * 2
DP2_PP2 = [pipe([(1, (0, 2)), (1, (2, 4))], 1, 2)] * 2
CASES = {"zero=0 dp=2": (0, DP2), "zero=1 dp=2": (1, DP2),
         "zero=1 dp=2 x pp=2": (1, DP2_PP2), "zero=2 dp=2": (2, DP2)}
TOLERANCE = 2e-3


def test_the_runtime_runs_the_priority_schedule():
    check_execution(prioritized(make_plan(TINY_LLAMA, DP2), zero=1))


def _reference(global_batch: int, steps: int = STEPS) -> tuple[list[float], dict]:
    """One process's losses and final parameters (plain AdamW loop, same data)."""
    from runtime_helpers import reference_losses

    model = reference_model(TINY_LLAMA)
    losses = reference_losses(TINY_LLAMA, global_batch, steps=steps, model=model)
    return losses, {name: p.detach().numpy() for name, p in model.named_parameters()}


@pytest.mark.parametrize("case", list(CASES))
def test_the_schedule_keeps_the_plain_paths_losses_and_parameters(case):
    zero, pipelines = CASES[case]
    plan = make_plan(TINY_LLAMA, pipelines)
    plain = fit_plan(prioritized(plan, zero, on=False), bucket_elements=SMALL_BUCKETS)
    ranked = fit_plan(prioritized(plan, zero), bucket_elements=SMALL_BUCKETS)
    losses, parameters = _reference(plan.training.global_batch)

    assert ranked[0].losses == pytest.approx(losses, abs=TOLERANCE)
    for rank, (mine, theirs) in enumerate(zip(ranked, plain, strict=True)):
        assert mine.losses == theirs.losses, f"rank {rank}"
        assert mine.parameters.keys() == theirs.parameters.keys()
        for name, value in mine.parameters.items():
            assert np.array_equal(value, theirs.parameters[name]), f"rank {rank}: {name}"
            assert np.allclose(value, parameters[name], rtol=0, atol=TOLERANCE), \
                f"rank {rank}: {name}"


def test_gathers_stay_in_flight_and_each_block_waits_for_its_own_buckets():
    """After a step every bucket's all-gather is pending (parameters another replica
    updates still hold their old values); in the next step, the buckets block 0 waits for
    all hold its parameters, and the later blocks' buckets are still in flight after it.
    Reading the state dict finishes every gather first."""
    plan = prioritized(make_plan(TINY_LLAMA, DP2), zero=1)
    for rank, report in enumerate(watch_buckets(plan, SMALL_BUCKETS)):
        units, order = report["units"], report["order"]
        assert report["pending_after_step"] == order, f"rank {rank}"
        assert order == tuple(reversed(range(len(units))))  # embedding first, head last
        assert report["unchanged"], f"rank {rank}: every parameter was written back already"
        events = report["events"]
        begin = next(i for i, e in enumerate(events) if e[0] == "block.0")
        end = next(i for i, e in enumerate(events) if e[0] == "block.0 done")
        before = {units[e[1]] for e in events[:begin] if e[0] == "wait"}
        during = [units[e[1]] for e in events[begin:end] if e[0] == "wait"]
        assert before and all(set(u) <= {"embed", "embed+head"} for u in before), f"rank {rank}"
        assert during and all("block.0" in u for u in during), f"rank {rank}: {during}"
        later = {i for i, u in enumerate(units) if "block.0" not in u and "embed" not in u}
        assert later and later <= set(events[end][1]), f"rank {rank}: {events[end]}"
        assert report["pending_before_state_dict"] == order, f"rank {rank}"
        assert report["pending_after_state_dict"] == (), f"rank {rank}"


def _between_optimizer_and_forward(events: list[tuple]) -> list[list[tuple]]:
    """The events from each optimizer step's start to the next forward's start."""
    windows, start = [], None
    for i, event in enumerate(events):
        if event == ("start", OpKind.OPTIMIZER):
            start = i
        elif event == ("start", OpKind.FORWARD) and start is not None:
            windows.append(events[start:i])
            start = None
    return windows


def test_nothing_is_waited_for_or_world_wide_between_an_optimizer_step_and_the_next_forward():
    """dp=2 x pp=2 under ZeRO-1: between a rank's optimizer step and its next forward only
    the parameter all-gathers start (asynchronous, in groups of two, through the clock);
    no collective spans the four ranks and none is waited for."""
    plan = prioritized(make_plan(TINY_LLAMA, DP2_PP2), zero=1)
    world = len(plan.devices)
    for rank, events in enumerate(record_collectives(plan, bucket_elements=SMALL_BUCKETS)):
        windows = _between_optimizer_and_forward(events)
        assert len(windows) == STEPS - 1, f"rank {rank}"
        for window in windows:
            calls = [event[1:] for event in window if event[0] == "call"]
            assert calls, f"rank {rank}: no parameter all-gather started"
            assert all(name == "all_gather" and size < world and asynchronous
                       for name, size, asynchronous in calls), f"rank {rank}: {calls}"
            started = [event for event in window if event[0] == "start_comm"]
            assert started == [("start_comm", OpKind.PARAM_ALLGATHER)] * len(calls)
            assert not [event for event in window if event[0] == "wait"], f"rank {rank}"


def _losses(plan, options):
    return [m.loss for m in train_rank(plan, options)]


def _metrics_lines(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_checkpoint_saved_mid_run_resumes_to_the_same_losses_and_every_step_is_logged(tmp_path):
    """ZeRO-1 dp=2 under the schedule: 2 steps, a checkpoint, 2 more after --resume give
    the losses of 4 uninterrupted steps; both runs' metrics.jsonl hold each step once, with
    every rank's memory."""
    plan = prioritized(make_plan(TINY_LLAMA, DP2), zero=1)
    common = {"lr": LR, "progress": False, "timeout_s": 60, "checkpoint_every": 2,
              "count_memory": True}
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    straight = run_local(_losses, plan.devices,
                         (plan, TrainOptions(steps=4, out_dir=str(whole), **common)),
                         timeout_s=120)[0]
    resumed = []
    for steps in (2, 4):
        options = TrainOptions(steps=steps, out_dir=str(parts), resume=steps > 2, **common)
        resumed += run_local(_losses, plan.devices, (plan, options), timeout_s=120)[0]

    assert resumed == straight
    assert straight == pytest.approx(_reference(plan.training.global_batch, steps=4)[0],
                                     abs=TOLERANCE)
    for out_dir in (whole, parts):
        lines = _metrics_lines(out_dir)
        assert [line["step"] for line in lines] == [0, 1, 2, 3], out_dir.name
        assert [line["loss"] for line in lines] == straight
        for line in lines:
            assert len(line["memory"]) == len(plan.devices) and line["peak_memory_gb"] > 0
            assert all(row["device_bytes"] > 0 for row in line["memory"])
