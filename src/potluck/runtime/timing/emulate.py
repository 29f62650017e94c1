"""Emulation: run a plan made for other devices on this machine's CPU, at their speed.

Each rank runs its real computation on CPU (so numerics are exactly those of
a real run) and then sleeps until the op has taken as long as the cost model
predicts for the plan's device, stretched by one global **dilation** factor:
``target = dilation x predicted``. The dilation makes the CPU fast enough
relative to the emulated devices: it is calibrated (:func:`needed_dilation`, times a
margin, the largest over all ranks) so that the ops that still overrun their targets add
at most :data:`OVERRUN_BUDGET` of the stretched time, so the CPU is never the bottleneck
and relative speeds (an A100 stage against a 3090 stage) are the cost model's. Not every
op must finish before its target: a tiny op (a sub-batch piece of the explicit TP
executor, predicted at a few microseconds) costs the CPU its fixed Python and dispatch
overhead however small it is, so covering the slowest op's ratio would stretch every
other op, and the run, tens of times more than the emulation needs. Measured
step times are then compared with ``dilation x`` the predicted step time.

What each op should take comes from the one cost model
(:mod:`potluck.runtime.timing.targets`). Communication that the runtime overlaps with
compute is emulated beside it rather than padded into it, so that what overlaps, and what
waits, is what the runtime's own order of ops makes it:

- the explicit TP executor's pieces (:meth:`EmulationClock.run_segment`) run nested inside
  their stage's op, each padded on its own, and the op keeps only the rest of its time;
- asynchronous collectives the runtime starts (:meth:`EmulationClock.start_comm`: the
  executor's all-reduces, the priority schedule's parameter all-gathers) take their
  predicted time on the rank's channel for their kind (one in-order stream, as NCCL runs a
  communicator), and the runtime's wait on one lasts until it is over; so do the exchanges
  across islands (``outer_sync``: a blocking DiLoCo exchange waits at once, streaming
  fragments and bounded pushes overlap the inner steps that follow);
- with split pipeline channels the transfers between stages are timed on their channels
  (:mod:`potluck.runtime.timing.p2p_emulation`); otherwise they are padded into the
  compute ops that torch's schedule blocks in.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from potluck.ops import OpKind
from potluck.plans import Plan
from potluck.runtime.layout import Layout
from potluck.runtime.timing.clock import CommOp, Segment, Waitable
from potluck.runtime.timing.p2p_emulation import P2PEmulation, emulating_p2p, sleep_until
from potluck.runtime.timing.targets import OpTargets, RankTargets, rank_targets
from potluck.runtime.timing.targets import predict as predict  # re-exported
from potluck.runtime.timing.targets import stage_targets as stage_targets  # re-exported

log = logging.getLogger(__name__)
T = TypeVar("T")
CALIBRATION_MARGIN = 1.5
OVERRUN_BUDGET = 0.05  # what overrunning ops may add to a rank's stretched time
BISECTIONS = 40  # needed_dilation's search: to 1e-12 of the slowest op's ratio
__all__ = ["EmulationClock", "OpTargets", "emulate", "needed_dilation", "predict",
           "stage_targets"]


class _EmulatedWork:
    """A collective's handle whose wait also lasts until its emulated end."""

    def __init__(self, clock: EmulationClock, work: Waitable, end_s: float) -> None:
        self.clock, self.work, self.end_s = clock, work, end_s

    def wait(self) -> Any:
        began = time.perf_counter()
        result = self.work.wait()
        sleep_until(self.end_s)
        self.clock.exclude(time.perf_counter() - began)
        return result


class EmulationClock:
    """Times each op of this rank and pads it to ``dilation x predicted`` (a
    :class:`~potluck.runtime.timing.clock.Clock`)."""

    def __init__(self, targets: dict[int, OpTargets] | RankTargets, dp_sync_s: float = 0.0,
                 optimizer_s: float = 0.0, dilation: float | None = None) -> None:
        if not isinstance(targets, RankTargets):
            targets = RankTargets(targets, dp_sync_s, optimizer_s)
        self.all = targets
        self.targets = targets.stages
        self.dilation = dilation or 0.0
        self.max_ratio = 0.0
        self.slowest: object = None  # the op that set max_ratio
        self.measured: list[tuple[float, float]] = []  # (took_s, predicted_s) while measuring
        self.overruns = 0
        self.p2p = P2PEmulation(targets.sends_s, self.dilation) if targets.sends_s else None
        self._nested: list[float] = []  # per op running: the time its nested ops took
        self._channels: dict[str, float] = {}  # when each collective channel is free
        self._transfers: AbstractContextManager[None] | None = None  # see time_transfers

    @classmethod
    def for_plan(cls, plan: Plan, layout: Layout, dilation: float | None = None
                 ) -> EmulationClock:
        return cls(rank_targets(plan, layout), dilation=dilation)

    def predicted_s(self, kind: OpKind, stage_id: int) -> float:
        if kind is OpKind.DP_ALLREDUCE:
            return self.all.dp_sync_s
        if kind is OpKind.OPTIMIZER:
            return self.all.optimizer_s
        target = self.targets.get(stage_id) or OpTargets(  # WHOLE_RANK: all virtual stages
            sum(t.forward_s for t in self.targets.values()),
            sum(t.backward_s for t in self.targets.values()))
        if kind is OpKind.FORWARD:
            return target.forward_s
        if kind is OpKind.BACKWARD:
            return target.backward_s
        return 0.5 * target.backward_s  # backward_input / backward_weight (zero bubble)

    def segment_s(self, segment: Segment) -> float:
        """A piece of the explicit TP executor: a part of a block for one sub-batch, or a
        boundary collective."""
        pieces = self.all.explicit.get(segment.stage_id)
        if pieces is None:
            return 0.0
        if segment.kind is OpKind.TP_ALLREDUCE:
            return pieces.boundary_s
        block = pieces.blocks[segment.layer - self.all.first_layers.get(segment.stage_id, 0)]
        part = block.attention if segment.part == "attention" else block.mlp
        return part.forward_s if segment.kind is OpKind.FORWARD else part.backward_s

    def run(self, kind: OpKind, stage_id: int, fn: Callable[[], T]) -> T:
        """Run ``fn``; then sleep until it has taken ``dilation x`` its predicted time."""
        measured = kind not in (OpKind.DP_ALLREDUCE, OpKind.OPTIMIZER)
        return self._padded(self.predicted_s(kind, stage_id), fn, measured, (kind, stage_id))

    def run_segment(self, segment: Segment, fn: Callable[[], T]) -> T:
        return self._padded(self.segment_s(segment), fn, segment.kind is not OpKind.TP_ALLREDUCE,
                            segment)

    def _padded(self, predicted_s: float, fn: Callable[[], T], measured: bool,
                what: object = None) -> T:
        """Run ``fn``, pad its own time (less what its nested ops and waits took) to
        ``dilation x predicted_s``; the whole of it counts as nested in the op around it."""
        start_s = time.perf_counter()
        self._nested.append(0.0)
        try:
            result = fn()
        finally:
            nested_s = self._nested.pop()
        elapsed_s = time.perf_counter() - start_s - nested_s
        if predicted_s > 0 and measured:
            self._measure(elapsed_s, predicted_s, what)
        target_s = self.dilation * predicted_s
        if self.dilation > 0:
            if elapsed_s <= target_s:
                time.sleep(target_s - elapsed_s)
            elif predicted_s > 0:
                self.overruns += 1
        self.exclude(time.perf_counter() - start_s)
        return result

    def _measure(self, elapsed_s: float, predicted_s: float, what: object) -> None:
        if elapsed_s / predicted_s > self.max_ratio:
            self.max_ratio, self.slowest = elapsed_s / predicted_s, what
        if self.dilation <= 0:  # still measuring: calibrate() reads them
            self.measured.append((elapsed_s, predicted_s))

    def exclude(self, seconds: float) -> None:
        """``seconds`` of the op running now went to a nested op or a wait, not its own work."""
        if self._nested:
            self._nested[-1] += seconds

    def start_comm(self, op: CommOp, work: Waitable) -> Waitable:
        """Queue the collective on its channel (one per kind) for its predicted time (none
        while the dilation is being measured: then waiting for it is still not the waiting
        op's own work)."""
        channel = op.kind.value
        start_s = max(time.perf_counter(), self._channels.get(channel, 0.0))
        end_s = start_s + self.dilation * self._comm_s(op)
        self._channels[channel] = end_s
        return _EmulatedWork(self, work, end_s)

    def _comm_s(self, op: CommOp) -> float:
        if op.kind is OpKind.TP_ALLREDUCE:
            pieces = self.all.explicit.get(op.stage_id)
            return pieces.allreduce_s if pieces is not None else 0.0
        if op.kind is OpKind.PARAM_ALLGATHER:
            return sum(self.all.gathers_s.get(unit, 0.0) for unit in op.units)
        if op.kind is OpKind.OUTER_SYNC:
            return sum(self.all.outer_s.get(unit, 0.0) for unit in op.units)
        return 0.0

    def time_transfers(self) -> None:
        """Split channels: from now on time the pipeline's transfers on their channels
        (:func:`~potluck.runtime.timing.p2p_emulation.emulating_p2p`), until
        :meth:`stop_timing_transfers`. The clock holds the context: a context manager
        entered and dropped is closed when it is collected, and that would undo the
        wrapping at once."""
        if self.p2p is not None and self._transfers is None:
            self._transfers = emulating_p2p(self.p2p)
            self._transfers.__enter__()

    def stop_timing_transfers(self) -> None:
        if self._transfers is not None:
            self._transfers.__exit__(None, None, None)
            self._transfers = None

    def tag_p2p(self, ops: list[Any], kind: OpKind, stage_id: int, micro_batch: int
                ) -> list[Any]:
        """Split channels: note what each op is, to time it on its channel."""
        if self.p2p is not None:
            self.p2p.tag(ops, kind, stage_id)
        return ops

    def restart_measuring(self) -> None:
        """Forget the ops measured so far (a warm-up)."""
        self.max_ratio, self.slowest = 0.0, None
        self.measured.clear()

    def calibrate(self, margin: float = CALIBRATION_MARGIN, step_s: float | None = None
                  ) -> float:
        """Set the dilation from the ops measured so far (one step's, whose predicted time
        is ``step_s`` where known), the same on every rank: ``margin`` times the largest
        :func:`needed_dilation` of any rank."""
        needed = torch.tensor([needed_dilation(self.measured, step_s)], dtype=torch.float64)
        dist.all_reduce(needed, op=dist.ReduceOp.MAX)
        self.dilation = float(needed) * margin
        if self.p2p is not None:
            self.p2p.dilation = self.dilation
        self.overruns = 0
        self.measured.clear()
        log.info("emulation: dilation %.1f (needed %.1f; this rank's slowest op, %s, %.1fx "
                 "its prediction)", self.dilation, float(needed), self.slowest, self.max_ratio)
        return self.dilation


def needed_dilation(ops: list[tuple[float, float]], step_s: float | None = None,
                    budget: float = OVERRUN_BUDGET) -> float:
    """The smallest stretch ``d`` at which the ops ``(took_s, predicted_s)`` of one step that
    take longer than ``d x predicted_s`` add at most ``budget`` of the stretched step:
    ``sum(max(0, took - d x predicted)) <= budget x d x step``, the step's predicted time
    ``step_s`` (default, and at least: the ops' sum). At most the slowest op's ratio (where
    nothing overruns); 0 for no ops."""
    if not ops:
        return 0.0
    total_s = max(step_s or 0.0, sum(predicted_s for _, predicted_s in ops))

    def fits(d: float) -> bool:
        over_s = sum(max(0.0, took_s - d * predicted_s) for took_s, predicted_s in ops)
        return over_s <= budget * d * total_s

    low, high = 0.0, max(took_s / predicted_s for took_s, predicted_s in ops)
    for _ in range(BISECTIONS):
        middle = 0.5 * (low + high)
        low, high = (low, middle) if fits(middle) else (middle, high)
    return high


def emulate(model: Any, dilation: float | None = None, timing: Plan | None = None
            ) -> EmulationClock:
    """Put a :class:`~potluck.runtime.parallel_model.ParallelModel` on emulated
    time; returns its clock. With split channels the pipeline's transfers are timed on
    their channels from now on, for the rest of this process (a rank's whole life).

    ``timing`` is the plan whose devices and model set the targets (default: the
    plan being run; differs when a stand-in model is computed).
    """
    clock = EmulationClock.for_plan(timing or model.layout.plan, model.layout, dilation)
    model.set_clock(clock)
    clock.time_transfers()
    return clock
