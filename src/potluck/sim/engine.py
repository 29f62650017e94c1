"""Discrete-event execution of a :class:`Program`: compute streams and shared links.

A program is a dependency graph of ops. A *compute* op runs on one stream (a
device, or the devices of a tensor-parallel group, which run in lock step)
for a fixed duration, in the stream's program order: it starts when it is at
the head of its stream, the stream is free and all its predecessors have
ended. A *transfer* op is a :class:`~potluck.sim.network.Flow`: it starts as
soon as its predecessors have ended (receives are posted ahead, as torch's
schedule runtime does), waits its latency, then moves its bytes at the
max-min fair share of the resources it crosses; every time a flow joins or
leaves, the rates of the flows it shares resources with (its connected
component, not the whole network) are recomputed. Any op may also carry a
release time before which it does not start.

The engine knows nothing of pipelines; :mod:`potluck.sim.program` builds the
graph, and the caller reads ``start_s``/``end_s`` per op.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from potluck.errors import PotluckError
from potluck.sim.network import Flow, Resource, max_min_rates

_COMPUTE_DONE, _JOIN, _FLOW_DONE, _RELEASE = range(4)


class DeadlockError(PotluckError):
    """The schedule's op order waits on itself (a bug in an order, never a user error)."""


@dataclass
class Program:
    """Ops with their streams or flows, durations, release times and predecessors."""

    num_streams: int = 0
    stream_of: list[int] = field(default_factory=list)  # -1 for a transfer
    duration_s: list[float] = field(default_factory=list)
    flow_of: list[Flow | None] = field(default_factory=list)
    release_s: list[float] = field(default_factory=list)
    preds: list[list[int]] = field(default_factory=list)
    stream_order: list[list[int]] = field(default_factory=list)

    def add_stream(self) -> int:
        self.stream_order.append([])
        self.num_streams += 1
        return self.num_streams - 1

    def add_compute(self, stream: int, duration_s: float, preds: list[int]) -> int:
        op = self._add(stream, duration_s, None, preds, 0.0)
        self.stream_order[stream].append(op)
        return op

    def add_transfer(self, flow: Flow, preds: list[int], release_s: float = 0.0) -> int:
        return self._add(-1, 0.0, flow, preds, release_s)

    def _add(self, stream: int, duration_s: float, flow: Flow | None, preds: list[int],
             release_s: float) -> int:
        self.stream_of.append(stream)
        self.duration_s.append(duration_s)
        self.flow_of.append(flow)
        self.release_s.append(release_s)
        self.preds.append(preds)
        return len(self.stream_of) - 1

    def __len__(self) -> int:
        return len(self.stream_of)


@dataclass
class Timings:
    """When each op of a program started and ended (a transfer starts when its latency does),
    and what it waited for last: the predecessor, or the op before it on its stream, whose
    end let it start (-1 if nothing held it back). Following ``cause`` back from the last op
    walks the critical path."""

    start_s: list[float]
    end_s: list[float]
    cause: list[int]


def run(program: Program, capacity: dict[Resource, float]) -> Timings:
    """Execute ``program`` and return every op's start and end time."""
    return _Execution(program, capacity).run()


class _Execution:
    def __init__(self, program: Program, capacity: dict[Resource, float]) -> None:
        n = len(program)
        self.p = program
        self.waiting = [len(preds) for preds in program.preds]
        self.succs: list[list[int]] = [[] for _ in range(n)]
        for op, preds in enumerate(program.preds):
            for pred in preds:
                self.succs[pred].append(op)
        self.start_s = [float("nan")] * n
        self.end_s = [float("nan")] * n
        self.ready = [False] * n
        self.cause = [-1] * n
        self.previous = [-1] * program.num_streams  # the op that last ended on each stream
        self.head = [0] * program.num_streams
        self.busy = [False] * program.num_streams
        self.heap: list[tuple[float, int, int, int, int]] = []
        self.seq = itertools.count()
        self.links = _SharedLinks(capacity)

    def run(self) -> Timings:
        for op, count in enumerate(self.waiting):
            if count == 0:
                self._unblocked(op, 0.0)
        while self.heap:
            time_s, _, event, op, version = heapq.heappop(self.heap)
            self._handle(event, op, version, time_s)
        done = sum(1 for t in self.end_s if t == t)
        if done != len(self.p):
            raise DeadlockError(f"simulation stalled: {len(self.p) - done} ops never ran")
        return Timings(self.start_s, self.end_s, self.cause)

    def _push(self, time_s: float, event: int, op: int, version: int = 0) -> None:
        heapq.heappush(self.heap, (time_s, next(self.seq), event, op, version))

    def _handle(self, event: int, op: int, version: int, time_s: float) -> None:
        if event == _COMPUTE_DONE:
            stream = self.p.stream_of[op]
            self.busy[stream] = False
            self.head[stream] += 1
            self.previous[stream] = op
            self._finish(op, time_s)
            self._try_start(stream, time_s)
        elif event == _JOIN:
            self._reschedule(self.links.join(op, self.p.flow_of[op], time_s))
        elif event == _FLOW_DONE:
            if self.links.is_current(op, version):
                self._reschedule(self.links.leave(op, time_s))
                self._finish(op, time_s)
        else:
            self._make_ready(op, time_s)

    def _unblocked(self, op: int, time_s: float) -> None:
        release = self.p.release_s[op]
        if release > time_s:
            self._push(release, _RELEASE, op)
        else:
            self._make_ready(op, time_s)

    def _make_ready(self, op: int, time_s: float) -> None:
        self.ready[op] = True
        stream = self.p.stream_of[op]
        if stream >= 0:
            self._try_start(stream, time_s)
            return
        self.start_s[op] = time_s
        flow = self.p.flow_of[op]
        self._push(time_s + flow.latency_s, _JOIN, op)

    def _try_start(self, stream: int, time_s: float) -> None:
        order = self.p.stream_order[stream]
        if self.busy[stream] or self.head[stream] >= len(order):
            return
        op = order[self.head[stream]]
        if self.ready[op]:
            previous = self.previous[stream]
            if previous >= 0 and (self.cause[op] < 0 or self.end_s[previous] >= time_s):
                self.cause[op] = previous  # it was ready before its stream was free
            self.busy[stream] = True
            self.start_s[op] = time_s
            self._push(time_s + self.p.duration_s[op], _COMPUTE_DONE, op)

    def _finish(self, op: int, time_s: float) -> None:
        self.end_s[op] = time_s
        for succ in self.succs[op]:
            self.waiting[succ] -= 1
            if self.waiting[succ] == 0:
                self.cause[succ] = op
                self._unblocked(succ, time_s)

    def _reschedule(self, finishes: list[tuple[int, float, int]]) -> None:
        for op, time_s, version in finishes:
            self._push(time_s, _FLOW_DONE, op, version)


class _SharedLinks:
    """Flows in their bandwidth phase, their remaining bytes and current rates."""

    def __init__(self, capacity: dict[Resource, float]) -> None:
        self.capacity = capacity
        self.active: dict[int, Flow] = {}
        self.remaining: dict[int, float] = {}
        self.rate: dict[int, float] = {}
        self.since_s: dict[int, float] = {}
        self.version: dict[int, int] = {}
        self.on_resource: dict[Resource, set[int]] = {}

    def is_current(self, op: int, version: int) -> bool:
        return op in self.active and self.version[op] == version

    def join(self, op: int, flow: Flow, time_s: float) -> list[tuple[int, float, int]]:
        self.active[op] = flow
        self.remaining[op] = flow.lane_bytes
        self.rate[op] = 0.0
        self.since_s[op] = time_s
        self.version[op] = self.version.get(op, 0)
        for resource, _ in flow.resources:
            self.on_resource.setdefault(resource, set()).add(op)
        return self._rebalance([op], time_s)

    def leave(self, op: int, time_s: float) -> list[tuple[int, float, int]]:
        flow = self.active.pop(op)
        neighbours: set[int] = set()
        for resource, _ in flow.resources:
            flows = self.on_resource[resource]
            flows.discard(op)
            neighbours |= flows
        return self._rebalance(sorted(neighbours), time_s)

    def _component(self, seeds: list[int]) -> set[int]:
        seen, todo = set(seeds), list(seeds)
        while todo:
            for resource, _ in self.active[todo.pop()].resources:
                for other in self.on_resource[resource]:
                    if other not in seen:
                        seen.add(other)
                        todo.append(other)
        return seen

    def _rebalance(self, seeds: list[int], time_s: float) -> list[tuple[int, float, int]]:
        component = self._component(seeds)
        for op in component:
            self.remaining[op] -= self.rate[op] * (time_s - self.since_s[op])
            self.since_s[op] = time_s
        rates = max_min_rates({op: self.active[op] for op in component}, self.capacity)
        finishes = []
        for op, rate in rates.items():
            self.rate[op] = rate
            self.version[op] += 1
            left = max(0.0, self.remaining[op])
            finishes.append((op, time_s + (left / rate if left > 0 else 0.0), self.version[op]))
        return finishes
