"""The event-driven simulation of a policy over hours: when each job runs, where, how fast.

Events are arrivals and completions. At each event the policy re-decides every active
job's allocation (:func:`potluck.multijob.policies.allocate`), concrete machines are
picked (:func:`potluck.multijob.machines.assign_machines`), and time advances to the next
arrival or the first completion. A job trains at its plan's predicted tokens/s while it
holds the same machines; every start on new machines (the first, and every move or
resize) costs ``restart_s`` without progress (loading a checkpoint, rendezvous, warm-up).
The result lists each job's segments, so every figure can be checked: a job's tokens
equal the sum over its segments of tokens/s times the time it trained in them.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from potluck.cluster.spec import ClusterSpec
from potluck.errors import InfeasibleError
from potluck.multijob.allocations import Allocation
from potluck.multijob.jobs import Job
from potluck.multijob.machines import Machine, assign_machines
from potluck.multijob.policies import DEFAULT_RESTART_S, Active, Policy, allocate
from potluck.multijob.throughput import ThroughputTable
from potluck.plans import Plan

log = logging.getLogger(__name__)

HOUR_S = 3600.0
DONE_FRACTION = 1e-9  # a job with this share of its tokens left is done (float rounding)


@dataclass(frozen=True)
class Segment:
    """A stretch of time a job held the same machines."""

    allocation: Allocation
    machines: tuple[Machine, ...]
    plan: Plan
    tokens_per_s: float
    start_s: float
    end_s: float
    training_from_s: float  # start_s plus the restart; before it no progress

    @property
    def tokens(self) -> float:
        return self.tokens_per_s * max(0.0, self.end_s - self.training_from_s)


@dataclass(frozen=True)
class JobOutcome:
    """One job's schedule: its segments in time order."""

    job: Job
    segments: tuple[Segment, ...]

    @property
    def start_h(self) -> float:
        return self.segments[0].start_s / HOUR_S

    @property
    def end_h(self) -> float:
        return self.segments[-1].end_s / HOUR_S

    @property
    def completion_h(self) -> float:
        """Job completion time: end minus arrival."""
        return self.end_h - self.job.arrival_h

    @property
    def main(self) -> Segment:
        """The segment in which the job trained the most tokens (what reports show)."""
        return max(self.segments, key=lambda s: s.tokens)

    @property
    def deadline_met(self) -> bool | None:
        if self.job.deadline_h is None:
            return None
        return self.completion_h <= self.job.deadline_h + 1e-9


@dataclass(frozen=True)
class ScheduleResult:
    """Every job's outcome under one policy, in the jobs' order."""

    policy: Policy
    cluster: ClusterSpec
    outcomes: tuple[JobOutcome, ...]
    restart_s: float
    hosts: dict[str, tuple[str, ...]] = field(default_factory=dict)  # the jobs file's, for sbatch
    notes: tuple[str, ...] = ()  # the jobs file's warnings

    @property
    def avg_completion_h(self) -> float:
        return sum(o.completion_h for o in self.outcomes) / len(self.outcomes)

    @property
    def makespan_h(self) -> float:
        """From the first arrival to the last completion."""
        return max(o.end_h for o in self.outcomes) - min(o.job.arrival_h for o in self.outcomes)


@dataclass
class _Running:
    allocation: Allocation
    machines: tuple[Machine, ...]
    plan: Plan
    tokens_per_s: float
    start_s: float
    training_from_s: float

    def closed(self, end_s: float) -> Segment:
        return Segment(self.allocation, self.machines, self.plan, self.tokens_per_s,
                       self.start_s, end_s, self.training_from_s)


def simulate(jobs: tuple[Job, ...], table: ThroughputTable, policy: Policy,
             restart_s: float = DEFAULT_RESTART_S) -> ScheduleResult:
    """Run ``jobs`` on ``table``'s cluster under ``policy`` until every job is done."""
    state = _State(jobs, table, policy, restart_s)
    while state.unfinished():
        state.decide()
        state.advance()
    outcomes = tuple(JobOutcome(job, tuple(state.segments[job.name])) for job in jobs)
    return ScheduleResult(policy, table.spec, outcomes, restart_s)


class _State:
    """The simulation's clock, queue and running jobs."""

    def __init__(self, jobs: tuple[Job, ...], table: ThroughputTable, policy: Policy,
                 restart_s: float) -> None:
        self.table, self.policy, self.restart_s = table, policy, restart_s
        self.pending = sorted(jobs, key=lambda j: j.arrival_h)  # stable: file order on ties
        self.now_s = self.pending[0].arrival_h * HOUR_S if self.pending else 0.0
        self.active: list[Job] = []
        self.left = {job.name: float(job.tokens) for job in jobs}
        self.running: dict[str, _Running] = {}
        self.segments: dict[str, list[Segment]] = {job.name: [] for job in jobs}

    def unfinished(self) -> bool:
        return bool(self.pending or self.active)

    def decide(self) -> None:
        while self.pending and self.pending[0].arrival_h * HOUR_S <= self.now_s:
            self.active.append(self.pending.pop(0))
        entries = [Active(job, self._held(job), self.left[job.name]) for job in self.active]
        decision = allocate(self.policy, entries, self.table, self.restart_s)
        previous = {name: run.machines for name, run in self.running.items()}
        machines = assign_machines(self.table.spec, previous, decision)
        for job in self.active:
            self._place(job, decision.get(job.name), machines.get(job.name))

    def _held(self, job: Job) -> Allocation | None:
        run = self.running.get(job.name)
        return run.allocation if run is not None else None

    def _place(self, job: Job, allocation: Allocation | None,
               machines: tuple[Machine, ...] | None) -> None:
        run = self.running.get(job.name)
        if run is not None and run.machines == machines:
            return
        if run is not None:
            self._close(job.name)
        if allocation is None or machines is None:
            return
        planned = self.table.running(job.shape, allocation)
        assert planned.plan is not None, "policies only hand out allocations a job fits on"
        self.running[job.name] = _Running(allocation, machines, planned.plan,
                                          planned.tokens_per_s, self.now_s,
                                          self.now_s + self.restart_s)

    def _close(self, name: str) -> None:
        self.segments[name].append(self.running.pop(name).closed(self.now_s))

    def advance(self) -> None:
        next_s = min(self._next_arrival_s(), *map(self._finish_s, self.running), math.inf)
        if math.isinf(next_s):
            waiting = ", ".join(job.name for job in self.active)
            raise InfeasibleError(f"{self.policy.value}: jobs {waiting} can never start "
                                  "(no allocation frees up for them)")
        for name, run in self.running.items():
            trained_s = max(0.0, next_s - max(self.now_s, run.training_from_s))
            self.left[name] -= run.tokens_per_s * trained_s
        self.now_s = next_s
        for job in list(self.active):
            if self.left[job.name] <= DONE_FRACTION * job.tokens and job.name in self.running:
                self._close(job.name)
                self.active.remove(job)
                log.debug("%s done at %.2f h", job.name, self.now_s / HOUR_S)

    def _next_arrival_s(self) -> float:
        return self.pending[0].arrival_h * HOUR_S if self.pending else math.inf

    def _finish_s(self, name: str) -> float:
        run = self.running[name]
        return max(self.now_s, run.training_from_s) + self.left[name] / run.tokens_per_s
