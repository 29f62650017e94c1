"""The clock every op of a training step runs through, and the null clock.

The schedules, the gradient sync and the trainer hand each op to their clock
as ``clock.run(kind, stage_id, fn)``: ``kind`` an :class:`~potluck.ops.OpKind`,
``stage_id`` the virtual stage (``-1`` for ops of the whole rank: the gradient
reduction, the optimizer step). A clock runs ``fn`` and returns its result;
what it does around it is its own business: the emulation clock
(:mod:`potluck.runtime.timing.emulate`) pads the op to its predicted time, the
recorder (:mod:`potluck.runtime.timing.recorder`) notes when it ran. Before a
pipeline stage posts its sends and receives it hands them to
``clock.tag_p2p`` (the recorder names them to time their waits).

:class:`NullClock` is what every holder of a clock starts with: it runs the op
and nothing else, with no time stretch (``dilation`` 1), so code that runs ops
never asks whether there is a clock. Where a real clock changes more than the
timing (a pipeline stage with a clock is a hooked stage, a trace says whether
its run was emulated), the holder asks ``isinstance(clock, NullClock)``.

Collectives the runtime starts asynchronously and waits for later (the explicit TP
executor's all-reduces, ZeRO's parameter all-gathers, gradient buckets) go through
``clock.start_comm(op, work)``: the clock gets what the collective is (a :class:`CommOp`)
and torch's handle, and returns what the runtime waits on instead. The null clock returns
the handle itself; the emulation clock one whose ``wait()`` also lasts until the
collective's emulated end.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from potluck.ops import OpKind

T = TypeVar("T")


class Waitable(Protocol):
    """What the runtime waits on: torch's ``Work``, or a clock's stand-in for it."""

    def wait(self) -> Any: ...


@dataclass(frozen=True)
class Segment:
    """A piece of a stage's forward or backward that the explicit TP executor runs on its own
    (:mod:`potluck.runtime.parallel.tp_overlap`): ``part`` of block ``layer`` (``attention``
    or ``mlp``; ``entry``/``exit`` for the stage's boundary collectives, layer -1) for one
    sub-batch of ``chunks``."""

    kind: OpKind  # FORWARD or BACKWARD (compute), TP_ALLREDUCE (a boundary collective)
    stage_id: int
    part: str
    layer: int = -1
    chunks: int = 1


@dataclass(frozen=True)
class CommOp:
    """An asynchronous collective, as a clock sees it: its kind, the virtual stage it
    serves (-1: the whole rank), and what it carries, for an emulation to time it:
    ``units`` the parameter units (``block.3``, ``embed``) of a gradient or parameter
    bucket, ``key`` anything else that names it (the executor's segment)."""

    kind: OpKind
    stage_id: int = -1
    units: tuple[str, ...] = ()
    key: tuple[Any, ...] = ()


class Clock(Protocol):
    """Runs the ops of a step; may time, pad or record them."""

    @property
    def dilation(self) -> float:
        """How much slower than the plan's devices ops run (emulation; 1 otherwise,
        0 while an emulation is not yet calibrated)."""
        ...

    def run(self, kind: OpKind, stage_id: int, fn: Callable[[], T]) -> T:
        """Run ``fn``, an op of ``kind`` on virtual stage ``stage_id``; its result."""
        ...

    def tag_p2p(self, ops: list[Any], kind: OpKind, stage_id: int, micro_batch: int
                ) -> list[Any]:
        """The point-to-point ops a stage is about to post, possibly named for timing."""
        ...

    def start_comm(self, op: CommOp, work: Waitable) -> Waitable:
        """A collective the runtime has started (``work``: torch's handle); what the runtime
        waits on instead."""
        ...

    def run_segment(self, segment: Segment, fn: Callable[[], T]) -> T:
        """Run ``fn``, one segment of a stage's op (it runs inside that op's ``run``)."""
        ...


class NullClock:
    """The clock that runs ops and does nothing else."""

    @property
    def dilation(self) -> float:
        return 1.0

    def run(self, kind: OpKind, stage_id: int, fn: Callable[[], T]) -> T:
        return fn()

    def tag_p2p(self, ops: list[Any], kind: OpKind, stage_id: int, micro_batch: int
                ) -> list[Any]:
        return ops

    def start_comm(self, op: CommOp, work: Waitable) -> Waitable:
        return work

    def run_segment(self, segment: Segment, fn: Callable[[], T]) -> T:
        return fn()
