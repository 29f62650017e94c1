"""A schedule's own rank orders, run by torch's schedule runtime: every send and receive its own batch.

torch's single-stage classes (``Schedule1F1B``, ``ScheduleGPipe``) fuse a
forward send with a backward receive in one ``batch_isend_irecv``, whose ops
must all use one process group, so activations and gradients cannot travel on
separate groups (split P2P channels). torch's ``_PipelineScheduleRuntime`` (the
base of its interleaved schedules) runs a program of compute actions and
``SEND_F``/``RECV_F``/``SEND_B``/``RECV_B`` actions, each its own batch: a
receive is waited right before the compute that needs it, sends are waited at
the end of the step. :func:`runtime_schedule` builds that runtime from
potluck's per-rank compute order (``PipelineSchedule.rank_orders``) and lets
torch lower it (``_prepare_schedule_with_comms``, format ``compute_only``), so
the same forwards and backwards run in the same order, only the transfers
change; then it posts each receive a compute earlier than torch placed it
(:func:`receives_one_compute_earlier`), so its transfer overlaps that compute.

The runtime is private torch API (``torch.distributed.pipelining.schedules``);
its public subclasses run the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from potluck.ops import OpKind

# One compute op of a rank's order: (kind, the rank's chunk, micro-batch), as ``schedules.Action``.
ComputeOp = tuple[OpKind, int, int]
_TORCH_KINDS = {OpKind.FORWARD: "F", OpKind.BACKWARD: "B", OpKind.BACKWARD_INPUT: "I",
                OpKind.BACKWARD_WEIGHT: "W"}


def compute_actions(orders: Sequence[Sequence[ComputeOp]]) -> dict[int, list[Any]]:
    """torch's compute-only program: position ``r`` in the pipeline runs ``orders[r]``, chunk
    ``c`` of position ``r`` being virtual stage ``c * len(orders) + r``."""
    from torch.distributed.pipelining.schedules import _Action, _ComputationType

    stages = len(orders)
    return {
        position: [_Action(chunk * stages + position, _ComputationType(_TORCH_KINDS[kind]),
                           micro_batch) for kind, chunk, micro_batch in order]
        for position, order in enumerate(orders)
    }


def runtime_schedule(orders: Sequence[Sequence[ComputeOp]], stages: Sequence[Any],
                     micro_batches: int, loss_fn: Callable[[Any, Any], Any]) -> Any:
    """torch's schedule runtime over this rank's ``PipelineStage`` objects, running
    ``orders`` (one per position in the pipeline) with a batch of its own per transfer;
    gradients unscaled, as every potluck schedule. Its op lists are by position: the runtime
    (``potluck.runtime.parallel.pipeline.seat_stages``) says which one this rank runs."""
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    runner = _PipelineScheduleRuntime(list(stages), micro_batches, loss_fn=loss_fn,
                                      scale_grads=False)
    runner.pipeline_order = compute_actions(orders)
    runner._prepare_schedule_with_comms(runner.pipeline_order, format="compute_only")
    runner.pipeline_order_with_comms = {
        position: receives_one_compute_earlier(program)
        for position, program in runner.pipeline_order_with_comms.items()}
    return runner


_DIRECTION = {"SEND_F": "F", "RECV_F": "F", "SEND_B": "B", "RECV_B": "B"}


def receives_one_compute_earlier(program: list[Any]) -> list[Any]:
    """``program`` with each receive posted before the compute that precedes it, so the
    transfer overlaps that compute (torch's lowering puts a receive where its sender's
    compute falls in a lockstep walk of the ranks, which on a faster or busier rank is
    often right before the compute that waits for it: the transfer then starts only there).

    A receive moves past actions of the other direction's channel and past one compute
    action, never past an action of its own channel: each direction is one process group,
    whose operations NCCL runs in order, so their order on it stays as torch lowered it.
    """
    result: list[Any] = []
    for action in program:
        kind = action.computation_type.value
        if kind.startswith("RECV_"):
            result.insert(_earlier_position(result, _DIRECTION[kind]), action)
        else:
            result.append(action)
    return result


def _earlier_position(before: list[Any], direction: str) -> int:
    """Where a receive of ``direction`` may go in ``before``: back over the other channel's
    actions and at most one compute action, stopping at its own channel's."""
    position = len(before)
    while position > 0:
        previous = before[position - 1]
        kind = previous.computation_type.value
        if _DIRECTION.get(kind) == direction or not (previous.is_compute_op or kind in _DIRECTION):
            return position
        position -= 1
        if previous.is_compute_op:
            return position
    return position
