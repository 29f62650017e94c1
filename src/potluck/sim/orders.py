"""The order in which each pipeline rank runs its forwards and backwards.

One list of :class:`Action` per rank (physical stage), in program order, for
the four schedules of :class:`potluck.plans.Schedule`. The orders are those of
``torch.distributed.pipelining`` (what the runtime executes), rewritten here
without torch's private helpers and without the ``None`` padding its
``pipeline_order`` uses to align ranks in time steps (the simulator aligns by
dependencies instead):

- GPipe: all forwards, then all backwards (``ScheduleGPipe``);
- 1F1B: ``p - 1 - rank`` warm-up forwards, then one forward and one backward
  in turn (``Schedule1F1B``); with fewer micro-batches than stages the
  runtime falls back to GPipe, and so does this module; a pipeline of one
  stage runs forward and backward per micro-batch (the runtime's ``LocalSchedule``);
- interleaved 1F1B: ``ScheduleInterleaved1F1B`` (depth first, in rounds of
  ``m // max(1, m // p)`` micro-batches); chunk ``c`` of rank ``i`` is
  virtual stage ``c * p + i``;
- zero bubble: ``ScheduleInterleavedZeroBubble`` (ZB-H1 per chunk): the
  backward splits into an input-gradient part and a weight-gradient part that
  fills the bubbles.

A test checks these orders against torch's own ``pipeline_order``.
"""

from __future__ import annotations

from collections import defaultdict
from enum import Enum
from typing import NamedTuple

from potluck.errors import ConfigError


class OpKind(str, Enum):
    """Compute ops of a pipeline rank; the names are the runtime's trace names."""

    FORWARD = "forward"
    BACKWARD = "backward"  # full backward: input and weight gradients
    BACKWARD_INPUT = "backward_input"  # zero bubble: input gradients only
    BACKWARD_WEIGHT = "backward_weight"  # zero bubble: the deferred weight gradients


class Action(NamedTuple):
    """One compute op: its kind, the rank's chunk (virtual stage index on the rank) and micro-batch."""

    kind: OpKind
    chunk: int
    micro_batch: int


RankOrder = list[Action]


def schedule_orders(schedule: str, stages: int, micro_batches: int,
                    virtual_stages: int = 1) -> list[RankOrder]:
    """Per-rank op lists of ``schedule`` (a :class:`potluck.plans.Schedule` value)."""
    if stages < 1 or micro_batches < 1 or virtual_stages < 1:
        raise ConfigError("a pipeline needs at least one stage, micro-batch and chunk")
    if schedule in ("gpipe", "1f1b") and virtual_stages != 1:
        raise ConfigError(
            f"schedule {schedule} runs one stage per device; a plan with {virtual_stages} "
            "virtual stages needs schedule interleaved or zb"
        )
    if stages == 1 and virtual_stages == 1:  # the runtime's LocalSchedule: F, B per micro-batch
        return [_one_f_one_b(0, 1, micro_batches)]
    if schedule == "gpipe" or (schedule == "1f1b" and micro_batches < stages):
        return [_gpipe(micro_batches) for _ in range(stages)]
    if schedule == "1f1b":
        return [_one_f_one_b(rank, stages, micro_batches) for rank in range(stages)]
    if schedule in ("interleaved", "zb"):
        return [_interleaved(rank, stages, micro_batches, virtual_stages, schedule == "zb")
                for rank in range(stages)]
    raise ConfigError(f"unknown schedule {schedule!r}: use gpipe, 1f1b, interleaved or zb")


def _gpipe(m: int) -> RankOrder:
    forwards = [Action(OpKind.FORWARD, 0, i) for i in range(m)]
    return forwards + [Action(OpKind.BACKWARD, 0, i) for i in range(m)]


def _one_f_one_b(rank: int, p: int, m: int) -> RankOrder:
    warmup = min(p - 1 - rank, m)
    order = [Action(OpKind.FORWARD, 0, i) for i in range(warmup)]
    for i in range(m - warmup):
        order.append(Action(OpKind.FORWARD, 0, warmup + i))
        order.append(Action(OpKind.BACKWARD, 0, i))
    order.extend(Action(OpKind.BACKWARD, 0, i) for i in range(m - warmup, m))
    return order


def rounds(stages: int, micro_batches: int) -> tuple[int, int]:
    """torch's rounds for interleaved schedules: (number of rounds, micro-batches per round)."""
    count = max(1, micro_batches // stages)
    if micro_batches % count:
        raise ConfigError(
            f"interleaved and zero-bubble schedules need the micro-batch count ({micro_batches}) "
            f"to be a multiple of max(1, micro-batches // stages) = {count} "
            "(torch.distributed.pipelining's rounds); choose another micro-batch size"
        )
    return count, micro_batches // count


def _interleaved(rank: int, p: int, m: int, v: int, zero_bubble: bool) -> RankOrder:
    """Port of torch's ``_get_1f1b_rank_ops`` with its interleaved warm-up counts."""
    _, per_round = rounds(p, m)
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
