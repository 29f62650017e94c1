"""What every pipeline schedule answers, so that nothing outside this package asks its name.

A schedule is one object (:class:`PipelineSchedule`) that owns all potluck
knows about it, for every layer that needs it:

- **memory** (the cost model): micro-batches whose activations a stage holds
  at its peak (:meth:`PipelineSchedule.in_flight`), and after which op a
  micro-batch's activations are freed (:attr:`PipelineSchedule.frees_activations_after`);
- **time** (the cost model): one pipeline's forward and backward passes over
  ``m`` micro-batches with unequal stages (:meth:`PipelineSchedule.pipeline_time`,
  built on :mod:`potluck.schedules.timing`);
- **op order** (the simulator): each rank's forwards and backwards in program
  order (:meth:`PipelineSchedule.rank_orders`), and, for torch's single-stage
  schedules, where they post their batched sends and receives
  (:meth:`PipelineSchedule.post_p2p`);
- **torch** (the runtime): the ``torch.distributed.pipelining`` class that
  runs it (:meth:`PipelineSchedule.torch_schedule`) and the constraints under
  which that class runs at all (:meth:`PipelineSchedule.problem`), so the
  planner only emits plans the runtime runs as written; with split P2P
  channels, the torch schedule whose every send and receive is a batch of its
  own (:meth:`PipelineSchedule.torch_schedule_split`).

A pipeline of one stage runs the runtime's plain micro-batch loop whatever the
schedule (forward and backward of each micro-batch in turn).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any, NamedTuple, Protocol

from potluck.errors import ConfigError
from potluck.ops import OpKind
from potluck.schedules.timing import PipelineTime, StageWork


class Schedule(str, Enum):
    """Pipeline schedules, as in ``torch.distributed.pipelining``."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"  # interleaved 1F1B with virtual stages
    ZERO_BUBBLE = "zb"  # interleaved zero bubble (backward split into input and weight)


class Action(NamedTuple):
    """One compute op: its kind, the rank's chunk (virtual stage index on the rank) and micro-batch."""

    kind: OpKind
    chunk: int
    micro_batch: int


RankOrder = list[Action]
LossFn = Callable[[Any, Any], Any]
P2PKey = tuple[OpKind, int]  # (FORWARD or BACKWARD, micro-batch): the output a stage sends


class P2PCalls(Protocol):
    """How a simulator stage records what a single-stage torch schedule does, in order."""

    def run(self, kind: OpKind, micro_batch: int, duration_s: float) -> int:
        """Compute one op; it waits for the batches posted with ``wait`` before it."""

    def post(self, peer: int | None, sends: list[P2PKey], recvs: list[P2PKey], *,
             wait: bool = True) -> int | None:
        """Post one batch of sends and receives towards ``peer``; its end, if posted."""

    def wait(self, end: int | None) -> None:
        """Make the next compute op wait for a batch posted earlier."""


class PipelineSchedule(ABC):
    """One pipeline schedule, for the cost model, the simulator and the runtime."""

    name: Schedule
    interleaved: bool = False  # runs several chunks (virtual stages) per device
    supports_mixed_tp: bool = True  # runs pipelines whose stages have different TP degrees
    frees_activations_after: OpKind = OpKind.BACKWARD  # the op that ends with a chunk's inputs

    def chunks(self, virtual_stages: int) -> int:
        """Chunks per device this schedule runs for a plan's ``virtual_stages``."""
        return max(1, virtual_stages) if self.interleaved else 1

    # ---- what torch runs ----------------------------------------------------------------

    def problem(self, micro_batches: int, stages: int, virtual_stages: int = 1, *,
                mixed_tp: bool = False) -> str | None:
        """Why the runtime cannot run ``micro_batches`` over ``stages`` ranks this way (None:
        it can); ``mixed_tp``: the pipeline's stages have different tensor-parallel degrees.
        Which schedules can run it instead is :func:`potluck.schedules.schedule_problem`'s
        to say."""
        if micro_batches < 1 or stages < 1 or virtual_stages < 1:
            return "a pipeline needs at least one stage, micro-batch and chunk"
        if not self.interleaved and virtual_stages != 1:
            return (f"schedule {self.name.value} runs one stage per device, not the plan's "
                    f"{virtual_stages} virtual stages")
        if mixed_tp and not self.supports_mixed_tp:
            return (f"schedule {self.name.value} cannot run a pipeline whose stages have "
                    "different tensor-parallel degrees (their followers mirror forwards and "
                    "full backwards only)")
        return None

    def accepts(self, micro_batches: int, stages: int, virtual_stages: int = 1, *,
                mixed_tp: bool = False) -> bool:
        return self.problem(micro_batches, stages, virtual_stages, mixed_tp=mixed_tp) is None

    def check(self, micro_batches: int, stages: int, virtual_stages: int = 1, *,
              mixed_tp: bool = False) -> None:
        """One ConfigError saying why the runtime cannot run this pipeline, if it cannot."""
        problem = self.problem(micro_batches, stages, virtual_stages, mixed_tp=mixed_tp)
        if problem is not None:
            raise ConfigError(problem)

    @abstractmethod
    def torch_schedule(self, stages: Sequence[Any], micro_batches: int, loss_fn: LossFn) -> Any:
        """The torch schedule over this rank's ``PipelineStage`` objects (gradients unscaled:
        potluck's loss is already a share of the global batch's mean)."""

    def torch_schedule_split(self, stages: Sequence[Any], micro_batches: int,
                             loss_fn: LossFn) -> Any:
        """The torch schedule with every send and receive a batch of its own, so activations
        and gradients can travel on two process groups (split P2P channels). torch's schedule
        runtime (interleaved, zero bubble) already runs so; a single-stage torch class fuses
        a forward send with a backward receive, so this schedule's own rank orders run on
        that runtime instead (:mod:`potluck.schedules.lowering`)."""
        if not self.single_stage_torch:
            return self.torch_schedule(stages, micro_batches, loss_fn)
        from potluck.schedules.lowering import runtime_schedule

        orders = self.rank_orders(stages[0].num_stages, micro_batches)
        return runtime_schedule(orders, stages, micro_batches, loss_fn)

    # ---- memory ---------------------------------------------------------------------------

    @abstractmethod
    def in_flight(self, stage: int, stages: int, micro_batches: int,
                  virtual_stages: int = 1) -> float:
        """Micro-batches whose activations stage ``stage`` of ``stages`` holds at its peak."""

    # ---- time -----------------------------------------------------------------------------

    @abstractmethod
    def pipeline_time(self, stages: list[StageWork], micro_batches: int, virtual_stages: int = 1,
                      *, overlap_p2p: bool = True, split_channels: bool = False) -> PipelineTime:
        """One pipeline's forward and backward passes over ``micro_batches`` micro-batches;
        ``split_channels``: activations and gradients on two one-way channels, sends posted
        as soon as their data exists (:attr:`potluck.plans.CommSchedule.split_p2p_channels`)."""

    # ---- op order (simulator) -------------------------------------------------------------

    def rank_orders(self, stages: int, micro_batches: int, virtual_stages: int = 1) -> list[RankOrder]:
        """Per rank (physical stage), its compute ops in program order."""
        self.check(micro_batches, stages, virtual_stages)
        if stages == 1 and virtual_stages == 1:  # the runtime's loop: F, B per micro-batch
            return [local_order(micro_batches)]
        return self._rank_orders(stages, micro_batches, virtual_stages)

    @abstractmethod
    def _rank_orders(self, stages: int, micro_batches: int, virtual_stages: int) -> list[RankOrder]:
        """The orders of a pipeline of more than one stage or chunk."""

    single_stage_torch: bool = False  # torch's single-stage class: batched, blocking sends

    def how_it_runs(self, stages: int, micro_batches: int) -> str:
        """What a plan's reader should know of how a pipeline runs this schedule ('' when
        nothing beyond its name)."""
        return ""

    def single_stage_class(self, stages: int, micro_batches: int) -> bool:
        """Whether torch's single-stage class runs a pipeline of ``stages`` over
        ``micro_batches`` (else this schedule's rank orders run on torch's schedule runtime,
        :mod:`potluck.schedules.lowering`, one send or receive at a time)."""
        return self.single_stage_torch and stages > 1

    def post_p2p(self, calls: P2PCalls, stage: int, stages: int, micro_batches: int,
                 forward_s: float, backward_s: float) -> None:
        """The compute ops and send/receive batches of one rank of a single-stage torch
        schedule, in the order torch posts them (only where :attr:`single_stage_torch`)."""
        raise NotImplementedError(f"{self.name.value} runs torch's schedule runtime, not "
                                  "a single-stage schedule")


def local_order(micro_batches: int) -> RankOrder:
    """One stage alone: forward and backward of each micro-batch in turn."""
    order: RankOrder = []
    for i in range(micro_batches):
        order.extend([Action(OpKind.FORWARD, 0, i), Action(OpKind.BACKWARD, 0, i)])
    return order
