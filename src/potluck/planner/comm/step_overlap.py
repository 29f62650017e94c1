"""When each stage can start the next step: the data-parallel priority schedule (TriRace).

A synchronous step ends, for every rank, with the global gradient norm (clipping needs
every gradient reduced). Without the priority schedule every rank then also waits for
every other at the start of the next step (the token count's all-reduce), so the step
lasts until the slowest stage has stepped its optimizer and, under ZeRO-1/2, gathered its
updated parameters. With it (:attr:`potluck.plans.CommSchedule.dp_priority_schedule`) no
barrier follows the norm: stage ``j`` of a pipeline starts its next step's first forward
only once the stages before it have run theirs and sent it on, so its optimizer step and
its parameter all-gather may take that long without delaying anything, and the all-gather
runs bucket by bucket in the order that forward needs them, each block waiting only for
its own (P3, Jayarajan et al. MLSys'19, prioritises the same way). In steady state the
step then lasts ``max_j (ready_j - start_j)``: ``ready_j`` when stage ``j`` could start its
first forward (the norm, its own step, the part of its gather its first forward does not
hide) and ``start_j`` when that forward starts within the step.
"""

from __future__ import annotations

from collections.abc import Sequence

from potluck.schedules import StageWork


def first_forward_starts_s(works: Sequence[StageWork], chunks: int = 1) -> list[float]:
    """When each stage of a pipeline starts its first forward of a step, relative to the
    first stage's: after each stage before it has run its first forward (one chunk's
    share with ``chunks`` virtual stages per device) and sent the activations on."""
    starts, at = [], 0.0
    for work in works:
        starts.append(at)
        at += work.forward_s / chunks + work.send_s
    return starts


def gathered_forward_delay_s(gather_s: float, forward_s: float, blocks: int) -> float:
    """How much later a stage's first forward ends when its parameter all-gather starts with
    it: ``blocks`` buckets gathered one after the other in forward order, block ``k``
    computing once its own bucket is in (a compute stream waiting on a communication
    stream); zero without a gather."""
    if gather_s <= 0.0 or blocks <= 0:
        return 0.0
    per_gather, per_block = gather_s / blocks, forward_s / blocks
    gathered = computed = 0.0
    for _ in range(blocks):
        gathered += per_gather
        computed = max(computed, gathered) + per_block
    return computed - forward_s


def next_step_bound_s(ready_s: Sequence[Sequence[float]], starts_s: Sequence[Sequence[float]]
                      ) -> float:
    """The steady-state step time, ``max`` over every stage of every pipeline of when it is
    ready for the next step less when that step needs it."""
    return max(ready - start for readies, starts in zip(ready_s, starts_s, strict=True)
               for ready, start in zip(readies, starts, strict=True))
