"""The elastic run: launch the plan's ranks, and when devices leave or join, replan and
continue from the newest complete checkpoint, with no person involved.

:func:`train_elastic` plays the part torchrun's elastic agent plays across machines, for
the ranks of this machine (or an emulated cluster):

- a rank that dies without a word (killed, or gone with its machine: the launcher's
  :class:`~potluck.runtime.launch.watchdog.RankFailure` names its device) takes its
  device out of the run's pool; the survivors stop (their watchdogs see to it), the
  planner plans for the devices left (:func:`~potluck.runtime.elastic.pool.plan_for_devices`,
  which may leave more out), and the run resumes under that plan from its newest
  checkpoint that verifies (a save cut short is never finished, so never used), its data
  order continuing from there. A rank that fails with an error of its own (a bug, bad
  data, a diverged loss) stops the run as without ``--elastic``: a new plan would not help.
- devices registered with ``potluck join`` (:mod:`~potluck.runtime.elastic.joins`) are
  planned with while the ranks train; when the plan with them is faster than the running
  one by ``margin``, the ranks stop at their next checkpoint and the run continues under it.

Every replan is appended to ``replans.jsonl`` (:mod:`~potluck.runtime.elastic.replans`). A
run restarts at most ``max_restarts`` times after failures.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from potluck.errors import ConfigError, InfeasibleError
from potluck.plans import Plan
from potluck.runtime.checkpoints.storage import checkpoint_step, newest_verified
from potluck.runtime.elastic.joins import registered
from potluck.runtime.elastic.pool import plan_for_devices, predicted_step_s
from potluck.runtime.elastic.replans import ReplanRecord, append_replan
from potluck.runtime.launch.watchdog import JobNotes, RankFailure
from potluck.runtime.loop.metrics import METRICS_FILE
from potluck.runtime.loop.trainer import StepMetrics
from potluck.runtime.options import TrainOptions

log = logging.getLogger(__name__)
DEFAULT_MARGIN = 0.1  # a plan with joined devices must be this much faster to switch to it
DEFAULT_MAX_RESTARTS = 3
JOIN_POLL_S = 1.0  # how often the supervisor looks for registered devices


@dataclass
class ElasticRun:
    """Where an elastic run stands: its plan, the devices it may use, what it has trained."""

    plan: Plan
    options: TrainOptions
    pool: set[str]
    history: dict[int, StepMetrics] = field(default_factory=dict)  # rank 0's, by step
    restarts: int = 0


Launch = Callable[[Plan, TrainOptions, Callable[[JobNotes], None]], list[StepMetrics]]
Report = Callable[[ReplanRecord], None]


@dataclass(frozen=True)
class ElasticSettings:
    """How an elastic run replans: the margin a plan with joined devices must beat the
    running one by, the restarts after failures it may make, who hears of each replan."""

    margin: float = DEFAULT_MARGIN
    max_restarts: int = DEFAULT_MAX_RESTARTS
    report: Report | None = None


def train_elastic(plan: Plan, options: TrainOptions, launch: Launch,
                  settings: ElasticSettings = ElasticSettings()
                  ) -> tuple[Plan, list[StepMetrics]]:
    """Train ``plan`` elastically; the plan it finished under and rank 0's metrics of every
    step (each step once). ``launch(plan, options, watch)`` runs one attempt's ranks."""
    run = ElasticRun(plan, options, set(plan.devices))
    while True:
        watcher = _JoinWatcher(run, settings.margin)
        try:
            _merge(run.history, launch(run.plan, run.options, watcher))
        except RankFailure as failure:
            if not failure.lost_devices or run.restarts >= settings.max_restarts:
                raise
            run.restarts += 1
            _merge(run.history, list(_logged_steps(run.options).values()))
            _replan(run, _after_loss(run, failure), settings.report)
            continue
        if watcher.chosen is None or _finished(run):
            return run.plan, [run.history[step] for step in sorted(run.history)]
        _replan(run, _after_join(run, watcher.chosen, watcher.joined), settings.report)


@dataclass(frozen=True)
class _Replan:
    plan: Plan
    record: ReplanRecord


def _after_loss(run: ElasticRun, failure: RankFailure) -> _Replan:
    lost = tuple(failure.lost_devices)
    run.pool -= set(lost)
    try:
        new = plan_for_devices(run.plan, run.pool)
    except (InfeasibleError, ConfigError) as err:
        raise InfeasibleError(f"{failure}; no plan fits the {len(run.pool)} devices left: "
                              f"{err}") from None
    return _Replan(new, describe_replan(run.plan, new, run.options, "lost", lost=lost,
                                        cause=str(failure)))


def _after_join(run: ElasticRun, new: Plan, joined: tuple[str, ...]) -> _Replan:
    run.pool |= set(joined)
    return _Replan(new, describe_replan(run.plan, new, run.options, "joined", joined=joined))


def describe_replan(old: Plan, new: Plan, options: TrainOptions, reason: str, *,
                    lost: tuple[str, ...] = (), joined: tuple[str, ...] = (),
                    cause: str = "") -> ReplanRecord:
    """The record of moving the run in ``options.out_dir`` from ``old`` to ``new``, which
    continues from the run's newest checkpoint that verifies."""
    step = restart_step(options)
    return ReplanRecord(
        step=step, reason=reason, lost_devices=lost, joined_devices=joined,
        old_layout=old.layout(), new_layout=new.layout(), old_devices=old.devices,
        new_devices=new.devices, old_predicted_step_s=predicted_step_s(old),
        new_predicted_step_s=predicted_step_s(new),
        steps_lost=max(0, _steps_done(options) - step), cause=cause)


def _replan(run: ElasticRun, replan: _Replan, report: Report | None) -> None:
    """Continue under the new plan: from the newest checkpoint, or from the start when the
    run has none yet; no drill again (its rank numbers were the old plan's)."""
    assert run.options.out_dir is not None
    append_replan(run.options.out_dir, replan.record)
    if report is not None:
        report(replan.record)
    log.info("replanned at step %d: %s -> %s", replan.record.step, replan.record.old_layout,
             replan.record.new_layout)
    for step in [step for step in run.history if step >= replan.record.step]:
        del run.history[step]
    run.plan = replan.plan
    run.options = replace(run.options, resume=replan.record.step > 0, inject_failure=None)


def restart_step(options: TrainOptions) -> int:
    """The step of the run's newest checkpoint that verifies (0: it has none): a save cut
    short was never marked finished, and a damaged one fails its checksums."""
    assert options.out_dir is not None
    path = newest_verified(options.out_dir, alone=True)
    return checkpoint_step(path) if path is not None else 0


def _steps_done(options: TrainOptions) -> int:
    """Steps the run had finished, by its metrics.jsonl (each step once)."""
    logged = _logged_steps(options)
    return max(logged) + 1 if logged else 0


def _logged_steps(options: TrainOptions) -> dict[int, StepMetrics]:
    """The steps of the run's metrics.jsonl, by step (a line that is not one is skipped)."""
    assert options.out_dir is not None
    path = Path(options.out_dir) / METRICS_FILE
    names = {f.name for f in fields(StepMetrics)}
    logged: dict[int, StepMetrics] = {}
    if path.is_file():
        for line in path.read_text(errors="replace").splitlines():
            try:
                row = json.loads(line)
                metrics = StepMetrics(**{k: v for k, v in row.items() if k in names})
            except (ValueError, TypeError):
                continue
            logged[metrics.step] = metrics
    return logged


def _finished(run: ElasticRun) -> bool:
    return restart_step(run.options) >= run.options.steps


def _merge(history: dict[int, StepMetrics], attempt: list[StepMetrics]) -> None:
    """Rank 0's metrics of an attempt over those of the attempts before, by step."""
    history.update((metrics.step, metrics) for metrics in attempt)


class _JoinWatcher:
    """Called by the launcher while the ranks run: plans with registered devices and, when
    that plan is faster by the margin, asks the ranks to stop at their next checkpoint."""

    def __init__(self, run: ElasticRun, margin: float) -> None:
        self.run, self.margin = run, margin
        self.chosen: Plan | None = None
        self.joined: tuple[str, ...] = ()
        self._next_poll_s = 0.0
        self._tried: set[frozenset[str]] = set()

    def __call__(self, notes: JobNotes) -> None:
        now = time.monotonic()
        if self.chosen is not None or now < self._next_poll_s:
            return
        self._next_poll_s = now + JOIN_POLL_S
        assert self.run.options.out_dir is not None
        joined = registered(self.run.options.out_dir, self.run.plan) - self.run.pool
        pool = frozenset(self.run.pool | joined)
        if not joined or pool in self._tried:
            return
        self._tried.add(pool)
        self._consider(pool, tuple(sorted(joined)), notes)

    def _consider(self, pool: frozenset[str], joined: tuple[str, ...], notes: JobNotes) -> None:
        try:
            candidate = plan_for_devices(self.run.plan, pool)
        except InfeasibleError:
            return
        now_s, then_s = predicted_step_s(self.run.plan), predicted_step_s(candidate)
        log.info("with %s: %s predicted %.3g s a step against %.3g s now", ", ".join(joined),
                 candidate.layout(), then_s, now_s)
        if then_s < now_s * (1.0 - self.margin):
            self.chosen, self.joined = candidate, joined
            notes.request_replan()

