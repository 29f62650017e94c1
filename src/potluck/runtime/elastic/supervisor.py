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
  Devices taken away with ``potluck leave`` go the same way, whatever the margin (the
  ones the plan does not run leave at once).

Every replan is appended to ``replans.jsonl`` (:mod:`~potluck.runtime.elastic.replans`). A
run restarts at most ``max_restarts`` times after failures.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from potluck.errors import ConfigError, InfeasibleError
from potluck.plans import Plan
from potluck.runtime.checkpoints.storage import checkpoint_step, newest_verified
from potluck.runtime.elastic.joins import leaving, registered
from potluck.runtime.elastic.pool import plan_for_devices, predicted_step_s
from potluck.runtime.elastic.replans import ReplanRecord, append_replan
from potluck.runtime.launch.watchdog import JobNotes, RankFailure
from potluck.runtime.loop.metrics import logged_steps
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
        watcher = _MembershipWatcher(run, settings.margin)
        watcher.look(None)  # devices offered or taken before the ranks start: replan first
        if watcher.chosen is not None:
            _replan(run, _after_change(run, watcher, restart_step(run.options)),
                    settings.report)
            continue
        try:
            _merge(run.history, launch(run.plan, run.options, watcher))
        except RankFailure as failure:
            if not failure.lost_devices or run.restarts >= settings.max_restarts:
                raise
            run.restarts += 1
            _merge(run.history, list(logged_steps(_run_dir(run.options)).values()))
            _replan(run, _after_loss(run, failure), settings.report)
            continue
        if watcher.chosen is None:
            return run.plan, _in_order(run.history)
        step = restart_step(run.options)
        if step >= run.options.steps:
            return run.plan, _in_order(run.history)
        _replan(run, _after_change(run, watcher, step), settings.report)


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
    return _Replan(new, describe_replan(run.plan, new, run.options, "lost",
                                        restart_step(run.options), lost=lost,
                                        cause=str(failure)))


def _after_change(run: ElasticRun, watcher: _MembershipWatcher, step: int) -> _Replan:
    """Devices offered and taken away, as the watcher planned with them; the run continues
    from ``step``."""
    assert watcher.chosen is not None
    run.pool = (run.pool | set(watcher.joined)) - set(watcher.left)
    reason = "joined" if not watcher.left else "left" if not watcher.joined else "changed"
    return _Replan(watcher.chosen, describe_replan(
        run.plan, watcher.chosen, run.options, reason, step, lost=watcher.left,
        joined=watcher.joined))


def describe_replan(old: Plan, new: Plan, options: TrainOptions, reason: str, step: int, *,
                    lost: tuple[str, ...] = (), joined: tuple[str, ...] = (),
                    cause: str = "") -> ReplanRecord:
    """The record of moving the run in ``options.out_dir`` from ``old`` to ``new``, which
    continues from checkpoint ``step`` (:func:`restart_step`)."""
    return ReplanRecord(
        step=step, reason=reason, lost_devices=lost, joined_devices=joined,
        old_layout=old.layout(), new_layout=new.layout(), old_devices=old.devices,
        new_devices=new.devices, old_predicted_step_s=predicted_step_s(old),
        new_predicted_step_s=predicted_step_s(new),
        steps_lost=max(0, _steps_done(options) - step), cause=cause)


def _replan(run: ElasticRun, replan: _Replan, report: Report | None) -> None:
    """Continue under the new plan: from the newest checkpoint, or from the start when the
    run has none yet; no drill again (its rank numbers were the old plan's)."""
    append_replan(_run_dir(run.options), replan.record)
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
    path = newest_verified(_run_dir(options), alone=True)
    return checkpoint_step(path) if path is not None else 0


def _steps_done(options: TrainOptions) -> int:
    """Steps the run had finished, by its metrics.jsonl (each step once)."""
    logged = logged_steps(_run_dir(options))
    return max(logged) + 1 if logged else 0


def _run_dir(options: TrainOptions) -> str:
    assert options.out_dir is not None  # check_elastic saw to it
    return options.out_dir


def _merge(history: dict[int, StepMetrics], attempt: list[StepMetrics]) -> None:
    """Rank 0's metrics of an attempt over those of the attempts before, by step."""
    history.update((metrics.step, metrics) for metrics in attempt)


def _in_order(history: dict[int, StepMetrics]) -> list[StepMetrics]:
    return [history[step] for step in sorted(history)]


class _MembershipWatcher:
    """Called by the launcher while the ranks run: plans with the devices offered and
    without those taken away and, when that plan must be taken (devices it runs are
    leaving) or is faster by the margin, asks the ranks to stop at their next checkpoint."""

    def __init__(self, run: ElasticRun, margin: float) -> None:
        self.run, self.margin = run, margin
        self.chosen: Plan | None = None
        self.joined: tuple[str, ...] = ()
        self.left: tuple[str, ...] = ()
        self._next_poll_s = 0.0
        self._tried: set[frozenset[str]] = set()

    def __call__(self, notes: JobNotes) -> None:
        """While the ranks run: look again, at most every :data:`JOIN_POLL_S`."""
        now = time.monotonic()
        if self.chosen is not None or now < self._next_poll_s:
            return
        self._next_poll_s = now + JOIN_POLL_S
        self.look(notes)

    def look(self, notes: JobNotes | None) -> None:
        """Plan with the devices offered and without those taken; ``notes`` of the running
        ranks, or None before they start (then a chosen plan is taken at once)."""
        out_dir, run = _run_dir(self.run.options), self.run
        joined = registered(out_dir, run.plan) - run.pool
        left = leaving(out_dir, run.plan) & run.pool
        run.pool -= left - set(run.plan.devices)  # devices the plan does not run just go
        left &= set(run.plan.devices)
        pool = frozenset((run.pool | joined) - left)
        if (joined or left) and pool not in self._tried:
            self._tried.add(pool)
            self._consider(pool, tuple(sorted(joined)), tuple(sorted(left)), notes)

    def _consider(self, pool: frozenset[str], joined: tuple[str, ...], left: tuple[str, ...],
                  notes: JobNotes | None) -> None:
        try:
            candidate = plan_for_devices(self.run.plan, pool)
        except (InfeasibleError, ConfigError) as err:
            log.warning("no plan fits without %s: %s; the run keeps them", ", ".join(left), err)
            return
        now_s, then_s = predicted_step_s(self.run.plan), predicted_step_s(candidate)
        log.info("%s: %s predicted %.3g s a step against %.3g s now", _change(joined, left),
                 candidate.layout(), then_s, now_s)
        if left or then_s < now_s * (1.0 - self.margin):
            self.chosen, self.joined, self.left = candidate, joined, left
            if notes is not None:
                notes.request_replan()


def _change(joined: tuple[str, ...], left: tuple[str, ...]) -> str:
    parts = ([f"with {', '.join(joined)}"] if joined else []) + (
        [f"without {', '.join(left)}"] if left else [])
    return " and ".join(parts)
