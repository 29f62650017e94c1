"""Pipelines whose stages have different tensor-parallel degrees (say 1 A100, then 2 3090s).

Between stages of equal TP degree, rank ``r`` of one stage sends its sequence
shard to rank ``r`` of the next (one pipeline lane per TP rank). When degrees
differ, the pipeline instead runs on its **leaders** (TP rank 0 of every
stage): only leaders run torch's schedule and exchange full activations
``[b, s, h]``. Inside a stage with several ranks:

- :func:`from_leader` broadcasts the leader's received activation and gives
  each rank its sequence shard (backward: all-gather the shards' gradients, so
  the leader has the full input gradient to send back);
- :func:`to_leader` all-gathers the stage's output shards into the full
  activation the leader sends (backward: broadcast the leader's received
  gradient and keep this rank's shard);
- the other ranks (**followers**) mirror their leader's schedule: before each
  forward or backward, the leader broadcasts a command ``(op, stage, micro-batch)``
  and the followers run the same computation (the loss included, on the last
  stage), so every TP collective lines up. Followers take token ids and
  targets from their own copy of the replica's rows. The leader's first-step
  shape inference (one forward, one input-gradient pass) is mirrored too.

A leader never blocks the host for its followers: commands and activation headers go
to the device from pinned memory without blocking (:func:`device_longs`), and the leader
never reads them back. Only followers read what they receive (they must know what to run
and what shape to allocate).

Zero-bubble's split backward is not mirrored, so zero bubble is never planned
for such pipelines (:mod:`potluck.schedules.zero_bubble`; plan checks refuse it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from potluck.ops import OpKind
from potluck.runtime.timing.clock import Clock, NullClock

DONE, FORWARD, BACKWARD, INFER_FORWARD, INFER_BACKWARD = 0, 1, 2, 3, 4
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_HEADER = 8


class TPGroup:
    """The ranks of one stage, by group rank (the TP mesh's order, whatever order the plan
    lists the stage's devices in); group rank 0 is the leader."""

    def __init__(self, group: dist.ProcessGroup, rank: int, device: torch.device) -> None:
        self.group = group
        self.ranks = tuple(dist.get_process_group_ranks(group))
        self.leader = self.ranks[0]
        self.index = self.ranks.index(rank)
        self.size = len(self.ranks)
        self.device = device

    @property
    def is_leader(self) -> bool:
        return self.index == 0

    def broadcast(self, tensor: torch.Tensor) -> None:
        dist.broadcast(tensor, src=self.leader, group=self.group)


def device_longs(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """``values`` as a long tensor on ``device``, without blocking the host. A tensor built
    from Python values on an accelerator (``torch.tensor(values, device=...)``) is made in
    pageable host memory and copied with ``non_blocking=False``, which waits for the device
    to finish all queued work; from pinned memory the copy is queued instead (torch's caching
    host allocator keeps the pinned block until the copy has run)."""
    host = torch.tensor(values, dtype=torch.long)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _header(x: torch.Tensor) -> list[int]:
    """What followers need to allocate ``x``: dimensions, dtype, shape."""
    header = [x.dim(), _DTYPES.index(x.dtype), *x.shape]
    return header + [0] * (_HEADER - len(header))


def _broadcast_activation(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    if tp.is_leader:
        tp.broadcast(device_longs(_header(x), tp.device))
        full = x.contiguous()
    else:
        header = torch.zeros(_HEADER, dtype=torch.long, device=tp.device)
        tp.broadcast(header)
        ndim, dtype, *shape = header.tolist()
        full = torch.empty(tuple(shape[:ndim]), dtype=_DTYPES[dtype], device=tp.device)
    tp.broadcast(full)
    return full


class _FromLeader(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
        ctx.tp = tp
        full = _broadcast_activation(x, tp)
        return full.chunk(tp.size, dim=1)[tp.index].contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        tp: TPGroup = ctx.tp
        parts = [torch.empty_like(grad) for _ in range(tp.size)]
        dist.all_gather(parts, grad.contiguous(), group=tp.group)
        return (torch.cat(parts, dim=1) if tp.is_leader else None), None


class _ToLeader(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, tp: TPGroup) -> torch.Tensor:
        ctx.tp = tp
        parts = [torch.empty_like(shard) for _ in range(tp.size)]
        dist.all_gather(parts, shard.contiguous(), group=tp.group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        tp: TPGroup = ctx.tp
        grad = grad.contiguous()
        tp.broadcast(grad)  # followers' own incoming gradient is a placeholder
        return grad.chunk(tp.size, dim=1)[tp.index].contiguous(), None


def from_leader(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """The leader's full activation, as this rank's sequence shard (followers pass a
    placeholder that requires grad, so the backward collective runs on every rank)."""
    return _FromLeader.apply(x, tp)


def to_leader(shard: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """The full activation from every rank's sequence shard."""
    return _ToLeader.apply(shard, tp)


def placeholder(device: torch.device) -> torch.Tensor:
    return torch.empty(0, device=device, requires_grad=True)


class Commands:
    """What a leader tells its followers to run next."""

    def __init__(self, tp: TPGroup) -> None:
        self.tp = tp

    def announce(self, op: int, stage_id: int, micro_batch: int) -> None:
        self.tp.broadcast(device_longs([op, stage_id, micro_batch], self.tp.device))

    def done(self) -> None:
        self.announce(DONE, -1, -1)

    def receive(self) -> tuple[int, int, int]:
        command = torch.zeros(3, dtype=torch.long, device=self.tp.device)
        self.tp.broadcast(command)
        op, stage_id, micro_batch = command.tolist()
        return op, stage_id, micro_batch


class FollowerSchedule:
    """A follower's schedule: run whatever the leader announces, until it says done."""

    def __init__(self, modules: dict[int, Any], commands: Commands, n_microbatches: int,
                 loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
                 clock: Clock = NullClock()) -> None:
        self.modules = modules
        self.commands = commands
        self.n_microbatches = n_microbatches
        self.loss_fn = loss_fn
        self.clock = clock

    def step(self, *args: torch.Tensor, target: torch.Tensor | None = None,
             losses: list | None = None, return_outputs: bool = False) -> None:
        inputs = args[0].tensor_split(self.n_microbatches) if args else None
        targets = target.tensor_split(self.n_microbatches) if target is not None else None
        pending: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}
        while True:
            op, stage_id, micro_batch = self.commands.receive()
            if op == DONE:
                return
            key = (stage_id, micro_batch)
            if op in (FORWARD, INFER_FORWARD):
                run = partial(self._forward, stage_id, micro_batch, inputs, targets)
                pending[key] = run() if op == INFER_FORWARD else self.clock.run(
                    OpKind.FORWARD, stage_id, run)
            elif op == INFER_BACKWARD:
                _input_grads(*pending.pop(key))
            else:
                output, _ = pending.pop(key)
                self.clock.run(OpKind.BACKWARD, stage_id, partial(_backward, output))

    def _forward(self, stage_id: int, micro_batch: int, inputs: Any, targets: Any
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The stage's output (or loss, on the last stage) and its placeholder input."""
        module = self.modules[stage_id]
        x = inputs[micro_batch] if module.first else placeholder(self.commands.tp.device)
        out = module(x)
        if module.last:
            out = self.loss_fn(out, targets[micro_batch])
        return out, (None if module.first else x)


def _input_grads(output: torch.Tensor, x: torch.Tensor | None) -> None:
    """Mirror of the leader's shape inference: gradients for the stage input only."""
    if x is None:
        return  # token ids need no gradient; the leader skips this pass as well
    grad_output = None if output.dim() == 0 else torch.ones_like(output)
    torch.autograd.grad([output], [x], grad_outputs=grad_output, allow_unused=True)


def _backward(output: torch.Tensor) -> None:
    if output.dim() == 0:
        output.backward()
    else:
        torch.autograd.backward(output, torch.zeros_like(output))
