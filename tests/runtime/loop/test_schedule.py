"""Learning-rate schedules: each step's rate, and a resumed run that trains with the rates of
the uninterrupted one, whatever flags it was resumed with."""

from __future__ import annotations

import json
import math
import re
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from runtime_helpers import TINY_LLAMA, make_plan, pipe

from potluck import api
from potluck.errors import ConfigError
from potluck.runtime import Trainer, build_model, parallelize, start
from potluck.runtime.checkpoints import training_run
from potluck.runtime.checkpoints.storage import checkpoint_path
from potluck.runtime.launch.local import run_local
from potluck.runtime.loop.batches import RandomTokens
from potluck.runtime.loop.metrics import METRICS_FILE, run_callbacks
from potluck.runtime.loop.schedule import LRSchedule, Schedule, make_scheduler, restore_schedule
from potluck.runtime.options import TrainOptions

LR, MIN_LR, WARMUP, STEPS = 1e-2, 1e-3, 1, 4


def _schedule(kind: LRSchedule) -> Schedule:
    return Schedule(lr=LR, kind=kind, warmup_steps=WARMUP, min_lr=MIN_LR, total_steps=STEPS)


def test_the_default_is_the_constant_rate_potluck_always_trained_with():
    assert [TrainOptions(lr=LR).schedule().rate(step) for step in range(STEPS)] == [LR] * STEPS


@pytest.mark.parametrize("kind", list(LRSchedule))
def test_warmup_rises_to_the_peak_then_each_schedule_goes_its_way(kind):
    rates = [_schedule(kind).rate(step) for step in range(STEPS)]
    assert rates[:WARMUP + 1] == pytest.approx([LR / 2, LR])
    after = rates[WARMUP:]
    if kind is LRSchedule.CONSTANT:
        assert after == [LR] * len(after)
        return
    assert after == sorted(after, reverse=True) and MIN_LR < after[-1] < LR
    assert _schedule(kind).rate(STEPS) == pytest.approx(MIN_LR)  # the decay ends there
    if kind is LRSchedule.LINEAR:
        assert after == pytest.approx([LR - (LR - MIN_LR) * k / 3 for k in range(3)])
    else:
        assert after == pytest.approx([MIN_LR + (LR - MIN_LR) * 0.5 * (1 + math.cos(math.pi * k / 3))
                                       for k in range(3)])


@pytest.mark.parametrize(("fields", "message"), [
    ({"steps": 1, "warmup_steps": 2}, "--warmup-steps 2 is more than the run's --steps 1; "
                                      "warm up for fewer steps"),
    ({"warmup_steps": -1}, "--warmup-steps must be 0 or more, not -1"),
    ({"lr": 1e-3, "min_lr": 0.01}, "--min-lr must be between 0 and --lr 0.001, not 0.01"),
    ({"min_lr": float("nan")}, "--min-lr must be between 0 and --lr 0.0003, not nan"),
    ({"weight_decay": -0.1}, "--weight-decay must be 0 or a positive number such as 0.1, not -0.1"),
    ({"max_grad_norm": float("inf")}, "--max-grad-norm must be a positive number such as 1.0"),
    ({"lr_schedule": "step"}, "--lr-schedule must be one of constant, cosine, linear, not 'step'"),
])
def test_bad_schedule_and_optimizer_values_are_one_line(fields, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        api.train_options(**fields)


def test_torchs_scheduler_steps_the_optimizer_along_the_schedule():
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=LR)
    scheduler = make_scheduler(optimizer, _schedule(LRSchedule.COSINE))
    seen = []
    for _ in range(STEPS):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([_schedule(LRSchedule.COSINE).rate(s) for s in range(STEPS)])
    assert "initial_lr" not in optimizer.param_groups[0]  # checkpoints' values as before


def test_an_islands_rate_multiplier_scales_every_step_and_survives_a_resume_unsaved():
    """``lr_scale`` (an island's inner-rate multiplier) multiplies each step's rate; a
    checkpoint keeps the unscaled base rates, and a resume takes this run's multiplier,
    not the saved run's."""
    schedule = _schedule(LRSchedule.COSINE)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=LR)
    scheduler = make_scheduler(optimizer, schedule, lr_scale=2.0)
    seen = []
    for _ in range(2):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([2.0 * schedule.rate(s) for s in range(2)])
    saved = {**asdict(schedule), "last_step": 2, "base_lrs": [LR]}
    assert scheduler.base_lrs == [LR]
    fresh = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=LR)
    _, resumed = restore_schedule(fresh, saved, 2, "X", lr_scale=3.0)
    assert fresh.param_groups[0]["lr"] == pytest.approx(3.0 * schedule.rate(2))
    fresh.step()
    resumed.step()
    assert fresh.param_groups[0]["lr"] == pytest.approx(3.0 * schedule.rate(3))


def _rates(run: Path) -> dict[int, float]:
    lines = (run / METRICS_FILE).read_text().splitlines()
    return {record["step"]: record["lr"] for record in map(json.loads, lines)}


def _trainer(plan, session, options: TrainOptions) -> Trainer:
    """A trainer as ``potluck train`` makes one from ``options``, writing metrics.jsonl."""
    trainer = Trainer(parallelize(build_model(plan.model), session), schedule=options.schedule(),
                      weight_decay=options.weight_decay, max_grad_norm=options.max_grad_norm)
    if options.resume:
        training_run.resume(trainer, RandomTokens(1, 1, 1), options.out_dir)
    trainer.callbacks = run_callbacks(options, 0, trainer.step_index, None)
    return trainer


def _interrupted_and_resumed(plan, whole: Path, resumed: Path) -> None:
    """The uninterrupted run checkpoints after 2 of its 4 steps; the resumed run starts
    from that checkpoint with other flags (a constant rate, no clipping, no decay)."""
    session = start(plan, timeout_s=60)
    try:
        data = RandomTokens(plan.model.vocab_size, plan.training.seq_len, plan.training.global_batch)
        options = TrainOptions(steps=STEPS, lr=LR, lr_schedule=LRSchedule.COSINE,
                               warmup_steps=WARMUP, min_lr=MIN_LR, weight_decay=0.1,
                               max_grad_norm=0.5, checkpoint_every=2, out_dir=str(whole),
                               progress=False)
        trainer = _trainer(plan, session, options)
        trainer.fit(data, STEPS, on_step=training_run.checkpoint_hook(trainer, data, options))
        shutil.copytree(checkpoint_path(whole, 2), checkpoint_path(resumed, 2))
        other = TrainOptions(steps=STEPS, lr=3e-4, max_grad_norm=None, resume=True,
                             out_dir=str(resumed), progress=False)
        again = _trainer(plan, session, other)
        again.fit(data, STEPS - again.step_index)
        decay = {group["weight_decay"] for group in again.optimizer.param_groups}
        return again.max_grad_norm, decay
    finally:
        session.close()


def test_a_resumed_run_trains_with_the_rates_of_the_uninterrupted_run(tmp_path):
    plan = make_plan(TINY_LLAMA, [pipe([(1, (0, 4))], 2, 1)])
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    norm, decay = run_local(_interrupted_and_resumed, plan.devices, (plan, whole, resumed),
                            timeout_s=120)[0]
    expected = {step: _schedule(LRSchedule.COSINE).rate(step) for step in range(STEPS)}
    assert _rates(whole) == pytest.approx(expected)
    assert _rates(resumed) == pytest.approx({s: r for s, r in expected.items() if s >= 2})
    assert norm == 0.5 and decay == {0.1}  # the optimizer's settings came back too


@pytest.mark.parametrize(("change", "fragment"), [
    ({"kind": "step"}, "damaged ('step' is not a valid LRSchedule)"),
    ({"min_lr": 1.0}, "damaged (--min-lr must be between 0 and --lr 0.01, not 1)"),
    ({"warmup_steps": "2"}, "damaged ('2' is not a whole number)"),
    ({"base_lrs": [float("nan")]}, "has no valid base rates"),
    ({"last_step": 7}, "its learning-rate schedule is at step 7, its trainer state at 2"),
])
def test_a_damaged_saved_schedule_is_one_line(change, fragment):
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=LR)
    schedule = _schedule(LRSchedule.COSINE)
    saved = {**asdict(schedule), "last_step": 2, "base_lrs": [LR], **change}
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        restore_schedule(optimizer, saved, 2, "checkpoint X")
    assert restore_schedule(optimizer, {**saved, **{k: v for k, v in asdict(schedule).items()
                                                    if k in change},
                                        "last_step": 2, "base_lrs": [LR]}, 2, "X")[0] == schedule
