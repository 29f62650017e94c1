"""Fixing an emulation's dilation before a run: measure a few real steps, then undo them.

:func:`calibrate_dilation` runs :data:`CALIBRATION_STEPS` steps through the
emulation clock (which notes how much slower than predicted each op ran on
this CPU; the first step only warms up: an op's first run pays lazy setup, such as
DTensor's sharding rules, that would inflate the dilation), sets the dilation from the
last, the same on every rank
(:meth:`~potluck.runtime.timing.emulate.EmulationClock.calibrate`), and puts
the trainer back as it was (:class:`TrainerSnapshot`: weights, optimizer and
loss-scale state, step count, the learning-rate scheduler, the state of the exchanges
across islands): the run then trains
exactly its steps, with
the numbers of a run without emulation. Rank 0 then says how long the steps
will take (:func:`potluck.runtime.loop.metrics.estimate_line`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from potluck.runtime.loop.trainer import BatchSource, Trainer
from potluck.runtime.timing.emulate import EmulationClock

CALIBRATION_STEPS = 2  # the first warms up, the last sets the dilation


def calibrate_dilation(trainer: Trainer, clock: EmulationClock, source: BatchSource,
                       report: Callable[[int, int, float], None] | None = None) -> None:
    """Measure a few real steps, then fix the dilation; the steps are undone.
    ``report(done, of, step_s)`` hears of each step (they can be long: nothing is padded
    yet, but the computed model may be a real one)."""
    saved = TrainerSnapshot.take(trainer)
    start_row, count = trainer.model.layout.batch_rows
    for done in range(1, CALIBRATION_STEPS + 1):
        metrics = trainer.step(source.replica_rows(trainer.step_index, start_row, count))
        if report is not None:
            report(done, CALIBRATION_STEPS, metrics.step_time_s)
        if done < CALIBRATION_STEPS:  # the first step warms up (lazy setup, first calls)
            clock.restart_measuring()
    trainer.flush()  # the priority schedule's gathers must not land after the restore
    clock.calibrate(step_s=trainer.predicted_step_time_s)
    saved.restore(trainer)


@dataclass
class TrainerSnapshot:
    """A trainer's state, to undo steps taken only to measure them."""

    parameters: list[torch.Tensor]
    optimizer: dict[str, Any]
    loss_scale: dict[str, Any] | None
    step_index: int
    scheduler: dict[str, Any]
    islands: dict[str, Any]

    @classmethod
    def take(cls, trainer: Trainer) -> TrainerSnapshot:
        trainer.flush()
        islands = trainer.islands.state_dict()  # bounded: lands the pushes in flight first
        with torch.no_grad():
            parameters = [p.detach().clone() for p in trainer.model.parameters()]
        scale = copy.deepcopy(trainer.loss_scale.state_dict()) if trainer.loss_scale else None
        return cls(parameters, copy.deepcopy(trainer.optimizer.state_dict()), scale,
                   trainer.step_index, copy.deepcopy(trainer.scheduler.state_dict()), islands)

    def restore(self, trainer: Trainer) -> None:
        with torch.no_grad():
            for param, saved in zip(trainer.model.parameters(), self.parameters, strict=True):
                param.copy_(saved)
        trainer.optimizer.load_state_dict(self.optimizer)
        if self.loss_scale is not None and trainer.loss_scale is not None:
            trainer.loss_scale.load_state_dict(self.loss_scale)
        trainer.step_index = self.step_index
        trainer.scheduler.load_state_dict(self.scheduler)
        trainer.islands.load_state_dict(self.islands)
