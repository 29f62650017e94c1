"""A job's throughput on an allocation, from potluck's own planner, remembered.

:class:`ThroughputTable` plans a job shape on the sub-cluster of an allocation with
:func:`potluck.planner.search.search` (the same search as ``potluck plan``) and keeps the
best plan under ``(shape, allocation)``: every policy and every event of a simulation asks
again for the same pairs, and one search takes 0.1 to a few seconds. The searches go
through a :class:`~potluck.planner.requests.memo.PlanMemo`: allocations of node groups
built alike (two racks of the same machines) are searched once, and the reason a shape
fits nowhere names host memory where that is the limit. :meth:`ThroughputTable.expect`
says which shapes will be asked for, so that each search can be reported against how many
there can be. Tokens per second are ``global_batch * seq_len`` over the plan's predicted
iteration time; an allocation the job does not fit on (memory) has none. The policies
compare allocations by the first memory level's plans (:data:`SEARCH_OPTIONS`); the plan a
job runs on the allocation it is given (:meth:`ThroughputTable.running`) is searched as
``potluck plan`` searches it, so the two agree.

:meth:`ThroughputTable.per_machine` is a job's rate on one node group when its throughput
there is counted as if linear in machines (the smallest allocation of the group it fits
on, divided by its machines): the figure Gavel's throughput matrix holds per accelerator
type, which :mod:`potluck.multijob.policies` uses to normalize throughputs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from potluck.cluster.spec import ClusterSpec
from potluck.errors import PotluckError
from potluck.multijob.allocations import (
    Allocation,
    candidate_allocations,
    subcluster,
    whole_cluster,
)
from potluck.multijob.jobs import JobShape
from potluck.planner.options import SearchOptions
from potluck.planner.requests.host_limit import host_memory_limit
from potluck.planner.requests.memo import PlanMemo
from potluck.plans import Plan

log = logging.getLogger(__name__)

# every job shape is planned on dozens of allocations: the first ZeRO stage that fits (the
# search's deeper ZeRO pass doubled the planning of a 120-job trace on 256 GPUs, to 69 s);
# the allocation a job is given is then searched as ``potluck plan`` searches it
# (:meth:`ThroughputTable.running`), so the two agree on the plan a job runs
SEARCH_OPTIONS = SearchOptions(top_k=1, sharded_levels=False)


@dataclass(frozen=True)
class Planned:
    """The best plan of a shape on an allocation, or why there is none."""

    plan: Plan | None
    tokens_per_s: float = 0.0
    refusal: str = ""


PlanProgress = Callable[[int, int, str], None]  # (searches done, at most, the last; 0 first)


class ThroughputTable:
    """Plans, and their throughputs, of job shapes on allocations of one cluster."""

    def __init__(self, spec: ClusterSpec, options: SearchOptions = SEARCH_OPTIONS) -> None:
        self.spec = spec
        self.options = options
        self.candidates = candidate_allocations(spec)
        self._planned: dict[tuple[JobShape, Allocation], Planned] = {}
        self._running: dict[tuple[JobShape, Allocation], Planned] = {}
        # allocations of the same shape are searched once; only a shape that fits nowhere
        # needs its reason explained (refusal)
        self.memo = PlanMemo(explain=False)
        self._progress: PlanProgress | None = None
        self._searched, self._bound = 0, 0
        self.planner_calls = 0
        self.planner_time_s = 0.0

    def expect(self, shapes: Iterable[JobShape], progress: PlanProgress | None) -> None:
        """Report every search from now on to ``progress(done, bound, what)``: ``bound`` is
        how many there can be, every pair of one of ``shapes`` and a candidate allocation
        (the policies ask for those they need, often fewer)."""
        left = {(shape, allocation) for shape in shapes for allocation in self.candidates
                if (shape, allocation) not in self._planned}
        self._progress, self._bound = progress, self._searched + len(left)
        if progress is not None and left:
            progress(self._searched, self._bound, "")

    def planned(self, shape: JobShape, allocation: Allocation) -> Planned:
        key = (shape, allocation)
        if key not in self._planned:
            self._planned[key] = self._plan(shape, allocation)
            self._searched += 1
            if self._progress is not None:
                self._progress(self._searched, max(self._bound, self._searched),
                               f"{shape.model.name} on {allocation.label()}")
        return self._planned[key]

    def tokens_per_s(self, shape: JobShape, allocation: Allocation | None) -> float:
        return 0.0 if allocation is None else self.planned(shape, allocation).tokens_per_s

    def running(self, shape: JobShape, allocation: Allocation) -> Planned:
        """The plan ``shape`` runs once given ``allocation``: the search ``potluck plan``
        makes there (on through the ZeRO and offload levels where they may pay), or the
        first level's plan if that is as fast. The policies compare allocations by
        :meth:`planned`, searched for every pair; this deeper search is made only for the
        allocations jobs are given."""
        key = (shape, allocation)
        if key not in self._running:
            first = self.planned(shape, allocation)
            deeper = replace(self.options, sharded_levels=True)
            found = first if first.plan is None or deeper == self.options else \
                self._plan(shape, allocation, deeper)
            self._running[key] = found if found.tokens_per_s > first.tokens_per_s else first
        return self._running[key]

    def plan(self, shape: JobShape, allocation: Allocation) -> Plan:
        planned = self.running(shape, allocation)
        if planned.plan is None:
            raise PotluckError(f"{shape.model.name} does not fit on {allocation.machines}: "
                               f"{planned.refusal}")
        return planned.plan

    def per_machine(self, shape: JobShape, group: str) -> float:
        """Tokens/s per machine of ``group`` on the smallest of its allocations that fits."""
        for allocation in self.candidates:
            if allocation.groups == (group,):
                tokens_per_s = self.tokens_per_s(shape, allocation)
                if tokens_per_s > 0:
                    return tokens_per_s / allocation.num_machines
        return 0.0

    def refusal(self, shape: JobShape) -> str | None:
        """None when the shape fits on some candidate allocation, else why it fits nowhere
        (the planner's reason on the whole cluster)."""
        if any(self.tokens_per_s(shape, a) > 0 for a in self.candidates):
            return None
        whole = whole_cluster(self.spec)
        reason = host_memory_limit(subcluster(self.spec, whole), shape.model, shape.training,
                                   self.options)
        return reason or self.planned(shape, whole).refusal or "no plan fits"

    def _plan(self, shape: JobShape, allocation: Allocation,
              options: SearchOptions | None = None) -> Planned:
        started = time.perf_counter()
        self.planner_calls += 1
        try:
            result = self.memo.search(subcluster(self.spec, allocation), shape.model,
                                       shape.training, options or self.options)
        except PotluckError as err:
            return Planned(None, refusal=str(err))
        finally:
            self.planner_time_s += time.perf_counter() - started
        best = result.best
        assert best.prediction is not None  # the search predicts every plan it returns
        tokens_per_s = shape.tokens_per_iteration / best.prediction.iteration_time_s
        log.debug("%s on %s: %s, %.0f tokens/s", shape.model.name, allocation.machines,
                  best.layout(), tokens_per_s)
        return Planned(best, tokens_per_s)
