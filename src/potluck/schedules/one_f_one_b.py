"""1F1B (PipeDream-Flush; Narayanan et al. 2021): warm up, then one forward and one backward in turn.

- memory: stage ``i`` of ``p`` holds ``p - i`` micro-batches at its peak
  (Korthikanti et al. 2022);
- time: the closed form of :mod:`potluck.schedules.timing` with every
  transfer on the critical path: torch's ``Schedule1F1B`` posts its sends
  and receives in fused batches and waits on each, so a stage blocks on its
  transfers on every micro-batch, overlapped or not; with split channels
  (TriRace) the same order runs on torch's schedule runtime, each send and
  receive on its own one-way channel, and only the fill pays for transfers;
- order: ``p - 1 - i`` warm-up forwards on rank ``i``, then forward and
  backward in turn, then the remaining backwards;
- torch: ``Schedule1F1B`` (single-stage), whose send/receive batches
  :meth:`OneFOneB.post_p2p` reproduces. That class refuses fewer micro-batches
  than stages, which Megatron-LM's and DeepSpeed's 1F1B run as fill and drain
  (the warm-up takes every micro-batch, then the backwards drain): such a
  pipeline runs this same order on torch's schedule runtime, one batch per
  transfer, as split P2P channels do
  (:meth:`~potluck.schedules.base.PipelineSchedule.torch_schedule_split`); it
  holds ``min(m, p - i)`` micro-batches, fewer than GPipe's ``m``, in the same time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from potluck.ops import OpKind
from potluck.schedules.base import Action, LossFn, P2PCalls, PipelineSchedule, RankOrder, Schedule
from potluck.schedules.timing import PipelineTime, StageWork, pipeline_time

F, B = OpKind.FORWARD, OpKind.BACKWARD  # what a posted send or receive carries


class OneFOneB(PipelineSchedule):
    name = Schedule.ONE_F_ONE_B
    single_stage_torch = True

    def single_stage_class(self, stages: int, micro_batches: int) -> bool:
        return super().single_stage_class(stages, micro_batches) and micro_batches >= stages

    def how_it_runs(self, stages: int, micro_batches: int) -> str:
        if stages > 1 and micro_batches < stages:
            return (f"fill and drain: {micro_batches} micro-batches over {stages} stages (the "
                    "warm-up takes them all), as Megatron-LM and DeepSpeed run it; potluck runs "
                    "it on torch's schedule runtime")
        return ""

    def torch_schedule(self, stages: Sequence[Any], micro_batches: int, loss_fn: LossFn) -> Any:
        if not self.single_stage_class(stages[0].num_stages, micro_batches):  # fill and drain
            return self.torch_schedule_split(stages, micro_batches, loss_fn)
        from torch.distributed.pipelining import Schedule1F1B

        return Schedule1F1B(stages[0], micro_batches, loss_fn=loss_fn, scale_grads=False)

    def in_flight(self, stage: int, stages: int, micro_batches: int,
                  virtual_stages: int = 1) -> float:
        return float(min(micro_batches, stages - stage))

    def pipeline_time(self, stages: list[StageWork], micro_batches: int, virtual_stages: int = 1,
                      *, overlap_p2p: bool = True, split_channels: bool = False) -> PipelineTime:
        # torch's Schedule1F1B waits on every fused batch; with split channels, or fewer
        # micro-batches than stages, the same order runs on torch's schedule runtime, sends
        # posted at once and waited at the step's end. The steady state's micro-batches in
        # flight: the fewer the micro-batches, the less that state lasts, which the fill
        # already prices
        in_flight = [float(len(stages) - i) for i in range(len(stages))]
        blocking = not split_channels and self.single_stage_class(len(stages), micro_batches)
        return pipeline_time(stages, micro_batches, chunks=1, blocking=blocking,
                             in_flight=in_flight)

    def _rank_orders(self, stages: int, micro_batches: int, virtual_stages: int) -> list[RankOrder]:
        return [_rank_order(rank, stages, micro_batches) for rank in range(stages)]

    def post_p2p(self, calls: P2PCalls, stage: int, stages: int, micro_batches: int,
                 forward_s: float, backward_s: float) -> None:
        """``Schedule1F1B._step_microbatches``: warm-up, fused 1B1F batches, cool-down."""
        m = micro_batches
        up, down = (stage - 1 if stage > 0 else None), (stage + 1 if stage < stages - 1 else None)
        warmup = min(m, stages - stage)
        forward = backward = 0
        send_work = held = None
        for _ in range(warmup):
            calls.post(up, [], [(F, forward)])
            calls.run(OpKind.FORWARD, forward, forward_s)
            calls.wait(send_work)
            if forward != warmup - 1:
                send_work = calls.post(down, [(F, forward)], [], wait=False)
            else:
                held = (F, forward)  # fused with the first backward's receive below
            forward += 1
        while True:
            calls.post(down, [held] if held else [], [(B, backward)])
            calls.run(OpKind.BACKWARD, backward, backward_s)
            backward += 1
            if forward == m:
                break
            calls.post(up, [(B, backward - 1)], [(F, forward)])
            calls.run(OpKind.FORWARD, forward, forward_s)
            held, forward = (F, forward), forward + 1
        send_work = calls.post(up, [(B, backward - 1)], [], wait=False)
        while backward < m:
            calls.post(down, [], [(B, backward)])
            calls.run(OpKind.BACKWARD, backward, backward_s)
            calls.wait(send_work)
            send_work = calls.post(up, [(B, backward)], [], wait=False)
            backward += 1


def _rank_order(rank: int, p: int, m: int) -> RankOrder:
    warmup = min(p - 1 - rank, m)
    order = [Action(OpKind.FORWARD, 0, i) for i in range(warmup)]
    for i in range(m - warmup):
        order.append(Action(OpKind.FORWARD, 0, warmup + i))
        order.append(Action(OpKind.BACKWARD, 0, i))
    order.extend(Action(OpKind.BACKWARD, 0, i) for i in range(m - warmup, m))
    return order
