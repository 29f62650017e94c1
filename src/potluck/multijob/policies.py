"""Scheduling policies: which allocation each active job gets, decided at every event.

A policy sees the jobs that have arrived and not finished (in arrival order, each with
the allocation it holds) and returns the allocation of each job that should run
(:class:`~potluck.multijob.allocations.Allocation`, whole machines, never more than the
cluster has). Allocations are drawn from the table's candidates; throughputs come from
potluck's planner through :class:`~potluck.multijob.throughput.ThroughputTable`.

- ``fifo``: first come, first served, without preemption. In arrival order each waiting
  job gets the fastest candidate among the free machines (it may take them all); the
  first job that finds no room makes the later ones wait too.
- ``equal``: heterogeneity-agnostic equal shares, re-divided at every event: each of the
  ``n`` jobs gets up to ``machines // n`` machines (the largest candidate size within its
  share it fits on), node groups taken in the cluster file's order, never by speed.
- ``throughput``: heterogeneity-aware, maximizes the sum of priority-weighted normalized
  throughputs (Gavel's MaxSumThroughput: Narayanan et al., "Heterogeneity-Aware Cluster
  Scheduling Policies for Deep Learning Workloads", OSDI'20).
- ``fair``: heterogeneity-aware max-min fairness on each job's normalized throughput over
  its priority (Gavel's LAS policy).
- ``jct``: heterogeneity-aware shortest remaining time first, for average job completion
  time, which neither fifo nor Gavel's two objectives minimize. Jobs are admitted shortest
  first (remaining tokens over their best rate per machine on any node group, over their
  priority; AlloX orders jobs by processing time on heterogeneous devices: Le et al.,
  "AlloX: Compute Allocation in Hybrid Clusters", EuroSys'20; the shortest job on the
  fastest machines is optimal on machines of uniform speeds: Gonzalez, "Optimal mean
  finish time preemptive schedules", 1977). Each job takes whichever finishes it sooner
  of what it holds (if still free) and the smallest allocation it fits in each node
  group, every start or move charged ``restart_s``; a waiting job rather waits if it
  would finish sooner on its fastest group once the first job there ends. Then, as
  Optimus grows jobs (Peng et al., EuroSys'18), the machines left go by the largest cut
  in predicted remaining time per added machine, moves included.

Normalization follows Gavel: throughputs of different models are not comparable, so a
job's throughput ``T(a)`` on allocation ``a`` is divided by what an equal share of
every node group would give it if throughput were linear in machines,
``sum_g machines_g * rate_g / n``, with ``rate_g`` its tokens/s per machine of group
``g`` (:meth:`ThroughputTable.per_machine`). The common ``1/n`` drops out of both
objectives, so ``rho = T(a) / sum_g machines_g * rate_g``.

What is solved differently from Gavel: Gavel solves a linear program over fractions of
time on each accelerator type and realizes it by time-sharing rounds; here allocations
are discrete sets of whole machines held until the next arrival or completion. The two
heterogeneity-aware policies therefore run a greedy then a local search: starting from
nothing, repeatedly apply the move with the best gain per added machine (``throughput``)
or improve the job with the lowest ``rho / priority`` by its best move (``fair``,
water-filling), where a move is a neighbouring candidate (one size up in one node group,
which on small clusters may add machines of another type, or about the same size in
another group); then swap
allocations between pairs of jobs while that raises the objective (the sum, or the
smaller of the two). Jobs beyond the first ``machines`` waiting ones (arrival order) are
not considered at an event by ``throughput`` and ``fair``: at most that many can run
(``jct`` looks at every job, since a short one may arrive last). Keeping the current allocation
counts ``STAY_BONUS`` more, since moving costs a restart.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum

from potluck.multijob.allocations import Allocation, capacity
from potluck.multijob.jobs import Job
from potluck.multijob.throughput import ThroughputTable

TIE = 0.01  # fifo: a larger allocation must be this much faster to be taken
STAY_BONUS = 0.10  # throughput, fair: the current allocation counts this much more
DEFAULT_RESTART_S = 120.0  # a (re)start: checkpoint load, rendezvous, first steps
MIN_GAIN = 1e-9
SWAP_PASSES = 3


class Policy(str, Enum):
    FIFO = "fifo"
    EQUAL = "equal"
    THROUGHPUT = "throughput"
    FAIR = "fair"
    JCT = "jct"


@dataclass(frozen=True)
class Active:
    """A job that has arrived and not finished, with the allocation it holds (if any) and
    the tokens it has left to train (all of them when not given: ``schedule --run`` does
    not read its runs' progress, so there ``jct`` orders jobs by their whole size)."""

    job: Job
    current: Allocation | None = None
    remaining_tokens: float | None = None

    @property
    def tokens_left(self) -> float:
        return float(self.job.tokens) if self.remaining_tokens is None else self.remaining_tokens


Decision = dict[str, Allocation]  # job name -> its allocation; jobs left out wait


def allocate(policy: Policy, active: Sequence[Active], table: ThroughputTable,
             restart_s: float = DEFAULT_RESTART_S) -> Decision:
    """The allocation of each job of ``active`` (arrival order) that should run now;
    ``jct`` charges ``restart_s`` to every start or move."""
    if policy is Policy.FIFO:
        return _fifo(active, table)
    if policy is Policy.EQUAL:
        return _equal(active, table)
    if policy is Policy.JCT:
        return _JctSearch(list(active), table, restart_s).run()
    considered = _considered(active, table)
    search = _Search(considered, table, fair=policy is Policy.FAIR)
    return search.run()


def _fifo(active: Sequence[Active], table: ThroughputTable) -> Decision:
    decision = {a.job.name: a.current for a in active if a.current is not None}
    free = _free(table, decision.values())
    for waiting in (a for a in active if a.current is None):
        best = _fastest(waiting.job, free, table)
        if best is None:
            break
        decision[waiting.job.name] = best
        _take(free, best)
    return decision


def _fastest(job: Job, free: dict[str, int], table: ThroughputTable) -> Allocation | None:
    """The fastest candidate on ``free`` machines (the smaller one unless faster by TIE)."""
    best, best_tps = None, 0.0
    for allocation in table.candidates:  # fewest machines first
        if allocation.fits(free):
            tps = table.tokens_per_s(job.shape, allocation)
            if tps > best_tps * (1 + TIE):
                best, best_tps = allocation, tps
    return best


def _equal(active: Sequence[Active], table: ThroughputTable) -> Decision:
    share = max(1, sum(capacity(table.spec).values()) // max(1, len(active)))
    free = capacity(table.spec)
    decision: Decision = {}
    for entry in active:
        chosen = _equal_share(entry, share, free, table)
        if chosen is not None:
            decision[entry.job.name] = chosen
            _take(free, chosen)
    return decision


def _equal_share(entry: Active, share: int, free: dict[str, int],
                 table: ThroughputTable) -> Allocation | None:
    """The largest single-group candidate within ``share`` machines the job fits on, groups
    in file order (its own group first, to stay put); else the smallest it fits on."""
    groups = [g.name for g in table.spec.nodes]
    if entry.current is not None and len(entry.current.groups) == 1:
        groups.insert(0, groups.pop(groups.index(entry.current.groups[0])))
    singles = [a for a in table.candidates if len(a.groups) == 1 and a.fits(free)]
    for group in groups:
        within = [a for a in singles if a.groups == (group,) and a.num_machines <= share]
        for allocation in sorted(within, key=lambda a: -a.num_machines):
            if table.tokens_per_s(entry.job.shape, allocation) > 0:
                return allocation
    return next((a for a in singles if table.tokens_per_s(entry.job.shape, a) > 0), None)


def _considered(active: Sequence[Active], table: ThroughputTable) -> list[Active]:
    """Running jobs and the first ``machines`` waiting ones, in arrival order."""
    room = sum(capacity(table.spec).values())
    waiting = [a for a in active if a.current is None][:room]
    keep = {id(a) for a in waiting}
    return [a for a in active if a.current is not None or id(a) in keep]


def _free(table: ThroughputTable, held: Iterable[Allocation]) -> dict[str, int]:
    free = capacity(table.spec)
    for allocation in held:
        _take(free, allocation)
    return free


def _take(free: dict[str, int], allocation: Allocation, sign: int = 1) -> None:
    for group, count in allocation.machines:
        free[group] -= sign * count


class _Search:
    """The greedy and local search of the heterogeneity-aware policies (module docstring)."""

    def __init__(self, active: list[Active], table: ThroughputTable, *, fair: bool) -> None:
        self.active = active
        self.table = table
        self.fair = fair
        self.held: dict[str, Allocation | None] = {a.job.name: None for a in active}
        self.free = capacity(table.spec)
        self.scale = {a.job.name: self._linear_rate(a.job) for a in active}
        self._moves: dict[str, tuple[float, Allocation] | None] = {}

    def run(self) -> Decision:
        self._greedy()
        self._swaps()
        return {name: held for name, held in self.held.items() if held is not None}

    # -- the objective ---------------------------------------------------------------
    def _linear_rate(self, job: Job) -> float:
        """sum over groups of machines * tokens/s per machine: the normalizer."""
        total = sum(g.count * self.table.per_machine(job.shape, g.name)
                    for g in self.table.spec.nodes)
        return total or 1.0

    def value(self, entry: Active, allocation: Allocation | None) -> float:
        """``rho`` of ``entry`` on ``allocation``, over its priority for ``fair``, times it for
        ``throughput``; the current allocation counts STAY_BONUS more."""
        rho = self.table.tokens_per_s(entry.job.shape, allocation) / self.scale[entry.job.name]
        if allocation is not None and allocation == entry.current:
            rho *= 1 + STAY_BONUS
        return rho / entry.job.priority if self.fair else rho * entry.job.priority

    # -- moves -----------------------------------------------------------------------
    def neighbours(self, entry: Active) -> list[Allocation]:
        """Candidates one step from what ``entry`` holds, that fit what is free."""
        held = self.held[entry.job.name]
        room = dict(self.free)
        if held is not None:
            _take(room, held, sign=-1)
        fitting = [a for a in self.table.candidates if a.fits(room) and a != held]
        shape = entry.job.shape
        return _steps(held, fitting, [g.name for g in self.table.spec.nodes],
                      lambda a: self.table.tokens_per_s(shape, a) > 0)

    def best_move(self, entry: Active) -> tuple[float, Allocation] | None:
        """``(score, allocation)`` of the best improving move: gain per added machine (moves
        that add none first)."""
        held = self.held[entry.job.name]
        now = self.value(entry, held)
        added_before = held.num_machines if held is not None else 0
        best = None
        for allocation in self.neighbours(entry):
            gain = self.value(entry, allocation) - now
            if gain <= MIN_GAIN:
                continue
            added = allocation.num_machines - added_before
            score = gain * 1e6 if added <= 0 else gain / added
            if best is None or score > best[0]:
                best = (score, allocation)
        return best

    def _cached_move(self, entry: Active) -> tuple[float, Allocation] | None:
        name = entry.job.name
        move = self._moves.get(name)
        if name not in self._moves or (move is not None and not self._fits(entry, move[1])):
            move = self._moves[name] = self.best_move(entry)
        return move

    def _fits(self, entry: Active, allocation: Allocation) -> bool:
        room = dict(self.free)
        held = self.held[entry.job.name]
        if held is not None:
            _take(room, held, sign=-1)
        return allocation.fits(room)

    def _apply(self, entry: Active, allocation: Allocation) -> None:
        held = self.held[entry.job.name]
        if held is not None:
            _take(self.free, held, sign=-1)
        _take(self.free, allocation)
        self.held[entry.job.name] = allocation
        self._moves.pop(entry.job.name, None)
        if held is not None and not _contains(allocation, held):
            self._moves.clear()  # machines came free: other jobs' moves may be better now

    # -- greedy ------------------------------------------------------------------------
    def _greedy(self) -> None:
        pick = self._poorest if self.fair else self._steepest
        while (chosen := pick()) is not None:
            self._apply(*chosen)

    def _steepest(self) -> tuple[Active, Allocation] | None:
        best = None
        for entry in self.active:
            move = self._cached_move(entry)
            if move is not None and (best is None or move[0] > best[0]):
                best = (move[0], entry, move[1])
        return None if best is None else (best[1], best[2])

    def _poorest(self) -> tuple[Active, Allocation] | None:
        best = None
        for entry in self.active:
            move = self._cached_move(entry)
            if move is None:
                continue
            level = self.value(entry, self.held[entry.job.name])
            if best is None or level < best[0]:
                best = (level, entry, move[1])
        return None if best is None else (best[1], best[2])

    # -- local search --------------------------------------------------------------------
    def _swaps(self) -> None:
        running = [a for a in self.active if self.held[a.job.name] is not None]
        combine: Callable[[float, float], float] = min if self.fair else _plus
        for _ in range(SWAP_PASSES):
            swapped = False
            for i, first in enumerate(running):
                for second in running[i + 1:]:
                    swapped |= self._swap_if_better(first, second, combine)
            if not swapped:
                return

    def _swap_if_better(self, first: Active, second: Active,
                        combine: Callable[[float, float], float]) -> bool:
        a, b = self.held[first.job.name], self.held[second.job.name]
        if a == b:
            return False
        now = combine(self.value(first, a), self.value(second, b))
        after = combine(self.value(first, b), self.value(second, a))
        if after <= now * (1 + MIN_GAIN) + MIN_GAIN:
            return False
        self.held[first.job.name], self.held[second.job.name] = b, a
        return True


def _plus(a: float, b: float) -> float:
    return a + b


def _contains(big: Allocation, small: Allocation) -> bool:
    counts = big.counts
    return all(counts.get(group, 0) >= count for group, count in small.machines)


def _steps(held: Allocation | None, fitting: list[Allocation], groups: list[str],
           fits_job: Callable[[Allocation], bool]) -> list[Allocation]:
    """Of ``fitting`` (fewest machines first), the moves one step from ``held``: from nothing,
    the smallest of each group the job fits on; else the smallest growth of each one group
    (more machines of a group it holds, or some of a group it does not, where candidates
    mix groups), and for a job on one group the nearest size it fits on in each other."""
    singles = {g: [a for a in fitting if a.groups == (g,)] for g in groups}
    if held is None:
        return [a for options in singles.values() if (a := _first(options, fits_job))]
    grown: dict[str, Allocation] = {}
    for allocation in fitting:
        changed = _changed_groups(held, allocation)
        if len(changed) == 1 and _contains(allocation, held) and changed[0] not in grown:
            grown[changed[0]] = allocation
    moves = list(grown.values())
    if len(held.groups) == 1:
        for group, options in singles.items():
            if group != held.groups[0]:
                nearest = sorted(options, key=lambda a: (abs(a.num_machines - held.num_machines),
                                                         a.num_machines))
                if (found := _first(nearest, fits_job)) is not None:
                    moves.append(found)
    return moves


def _changed_groups(before: Allocation, after: Allocation) -> list[str]:
    counts = before.counts
    return [group for group, count in after.machines if count != counts.get(group, 0)]


def _first(options: list[Allocation], fits_job: Callable[[Allocation], bool]) -> Allocation | None:
    """The first of ``options`` the job fits on (asked in order: each may cost a search)."""
    return next((a for a in options if fits_job(a)), None)


class _JctSearch(_Search):
    """``jct``: shortest remaining time first, then growth by remaining time saved per
    added machine (module docstring). A job's value is minus its predicted remaining
    time (times its priority), a restart included on any allocation but the one it holds."""

    def __init__(self, active: list[Active], table: ThroughputTable, restart_s: float) -> None:
        super().__init__(active, table, fair=False)
        self.restart_s = restart_s

    def run(self) -> Decision:
        for entry in sorted(self.active, key=self._urgency):
            choice = self._admission(entry)
            if choice is not None:
                self._apply(entry, choice)
        self.active = [a for a in self.active if self.held[a.job.name] is not None]
        self._moves.clear()
        self._greedy()
        return {name: held for name, held in self.held.items() if held is not None}

    def value(self, entry: Active, allocation: Allocation | None) -> float:
        return -self._left_s(entry, allocation) * entry.job.priority

    def _left_s(self, entry: Active, allocation: Allocation | None) -> float:
        """Predicted seconds until ``entry`` is done on ``allocation``, a restart included
        unless it is the allocation the job holds."""
        tokens_per_s = self.table.tokens_per_s(entry.job.shape, allocation)
        if tokens_per_s <= 0:
            return math.inf
        restart_s = 0.0 if allocation == entry.current else self.restart_s
        return entry.tokens_left / tokens_per_s + restart_s

    def _urgency(self, entry: Active) -> float:
        """Remaining tokens over the job's best rate per machine, plus a start for a job
        that is not running, over its priority."""
        rate = max(self.table.per_machine(entry.job.shape, g.name) for g in self.table.spec.nodes)
        left_s = entry.tokens_left / rate if rate > 0 else math.inf
        if entry.current is None:
            left_s += self.restart_s
        return left_s / entry.job.priority

    def _admission(self, entry: Active) -> Allocation | None:
        """The best (sooner done, a restart counted) of what the job holds, if still free,
        and the smallest allocation it fits in each node group; a waiting job rather waits
        if it would finish sooner on its fastest group once the first job there ends."""
        options = self.neighbours(entry)  # from nothing: the smallest of each group it fits
        if entry.current is not None and self._fits(entry, entry.current):
            options.append(entry.current)
        best = max(options, key=lambda a: self.value(entry, a), default=None)
        if best is None or (entry.current is None and self._waiting_is_sooner(entry)):
            return None
        return best

    def _waiting_is_sooner(self, entry: Active) -> bool:
        shape = entry.job.shape
        rates = {g.name: self.table.per_machine(shape, g.name) for g in self.table.spec.nodes}
        fastest = max(rates, key=rates.__getitem__)
        ends_s = [self._left_s(other, held) for other in self.active
                  if (held := self.held[other.job.name]) is not None and fastest in held.groups]
        now = _fastest(entry.job, self.free, self.table)
        if not ends_s or now is None or rates[fastest] <= 0:
            return False
        wait_s = min(ends_s) + entry.tokens_left / rates[fastest]
        return wait_s < entry.tokens_left / self.table.tokens_per_s(shape, now)
