"""The learning rate of every step: ``potluck train --lr-schedule``, ``--warmup-steps``,
``--min-lr``.

A :class:`Schedule` is the rate as a function of the step index (counted from 0, as
``metrics.jsonl`` counts): ``warmup_steps`` steps rising linearly to ``lr`` (step ``s``
of the warm-up trains at ``lr * (s + 1) / (warmup_steps + 1)``, so no step is wasted at
rate 0), then ``constant`` at ``lr``, or decaying to ``min_lr`` by the end of
``total_steps``: ``cosine`` (half a cosine) or ``linear``. The default, constant
without warm-up, is the rate potluck always trained with.

The trainer steps it with torch's :class:`~torch.optim.lr_scheduler.LambdaLR`
(:func:`make_scheduler`), whose factor scales each param group's own rate by
``rate(step) / lr``. A checkpoint keeps the schedule and the scheduler's place in it
(:func:`schedule_state`); a resumed run continues the saved schedule
(:func:`restore_schedule`), so it trains with the rates an uninterrupted run would have.
Nothing here imports torch until a scheduler is made (``potluck train`` checks its
options without it).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass, fields
from enum import StrEnum
from functools import partial
from typing import TYPE_CHECKING, Any

from potluck.errors import ConfigError
from potluck.units import is_positive_real

if TYPE_CHECKING:
    from torch.optim import Optimizer
    from torch.optim.lr_scheduler import LambdaLR


class LRSchedule(StrEnum):
    """How the learning rate moves after the warm-up."""

    CONSTANT = "constant"
    COSINE = "cosine"
    LINEAR = "linear"


@dataclass(frozen=True)
class Schedule:
    """The learning rate of each step of a run of ``total_steps`` steps."""

    lr: float = 3e-4  # the peak: reached at the end of the warm-up
    kind: LRSchedule = LRSchedule.CONSTANT
    warmup_steps: int = 0
    min_lr: float = 0.0  # where cosine and linear end (constant ignores it)
    total_steps: int = 1

    def rate(self, step: int) -> float:
        """The learning rate of step ``step`` (from 0)."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / (self.warmup_steps + 1)
        if self.kind is LRSchedule.CONSTANT:
            return self.lr
        span = max(1, self.total_steps - self.warmup_steps)
        done = min(1.0, (step - self.warmup_steps) / span)
        left = 0.5 * (1 + math.cos(math.pi * done)) if self.kind is LRSchedule.COSINE else 1 - done
        return self.min_lr + (self.lr - self.min_lr) * left

    def factor(self, step: int) -> float:
        """:meth:`rate` relative to the peak (the scheduler's multiplier)."""
        return self.rate(step) / self.lr

    def problem(self) -> str | None:
        """What is wrong with these settings, as a flag-level sentence (None: nothing)."""
        if not (math.isfinite(self.lr) and self.lr > 0):
            return f"--lr must be a positive number such as 3e-4, not {self.lr}"
        if self.warmup_steps < 0:
            return f"--warmup-steps must be 0 or more, not {self.warmup_steps}"
        if self.warmup_steps > self.total_steps:
            return (f"--warmup-steps {self.warmup_steps} is more than the run's "
                    f"--steps {self.total_steps}; warm up for fewer steps")
        if not (math.isfinite(self.min_lr) and 0 <= self.min_lr <= self.lr):
            return (f"--min-lr must be between 0 and --lr {self.lr:g}, not {self.min_lr:g}")
        return None

    def describe(self) -> str:
        plural = "s" if self.warmup_steps != 1 else ""
        warmup = f", {self.warmup_steps} warm-up step{plural}" if self.warmup_steps else ""
        if self.kind is LRSchedule.CONSTANT:
            return f"constant at {self.lr:g}{warmup}"
        return f"{self.kind} from {self.lr:g} to {self.min_lr:g}{warmup} over " \
               f"{self.total_steps} steps"


def check_schedule(schedule: Schedule) -> None:
    """A ConfigError naming the first bad setting of ``schedule``."""
    problem = schedule.problem()
    if problem:
        raise ConfigError(problem)


def make_scheduler(optimizer: Optimizer, schedule: Schedule, lr_scale: float = 1.0
                   ) -> LambdaLR:
    """A LambdaLR stepping ``optimizer`` along ``schedule`` (each param group's rate times
    ``schedule.factor`` times ``lr_scale``: an island's inner-rate multiplier,
    :func:`potluck.runtime.grads.islands.inner_lr_scale`, which belongs to the run's plan,
    not to the schedule a checkpoint keeps), set at step 0. torch records each group's starting rate as
    ``initial_lr`` in the group; the scheduler keeps them as its ``base_lrs``, so that
    copy is dropped and a checkpoint's optimizer values stay what they were."""
    from torch.optim.lr_scheduler import LambdaLR

    scheduler = LambdaLR(optimizer, partial(_factor, schedule, lr_scale))
    for group in optimizer.param_groups:
        group.pop("initial_lr", None)
    return scheduler


def _factor(schedule: Schedule, lr_scale: float, step: int) -> float:
    return schedule.factor(step) * lr_scale


def advance(scheduler: LambdaLR) -> None:
    """The next step's rate. A run's first step may be skipped (fp16 overflow) without an
    optimizer step: torch warns of that order, which is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step",
                                category=UserWarning)
        scheduler.step()


def schedule_state(schedule: Schedule, scheduler: LambdaLR) -> dict[str, Any]:
    """What a checkpoint keeps: the settings, and the scheduler's place and base rates."""
    return {**asdict(schedule), "last_step": scheduler.last_epoch,
            "base_lrs": [float(lr) for lr in scheduler.base_lrs]}


def restore_schedule(optimizer: Optimizer, saved: Any, step: int, where: str,
                     lr_scale: float = 1.0) -> tuple[Schedule, LambdaLR]:
    """The saved schedule and a scheduler at ``step`` (the checkpoint's), each param group's
    rate set to the one that step trains with (times this run's ``lr_scale``, whatever the
    saved run's was). ``saved`` is checked first: a ConfigError
    naming ``where`` (the checkpoint) if it is not a schedule's state of that step."""
    schedule = _saved_schedule(saved, where)
    base_lrs = _saved_base_lrs(saved, len(optimizer.param_groups), where)
    if saved.get("last_step") != step:
        raise ConfigError(f"{where}: its learning-rate schedule is at step "
                          f"{saved.get('last_step')!r}, its trainer state at {step}")
    scheduler = make_scheduler(optimizer, schedule, lr_scale)
    rates = [base * schedule.factor(step) * lr_scale for base in base_lrs]
    scheduler.load_state_dict({**scheduler.state_dict(), "base_lrs": base_lrs,
                               "last_epoch": step, "_last_lr": rates})
    for group, rate in zip(optimizer.param_groups, rates, strict=True):
        group["lr"] = rate
    return schedule, scheduler


def _saved_schedule(saved: Any, where: str) -> Schedule:
    names = [field.name for field in fields(Schedule)]
    if not isinstance(saved, dict) or any(name not in saved for name in names):
        raise ConfigError(f"{where}: its learning-rate schedule is not a schedule's settings")
    try:
        schedule = Schedule(lr=_number(saved["lr"]), kind=LRSchedule(saved["kind"]),
                            warmup_steps=_count(saved["warmup_steps"]),
                            min_lr=_number(saved["min_lr"]),
                            total_steps=_count(saved["total_steps"]))
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{where}: its learning-rate schedule is damaged ({err})") from None
    problem = schedule.problem()
    if problem:
        raise ConfigError(f"{where}: its learning-rate schedule is damaged ({problem})")
    return schedule


def _saved_base_lrs(saved: dict[str, Any], groups: int, where: str) -> list[float]:
    """The saved base rates, one per param group; one rate shared by every saved group
    serves any number of groups (a plan with TP has a group more than one without)."""
    rates = saved.get("base_lrs")
    if not (isinstance(rates, list) and rates
            and all(is_positive_real(rate) for rate in rates)):
        raise ConfigError(f"{where}: its learning-rate schedule has no valid base rates")
    if len(rates) == groups:
        return [float(rate) for rate in rates]
    if len(set(rates)) == 1:
        return [float(rates[0])] * groups
    raise ConfigError(f"{where}: its {len(rates)} param groups had different learning rates; "
                      f"this run has {groups} groups")


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{value!r} is not a number")
    return float(value)


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{value!r} is not a whole number")
    return value
