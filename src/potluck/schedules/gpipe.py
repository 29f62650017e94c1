"""GPipe (Huang et al. 2019): every forward of the step, then every backward.

- memory: a stage holds the activations of all ``m`` micro-batches;
- time: the closed form of :mod:`potluck.schedules.timing`; with overlapped
  sends only the fill pays for transfers;
- order: ``F0 .. F(m-1), B0 .. B(m-1)`` on every rank (``ScheduleGPipe``);
- torch: ``ScheduleGPipe``, a single-stage schedule that receives, computes
  and sends each micro-batch, waiting for its forward sends before the
  backward pass (:meth:`GPipe.post_p2p`). Any micro-batch count runs. With
  split P2P channels this order runs on torch's schedule runtime instead, one
  batch per transfer (:meth:`~potluck.schedules.base.PipelineSchedule.torch_schedule_split`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from potluck.ops import OpKind
from potluck.schedules.base import Action, LossFn, P2PCalls, PipelineSchedule, RankOrder, Schedule
from potluck.schedules.timing import PipelineTime, StageWork, pipeline_time

F, B = OpKind.FORWARD, OpKind.BACKWARD  # what a posted send or receive carries


class GPipe(PipelineSchedule):
    name = Schedule.GPIPE
    single_stage_torch = True

    def torch_schedule(self, stages: Sequence[Any], micro_batches: int, loss_fn: LossFn) -> Any:
        from torch.distributed.pipelining import ScheduleGPipe

        return ScheduleGPipe(stages[0], micro_batches, loss_fn=loss_fn, scale_grads=False)

    def in_flight(self, stage: int, stages: int, micro_batches: int,
                  virtual_stages: int = 1) -> float:
        return float(micro_batches)

    def pipeline_time(self, stages: list[StageWork], micro_batches: int, virtual_stages: int = 1,
                      *, overlap_p2p: bool = True, split_channels: bool = False) -> PipelineTime:
        # the forward phase sends only activations, the backward phase only gradients: the
        # two directions barely meet on a link, split or not
        return pipeline_time(stages, micro_batches, chunks=1, blocking=not overlap_p2p)

    def _rank_orders(self, stages: int, micro_batches: int, virtual_stages: int) -> list[RankOrder]:
        forwards = [Action(OpKind.FORWARD, 0, i) for i in range(micro_batches)]
        backwards = [Action(OpKind.BACKWARD, 0, i) for i in range(micro_batches)]
        return [forwards + backwards for _ in range(stages)]

    def post_p2p(self, calls: P2PCalls, stage: int, stages: int, micro_batches: int,
                 forward_s: float, backward_s: float) -> None:
        """``ScheduleGPipe._step_microbatches``: receive, compute and send each micro-batch."""
        up, down = (stage - 1 if stage > 0 else None), (stage + 1 if stage < stages - 1 else None)
        sends = []
        for i in range(micro_batches):
            calls.post(up, [], [(F, i)])
            calls.run(OpKind.FORWARD, i, forward_s)
            sends.append(calls.post(down, [(F, i)], [], wait=False))
        for end in sends:
            calls.wait(end)
        for i in range(micro_batches):
            calls.post(down, [], [(B, i)])
            calls.run(OpKind.BACKWARD, i, backward_s)
            calls.post(up, [(B, i)], [], wait=False)
