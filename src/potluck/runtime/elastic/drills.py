"""What the ranks of an elastic run do for it: die on cue, and stop for a replan.

- ``--inject-failure RANK@STEP`` (a fire drill, and what the tests use): rank ``RANK``
  kills itself with SIGKILL when it reaches step ``STEP`` (numbered as in metrics.jsonl,
  from 0: after it has finished ``STEP`` steps), as a machine that vanishes would, with
  no report and no clean-up.
- After each checkpoint between the first and the last step, the ranks of an elastic
  run ask the launcher's store whether to stop there: the supervisor asks them to when
  devices joined and a plan with them is faster (:meth:`JobNotes.stop_at`).
"""

from __future__ import annotations

import logging
import os
import re
import signal
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from potluck.errors import ConfigError
from potluck.plans import Islands, Plan
from potluck.runtime.checkpoints.training_run import saves_after
from potluck.runtime.launch.watchdog import JobNotes, root_store
from potluck.runtime.loop.trainer import StepMetrics, Trainer
from potluck.runtime.options import TrainOptions

log = logging.getLogger(__name__)
_INJECTION = re.compile(r"^(\d+)@(\d+)$")


@dataclass(frozen=True)
class InjectedFailure:
    """Rank ``rank`` dies when it reaches step ``step``."""

    rank: int
    step: int


def parse_injection(text: str, world_size: int | None = None,
                    steps: int | None = None) -> InjectedFailure:
    """``RANK@STEP`` as an :class:`InjectedFailure`; one ConfigError line when it is not one,
    or names a rank or step the run does not have."""
    match = _INJECTION.match(text.strip())
    if not match:
        raise ConfigError(f"--inject-failure takes RANK@STEP, such as 1@5, not {text!r}")
    failure = InjectedFailure(int(match.group(1)), int(match.group(2)))
    if world_size is not None and failure.rank >= world_size:
        raise ConfigError(f"--inject-failure {text}: the plan has ranks 0-{world_size - 1}")
    if failure.step < 1 or (steps is not None and failure.step >= steps):
        last = f"-{steps - 1}" if steps is not None else " or later"
        raise ConfigError(f"--inject-failure {text}: the step must be 1{last} (a rank dies "
                          "when it reaches it, after finishing that many steps)")
    return failure


def check_elastic(plan: Plan, options: TrainOptions) -> None:
    """An elastic run keeps checkpoints in a run directory, and islands that synchronize
    rarely exchange every fragment at once (each checkpoint then a consensus state, from
    which a run without an island resumes); a drill names a rank and a step the run has."""
    if options.elastic and not options.out_dir:
        raise ConfigError("--elastic restarts from the run's checkpoints: give --out DIR")
    if options.elastic and options.checkpoint_every <= 0:
        raise ConfigError("--elastic restarts from the newest checkpoint: give "
                          "--checkpoint-every N (steps between checkpoints)")
    if options.elastic and plan.islands.split and plan.islands.fragments > 1:
        raise ConfigError(f"--elastic resumes islands from consensus checkpoints, which "
                          f"{plan.islands.fragments} fragments never make (they are exchanged "
                          "at different steps); plan with one fragment or train without "
                          "--elastic")
    if options.inject_failure:
        parse_injection(options.inject_failure, plan.num_gpus, options.steps)


def rank_hook(trainer: Trainer, options: TrainOptions
              ) -> Callable[[StepMetrics], None] | None:
    """This rank's part after each step (after its checkpoint): die if the drill says so,
    and in an elastic run stop after a checkpoint the supervisor wants a replan at."""
    failure = parse_injection(options.inject_failure) if options.inject_failure else None
    rank, islands = trainer.model.layout.rank, trainer.model.layout.plan.islands
    if (failure is None or failure.rank != rank) and not options.elastic:
        return None
    default_store = dist.distributed_c10d._get_default_store
    notes = JobNotes(root_store(default_store())) if options.elastic else None

    def hook(metrics: StepMetrics) -> None:
        reached = metrics.step + 1
        if notes is not None and _checkpointed(reached, options, islands):
            trainer.stop_requested = notes.stop_at(reached, coordinator=rank == 0)
        if failure is not None and failure.rank == rank and reached == failure.step:
            log.warning("rank %d: --inject-failure kills this rank at step %d", rank, reached)
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


def _checkpointed(done: int, options: TrainOptions, islands: Islands) -> bool:
    """Whether the run saved a checkpoint after ``done`` steps, short of its last."""
    return done < options.steps and saves_after(done, options, islands)
