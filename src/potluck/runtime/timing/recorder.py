"""Tracing a training run: real per-op timings of a few steps, merged into ``DIR/trace.json``.

:class:`OpRecorder` is a :class:`~potluck.runtime.timing.clock.Clock`, like the
emulation clock: the schedule, the gradient sync and the trainer hand it every
op (``run(kind, stage_id, fn)``). It passes each op on to the clock it wraps
(so an emulated op is recorded with its padding) and, during the traced steps,
notes when the op started and ended: forward, backward
(``backward_input``/``backward_weight`` under zero bubble) and optimizer on the
``compute`` stream, the gradient all-reduce (``dp_allreduce``) and the
schedule's send/receive waits (:mod:`potluck.runtime.timing.p2p_waits`) and the
exchanges across islands (``outer_sync``: from their start to when the runtime has their
result, which for an overlapped one is some inner steps later) on ``comm``; each event is
named by its :class:`~potluck.ops.OpKind`'s value.
Micro-batches are numbered by counting: torch runs each virtual stage's
forwards (and backwards) in micro-batch order.

Times are wall-clock seconds from a common origin taken right after a
barrier (every rank leaves it together), or CUDA events on GPUs (the time
the kernels ran, not when they were queued). After the last traced step
every rank sends its events to rank 0, which writes them in the shared trace
format (:mod:`potluck.traces`) with ``"source": "runtime"`` and, when
emulating, the dilation. When tracing is off no recorder exists and nothing
changes; after the traced steps the recorder only passes ops through.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from potluck.ops import OpKind
from potluck.runtime.layout import Layout
from potluck.runtime.timing.clock import Clock, CommOp, NullClock, Segment, Waitable
from potluck.runtime.timing.p2p_waits import P2PTag, P2PTagger, timing_p2p_waits
from potluck.traces import COMM, COMPUTE, Trace, TraceEvent, write_trace

log = logging.getLogger(__name__)
T = TypeVar("T")
TRACE_FILE = "trace.json"
WARMUP_STEPS = 2  # traced steps start after these (the first steps warm caches up)


class WallTimer:
    """Host wall clock (CPU ranks)."""

    def origin(self) -> None:
        self._origin_s = time.perf_counter()

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, mark: float) -> float:
        return mark - self._origin_s


class CudaTimer:
    """CUDA events on the current stream: when the queued work actually ran."""

    def origin(self) -> None:
        torch.cuda.synchronize()
        self._origin = self.mark()

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, mark: torch.cuda.Event) -> float:
        return self._origin.elapsed_time(mark) / 1e3


@dataclass(frozen=True)
class TraceWindow:
    """The traced steps: ``[first_step, first_step + steps)``."""

    first_step: int
    steps: int

    @classmethod
    def after_warmup(cls, step: int, total_steps: int, steps: int) -> TraceWindow:
        """``steps`` steps after a short warm-up, moved earlier when the run is shorter."""
        remaining = max(0, total_steps - step)
        count = min(steps, remaining)
        return cls(step + min(WARMUP_STEPS, remaining - count), count)

    @property
    def last_step(self) -> int:
        return self.first_step + self.steps - 1

    def __contains__(self, step: int) -> bool:
        return self.first_step <= step <= self.last_step


@dataclass(frozen=True)
class _Record:
    kind: OpKind
    stage_id: int
    micro_batch: int
    step: int
    start: Any
    end: Any


class OpRecorder:
    """Records this rank's ops during the traced steps; passes them to ``inner``."""

    def __init__(self, layout: Layout, inner: Clock = NullClock(), use_gpu: bool = False
                 ) -> None:
        self.layout = layout
        self.inner = inner
        self.timer = CudaTimer() if use_gpu else WallTimer()
        self.window: TraceWindow | None = None
        self.step = 0
        self.done = False
        self._records: list[_Record] = []
        self._counts: dict[tuple[OpKind, int], int] = defaultdict(int)
        self._tagger = P2PTagger()
        self._patches = ExitStack()

    @property
    def dilation(self) -> float:
        """The emulation's time stretch (1 when not emulating)."""
        return self.inner.dilation

    @property
    def recording(self) -> bool:
        return self.window is not None and not self.done and self.step in self.window

    def start(self, window: TraceWindow, step: int) -> None:
        """Trace ``window``; the next step run is ``step``. Every rank calls this together."""
        self.window, self.step = window, step
        dist.barrier()
        self.timer.origin()
        self._patches.enter_context(timing_p2p_waits(self._tagger, self._on_wait, self.timer.mark))

    def run(self, kind: OpKind, stage_id: int, fn: Callable[[], T]) -> T:
        """Run ``fn`` (through the inner clock); note its start and end while tracing."""
        if not self.recording:
            return self.inner.run(kind, stage_id, fn)
        start = self.timer.mark()
        result = self.inner.run(kind, stage_id, fn)
        key = (kind, stage_id)
        micro_batch = self._counts[key] if stage_id != -1 else -1
        self._counts[key] += 1
        self._records.append(_Record(kind, stage_id, micro_batch, self.step, start,
                                     self.timer.mark()))
        return result

    def tag_p2p(self, ops: list[Any], kind: OpKind, stage_id: int, micro_batch: int
                ) -> list[Any]:
        """Name the point-to-point ops a stage is about to post (see
        :mod:`potluck.runtime.timing.p2p_waits`)."""
        ops = self.inner.tag_p2p(ops, kind, stage_id, micro_batch)
        return self._tagger.tag(ops, kind, stage_id, micro_batch) if self.recording else ops

    def start_comm(self, op: CommOp, work: Waitable) -> Waitable:
        """Pass the collective on; an exchange across islands is recorded until waited for."""
        waited = self.inner.start_comm(op, work)
        if not self.recording or op.kind is not OpKind.OUTER_SYNC:
            return waited
        return _RecordedWait(self, op, waited, self.step, self.timer.mark())

    def note(self, record: _Record) -> None:
        """A record that ends now, kept unless the trace was written already."""
        if not self.done:
            self._records.append(record)

    def run_segment(self, segment: Segment, fn: Callable[[], T]) -> T:
        return self.inner.run_segment(segment, fn)

    def _on_wait(self, tag: P2PTag, start: Any, end: Any) -> None:
        if self.recording:
            self._records.append(_Record(tag.kind, tag.stage_id, tag.micro_batch, self.step,
                                         start, end))

    def end_step(self, step: int, out_dir: str | Path | None) -> None:
        """Step ``step`` is over; after the last traced one, write the trace."""
        self.step = step + 1
        self._counts.clear()
        if self.window is not None and step == self.window.last_step:
            self.finish(out_dir)

    def finish(self, out_dir: str | Path | None) -> None:
        """Merge every rank's events on rank 0 and write ``out_dir/trace.json`` (once)."""
        if self.done or self.window is None:
            return
        self.done = True
        self._patches.close()
        if isinstance(self.timer, CudaTimer):
            torch.cuda.synchronize()
        gathered: list[Any] = [None] * dist.get_world_size() if self.layout.rank == 0 else None
        dist.gather_object(self.events(), gathered, dst=0)
        if self.layout.rank == 0 and out_dir is not None:
            trace = self.trace([event for events in gathered for event in events])
            write_trace(trace, Path(out_dir) / TRACE_FILE)
            log.info("trace of steps %d-%d written to %s", self.window.first_step,
                     self.window.last_step, Path(out_dir) / TRACE_FILE)

    def events(self) -> list[TraceEvent]:
        """This rank's records as trace events."""
        role = self.layout.role
        chunks = {stage_id: chunk for chunk, stage_id in enumerate(role.virtual_stage_ids)}
        return [
            TraceEvent(role.device, COMM if r.kind.is_comm else COMPUTE, r.kind.value,
                       self.timer.seconds(r.start),
                       self.timer.seconds(r.end) - self.timer.seconds(r.start),
                       role.pipeline, role.stage, r.micro_batch, chunks.get(r.stage_id, -1), r.step)
            for r in self._records
        ]

    def trace(self, events: list[TraceEvent]) -> Trace:
        plan = self.layout.plan
        emulated = not isinstance(self.inner, NullClock)
        return Trace(list(plan.devices), sorted(events, key=lambda e: e.start_s), metadata={
            "source": "runtime", "layout": plan.layout(), "schedule": plan.schedule.value,
            "steps": [self.window.first_step, self.window.last_step] if self.window else [],
            "emulated": emulated, "dilation": self.dilation if emulated else None,
        })


@dataclass
class _RecordedWait:
    """A collective whose wait ends its record (the exchanges across islands)."""

    recorder: OpRecorder
    op: CommOp
    work: Waitable
    step: int
    start: Any

    def wait(self) -> Any:
        result = self.work.wait()
        self.recorder.note(_Record(self.op.kind, self.op.stage_id, -1, self.step, self.start,
                                   self.recorder.timer.mark()))
        return result


def attach_recorder(model: Any) -> OpRecorder:
    """Route a :class:`~potluck.runtime.parallel_model.ParallelModel`'s ops through
    a new recorder (wrapping its clock)."""
    recorder = OpRecorder(model.layout, model.clock, model.session.use_gpu)
    model.set_clock(recorder)
    return recorder
