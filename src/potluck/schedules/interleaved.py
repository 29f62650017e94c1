"""Interleaved 1F1B (Narayanan et al., SC'21): ``v`` chunks per device, the bubble divided by ``v``.

Chunk ``c`` of rank ``i`` is virtual stage ``c * p + i``.

- memory: rank ``i`` holds ``(p - i) * (1 + (p - 1) / (p * v))`` micro-batches
  of its chunks at its peak (Korthikanti et al. 2022, Sec. 4.2.3);
- time: the closed form of :mod:`potluck.schedules.timing` with the fill
  divided by ``v``; torch's schedule runtime posts receives ahead and waits
  for sends only at the end of the step, so overlapped transfers cost only
  in the fill;
- order: torch's ``ScheduleInterleaved1F1B``: depth first, in rounds of
  ``m // max(1, m // p)`` micro-batches (:func:`interleaved_order`, a port
  of its ``_get_1f1b_rank_ops`` without the ``None`` padding torch uses to
  align ranks in time steps; the simulator aligns by dependencies);
- torch: ``ScheduleInterleaved1F1B``; it needs the micro-batch count to be a
  multiple of its number of rounds, ``max(1, m // p)``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from potluck.ops import OpKind
from potluck.schedules.base import Action, LossFn, PipelineSchedule, RankOrder, Schedule
from potluck.schedules.timing import PipelineTime, StageWork, pipeline_time


class Interleaved(PipelineSchedule):
    name = Schedule.INTERLEAVED
    interleaved = True
    defers_weight_grads = False  # zero bubble's split backward (its subclass)

    def problem(self, micro_batches: int, stages: int, virtual_stages: int = 1, *,
                mixed_tp: bool = False) -> str | None:
        problem = super().problem(micro_batches, stages, virtual_stages, mixed_tp=mixed_tp)
        if problem is None and micro_batches % rounds(stages, micro_batches):
            count = rounds(stages, micro_batches)
            return (f"the {self.name.value} schedule runs micro-batches in {count} rounds "
                    f"(torch.distributed.pipelining's max(1, micro-batches // stages)) and needs "
                    f"their count ({micro_batches}) to be a multiple of {count}")
        return problem

    def torch_schedule(self, stages: Sequence[Any], micro_batches: int, loss_fn: LossFn) -> Any:
        from torch.distributed.pipelining import ScheduleInterleaved1F1B

        return ScheduleInterleaved1F1B(list(stages), micro_batches, loss_fn=loss_fn,
                                       scale_grads=False)

    def in_flight(self, stage: int, stages: int, micro_batches: int,
                  virtual_stages: int = 1) -> float:
        in_flight = float(min(micro_batches, stages - stage))
        if virtual_stages > 1:
            in_flight *= 1.0 + (stages - 1) / (stages * virtual_stages)
        return min(in_flight, float(micro_batches * max(1, virtual_stages)))

    def pipeline_time(self, stages: list[StageWork], micro_batches: int, virtual_stages: int = 1,
                      *, overlap_p2p: bool = True, split_channels: bool = False) -> PipelineTime:
        # the schedule runtime issues each send and receive alone: on one channel per stage
        # pair (one NCCL communicator and stream) activations and gradients take turns
        return pipeline_time(stages, micro_batches, chunks=self.chunks(virtual_stages),
                             blocking=not overlap_p2p, defers_weight_grads=self.defers_weight_grads,
                             serial_link=not split_channels)

    def _rank_orders(self, stages: int, micro_batches: int, virtual_stages: int) -> list[RankOrder]:
        return [interleaved_order(rank, stages, micro_batches, virtual_stages,
                                  zero_bubble=self.defers_weight_grads) for rank in range(stages)]


def rounds(stages: int, micro_batches: int) -> int:
    """torch's number of rounds for interleaved schedules."""
    return max(1, micro_batches // stages)


def interleaved_order(rank: int, p: int, m: int, v: int, *, zero_bubble: bool = False) -> RankOrder:
    """Port of torch's ``_get_1f1b_rank_ops`` with its interleaved warm-up counts."""
    per_round = m // rounds(p, m)
    factor = 1 if zero_bubble else 2
    warmup = min((v - 1) * per_round + factor * (p - 1 - rank), m * v)
    steady = m * v - warmup
    backward = OpKind.BACKWARD_INPUT if zero_bubble else OpKind.BACKWARD
    counters: dict[tuple[OpKind, int], int] = defaultdict(int)

    def take(kind: OpKind, chunk: int) -> Action:
        index = counters[(kind, chunk)]
        counters[(kind, chunk)] = index + 1
        return Action(kind, chunk, index)

    def backward_chunk(step: int) -> int:
        return v - 1 - ((step - warmup) // per_round) % v

    order: RankOrder = []
    backward_steps: list[int] = []
    for step in range(m * v + warmup):
        if step < warmup + steady:
            order.append(take(OpKind.FORWARD, (step // per_round) % v))
        if step >= warmup:
            order.append(take(backward, backward_chunk(step)))
            backward_steps.append(step)
            if zero_bubble and step - warmup >= rank:
                order.append(take(OpKind.BACKWARD_WEIGHT, backward_chunk(backward_steps[0])))
                backward_steps.pop(0)
    if zero_bubble:
        order.extend(take(OpKind.BACKWARD_WEIGHT, backward_chunk(s)) for s in backward_steps)
    return order
