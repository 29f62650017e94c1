"""What one training step is made of: the kinds of op, shared by every layer that names them.

The pipeline schedules order compute ops of these kinds, the simulator runs
them, the runtime's clocks time them, traces record them (their ``name``)
and calibration reads them back. One enum, so a kind is spelled once; its
values are the names written in trace files, so traces stay readable by
older and newer potluck alike.

Compute ops run on a device's compute stream: a micro-batch's ``forward``
and ``backward`` on a stage (zero bubble splits the backward into
``backward_input`` and a deferred ``backward_weight``) and the
``optimizer`` step. Communication ops run beside them: the pipeline's sends
and receives between stages, the tensor-parallel collectives inside a
forward or backward, and the data-parallel gradient reduction.
"""

from __future__ import annotations

from enum import Enum


class OpKind(str, Enum):
    """One kind of op in a training step; the value is its name in traces."""

    FORWARD = "forward"
    BACKWARD = "backward"  # full backward: input and weight gradients
    BACKWARD_INPUT = "backward_input"  # zero bubble: input gradients only
    BACKWARD_WEIGHT = "backward_weight"  # zero bubble: the deferred weight gradients
    OPTIMIZER = "optimizer"
    SEND_FORWARD = "send_forward"  # activations to the next stage
    RECV_FORWARD = "recv_forward"
    SEND_BACKWARD = "send_backward"  # gradients to the previous stage
    RECV_BACKWARD = "recv_backward"
    TP_ALLREDUCE = "tp_allreduce"  # a forward's or backward's tensor-parallel collectives
    DP_ALLREDUCE = "dp_allreduce"  # the gradient reduction across data-parallel replicas
    PARAM_ALLGATHER = "param_allgather"  # ZeRO-1/2: updated parameters back to every replica
    OUTER_SYNC = "outer_sync"  # islands: a fragment's exchange across islands (diloco, bounded)

    def __str__(self) -> str:
        """The trace name, also in f-strings (as on every Python version)."""
        return self.value

    @property
    def is_comm(self) -> bool:
        """Whether the op moves data between devices (it runs on a ``comm`` stream)."""
        return self in _COMM

    @property
    def is_backward(self) -> bool:
        """A backward pass or part of one (the ops that produce gradients)."""
        return self in (OpKind.BACKWARD, OpKind.BACKWARD_INPUT, OpKind.BACKWARD_WEIGHT)

    @property
    def is_pipeline_compute(self) -> bool:
        """A forward or backward of one micro-batch on one stage."""
        return self is OpKind.FORWARD or self.is_backward


_COMM = frozenset({OpKind.SEND_FORWARD, OpKind.RECV_FORWARD, OpKind.SEND_BACKWARD,
                   OpKind.RECV_BACKWARD, OpKind.TP_ALLREDUCE, OpKind.DP_ALLREDUCE,
                   OpKind.PARAM_ALLGATHER, OpKind.OUTER_SYNC})
