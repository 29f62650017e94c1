"""Interleaved zero bubble (Qi et al. 2024, ZB-H1 per chunk): the deferred weight gradients fill the bubble.

The backward splits into an input-gradient pass, which the previous stage
waits for, and a weight-gradient pass that runs later, where the schedule
would otherwise idle.

- memory: as interleaved 1F1B (ZB-H1 keeps 1F1B's in-flight count); a
  chunk's activations are freed after its weight pass, which still reads
  the layer inputs;
- time: the closed form of :mod:`potluck.schedules.timing` with the deferred
  weight gradients out of the fill (``f + b - 2w`` per stage);
- order: torch's ``ScheduleInterleavedZeroBubble``
  (:func:`potluck.schedules.interleaved.interleaved_order` with the split backward);
- torch: ``ScheduleInterleavedZeroBubble``, with interleaved 1F1B's rounds
  constraint. Pipelines whose stages have different tensor-parallel degrees
  run on their stage leaders, whose followers mirror forwards and full
  backwards only, so zero bubble is not planned for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from potluck.ops import OpKind
from potluck.schedules.base import LossFn, Schedule
from potluck.schedules.interleaved import Interleaved


class ZeroBubble(Interleaved):
    name = Schedule.ZERO_BUBBLE
    defers_weight_grads = True
    supports_mixed_tp = False
    frees_activations_after = OpKind.BACKWARD_WEIGHT

    def torch_schedule(self, stages: Sequence[Any], micro_batches: int, loss_fn: LossFn) -> Any:
        from torch.distributed.pipelining import ScheduleInterleavedZeroBubble

        return ScheduleInterleavedZeroBubble(list(stages), micro_batches, loss_fn=loss_fn,
                                             scale_grads=False)
