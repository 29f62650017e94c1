"""The explicit tensor-parallel executor: a stage's blocks with all-reduces that overlap
compute, and recomputation that keeps communication (Oases, Li et al. 2023).

A stage that :func:`potluck.plans.explicit_tp` names runs its blocks here instead of
through DTensor's sequence-parallel styles. Its parameters are sharded exactly as those
styles shard them, but its blocks compute on local shards
(:func:`~potluck.runtime.parallel.tensor_parallel.apply_tp` with ``explicit``: column-wise
layers give their output shard, row-wise ones a partial sum) and this module communicates:

- **The stage's interface is unchanged**: it takes and gives sequence shards
  ``[b, s/t, h]`` (pipeline sends, embedding and head as before). The entry all-gathers
  the full ``[b, s, h]``, the blocks run on replicated full hidden states (no sequence
  parallelism), the exit keeps the rank's own slice. Backward, the exit all-gathers the
  slices' gradients; the gradient that then reaches the entry is the same full tensor
  on every rank, so the entry only slices it (no collective).
- **Parts and sub-batches**: a block is two parts, attention (norm, attention) and MLP
  (norm, MLP), each ending in a partial output. A micro-batch runs as
  ``tp_overlap_chunks`` sub-batches along the batch, part-major: each sub-batch waits
  for its previous all-reduce, adds the residual, computes the part and starts the
  part's all-reduce asynchronously, so one sub-batch's all-reduce travels while the
  next one computes.
- **The backward overlaps the same way**, run by the executor: each (part, sub-batch)
  is kept as two graphs cut at detached leaves, the norm's (from the part's input) and
  the sublayer's (from the norm's output). The stage's output carries a custom autograd
  function whose backward runs the parts in reverse order, sub-batches interleaved: the
  sublayer's backward gives a partial gradient of the norm's output (column-parallel
  inputs) and starts its all-reduce; the norm's backward waits for it, then the
  residual's gradient is added. The cut sits after the norm, so norm weights get their
  full gradient, as under DTensor.
- **Recomputation keeps communication**: a fully recomputed block's parts run without
  autograd in the forward and keep only their input; the backward rebuilds both graphs
  of a part from it (under the forward's autocast) right before the part's backward.
  No collective runs again: the all-reduced results live in the executor's residual
  stream. Selective recomputation is the attention module's own checkpoint
  (:mod:`~potluck.runtime.parallel.recompute`), communication-free here as well.

Parameters of a stage's blocks accumulate a gradient once per sub-batch (the gradient
sync's ``GradReady`` expects ``chunks`` per micro-batch of them). Every part's compute
runs through ``clock.run_segment`` (the forward: norm and sublayer; the backward: a
recomputation if any and the sublayer's backward, the norm's backward and residual add
running after the all-reduce, between segments), the entry's all-gather and the exit's
backward all-gather too, and every asynchronous all-reduce through ``clock.start_comm``.
Tensors kept for a recomputation are counted by the stage's memory ledger.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from potluck.ops import OpKind
from potluck.runtime.timing.clock import Clock, CommOp, NullClock, Segment, Waitable

ATTENTION, MLP = "attention", "mlp"
PARTS = (ATTENTION, MLP)
ENTRY, EXIT = "entry", "exit"
T = TypeVar("T")


class TPExecutor:
    """Runs one virtual stage's blocks over its TP ``group`` in ``chunks`` sub-batches."""

    def __init__(self, group: dist.ProcessGroup, chunks: int, stage_id: int,
                 clock: Clock | None = None) -> None:
        self.group = group
        self.tp = dist.get_world_size(group)
        self.index = dist.get_rank(group)
        self.chunks = chunks
        self.stage_id = stage_id
        self.clock: Clock = clock or NullClock()

    def run(self, stage: nn.Module, shard: torch.Tensor, seq_len: int) -> torch.Tensor:
        """The stage's blocks on this rank's sequence shard; its output's sequence shard."""
        full = self.segment(OpKind.TP_ALLREDUCE, ENTRY, -1, lambda: _Entry.apply(shard, self))
        blocks = _Pass(self, stage, full.detach(), seq_len)
        output = blocks.forward()
        if blocks.keep:
            anchor = full if full.requires_grad else full.detach().requires_grad_()
            probe = torch.zeros((), device=full.device, requires_grad=True)
            output = _Blocks.apply(anchor, probe, blocks, output)
        return _Exit.apply(output, self)

    def segment(self, kind: OpKind, part: str, layer: int, fn: Callable[[], T]) -> T:
        return self.clock.run_segment(Segment(kind, self.stage_id, part, layer, self.chunks), fn)

    def all_reduce(self, tensor: torch.Tensor, key: tuple[Any, ...]) -> _Pending:
        """Start summing ``tensor`` (in place) over the group."""
        work = dist.all_reduce(tensor, group=self.group, async_op=True)
        op = CommOp(OpKind.TP_ALLREDUCE, self.stage_id, key=key)
        return _Pending(self.clock.start_comm(op, work), tensor)

    def gather(self, shard: torch.Tensor) -> torch.Tensor:
        """The full sequence from every rank's shard (dimension 1)."""
        shard = shard.contiguous()
        parts = [torch.empty_like(shard) for _ in range(self.tp)]
        dist.all_gather(parts, shard, group=self.group)
        return torch.cat(parts, dim=1)

    def own_slice(self, full: torch.Tensor) -> torch.Tensor:
        return full.chunk(self.tp, dim=1)[self.index].contiguous()


@dataclass
class _Pending:
    """An all-reduce under way and the tensor it sums into."""

    work: Waitable
    tensor: torch.Tensor

    def result(self) -> torch.Tensor:
        self.work.wait()
        return self.tensor


class _Entry(torch.autograd.Function):
    """All-gather the sequence; backward: this rank's slice of the replicated gradient."""

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, executor: TPExecutor) -> torch.Tensor:
        ctx.executor = executor
        return executor.gather(shard)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.executor.own_slice(grad), None


class _Exit(torch.autograd.Function):
    """Keep this rank's slice of the sequence; backward: all-gather the slices' gradients."""

    @staticmethod
    def forward(ctx: Any, full: torch.Tensor, executor: TPExecutor) -> torch.Tensor:
        ctx.executor = executor
        return executor.own_slice(full)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        executor: TPExecutor = ctx.executor
        full = executor.segment(OpKind.TP_ALLREDUCE, EXIT, -1, lambda: executor.gather(grad))
        return full, None


class _Blocks(torch.autograd.Function):
    """Ties the blocks' output (computed by :class:`_Pass`) to their input: its backward is
    the executor's own backward pass. ``probe``, a leaf nobody asks the gradient of, tells
    whether that pass accumulates into leaves (:func:`_accumulates`)."""

    @staticmethod
    def forward(ctx: Any, full: torch.Tensor, probe: torch.Tensor, blocks: _Pass,
                output: torch.Tensor) -> torch.Tensor:
        ctx.blocks = blocks
        ctx.save_for_backward(probe)
        return output

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        blocks, ctx.blocks = ctx.blocks, None
        (probe,) = ctx.saved_tensors
        return blocks.backward(grad, _accumulates(probe)), None, None, None


def _accumulates(probe: torch.Tensor) -> bool:
    """Whether the backward pass under way accumulates into the leaves of the graph
    (``backward()``) rather than computing some inputs' gradients only (``autograd.grad``:
    torch's pipeline stages infer gradient shapes that way on their first step, with
    placeholder values that must not reach the parameters). ``probe`` is a leaf of that
    graph; torch's own checkpoint asks the engine the same way."""
    return torch._C._will_engine_execute_node(get_gradient_edge(probe).node)


@dataclass
class _Part:
    """One part of one block for one sub-batch: what its backward pass needs."""

    layer: int
    name: str  # ATTENTION or MLP
    block: nn.Module
    sub_batch: int
    bare: bool  # computed without autograd: rebuilt from ``x`` in the backward
    x: torch.Tensor | None  # the part's input (a leaf needing its gradient once built)
    norm_out: torch.Tensor | None = None  # the norm's output, its graph back to ``x``
    normed: torch.Tensor | None = None  # the same values detached: the sublayer's input
    out: GradientEdge | None = None  # the sublayer's output (its values are not kept)
    out_dtype: torch.dtype | None = None


def _settle(hidden: torch.Tensor, pending: _Pending | None) -> torch.Tensor:
    """The residual stream once the last part's all-reduce is in."""
    return hidden if pending is None else hidden + pending.result()


class _Pass:
    """One micro-batch through a stage's blocks: its forward, and its backward."""

    def __init__(self, executor: TPExecutor, stage: nn.Module, full: torch.Tensor,
                 seq_len: int) -> None:
        self.executor = executor
        self.stage = stage
        self.keep = torch.is_grad_enabled()
        self.inputs = list(full.tensor_split(executor.chunks))
        self.contexts = [stage.family.context(stage, x, seq_len) for x in self.inputs]
        device = full.device.type
        self.autocast = (device, torch.is_autocast_enabled(device),
                         torch.get_autocast_dtype(device))
        self.parts: list[list[_Part]] = []  # per block and part: one per sub-batch
        self.accumulate = True  # the backward pass accumulates parameter gradients

    # --- forward ------------------------------------------------------------------------

    def forward(self) -> torch.Tensor:
        hidden = list(self.inputs)
        pending: list[_Pending | None] = [None] * len(hidden)
        for name, block in self.stage.blocks.items():
            bare = name in self.stage.full_recompute or not self.keep
            for part in PARTS:
                group = []
                for i in range(len(hidden)):
                    hidden[i] = _settle(hidden[i], pending[i])
                    group.append(_Part(int(name), part, block, i, bare, hidden[i]))
                    pending[i] = self._forward_part(group[-1])
                if self.keep:
                    self.parts.append(group)
        return torch.cat([_settle(h, p) for h, p in zip(hidden, pending, strict=True)])

    def _forward_part(self, part: _Part) -> _Pending:
        partial = self.executor.segment(OpKind.FORWARD, part.name, part.layer,
                                        lambda: self._compute(part))
        return self.executor.all_reduce(partial, (part.name, part.layer, "forward"))

    def _compute(self, part: _Part) -> torch.Tensor:
        """The part's partial output, a tensor of its own for the all-reduce."""
        if not part.bare:
            return self._graph(part).detach().clone()
        with torch.no_grad():
            out = self._sublayer(part, self._norm(part)(part.x))
        ledger = self.stage.ledger
        if self.keep and ledger is not None:
            ledger.track(part.x)  # kept until the backward rebuilds the part
        return out

    def _graph(self, part: _Part) -> torch.Tensor:
        """Run the part with autograd, cut after its norm; the sublayer's output."""
        part.x = part.x.detach().requires_grad_()
        part.norm_out = self._norm(part)(part.x)
        part.normed = part.norm_out.detach().requires_grad_()
        out = self._sublayer(part, part.normed)
        part.out, part.out_dtype = get_gradient_edge(out), out.dtype
        return out

    def _norm(self, part: _Part) -> nn.Module:
        family = self.stage.family
        return getattr(part.block, family.norms[0 if part.name == ATTENTION else 1])

    def _sublayer(self, part: _Part, normed: torch.Tensor) -> torch.Tensor:
        if part.name == ATTENTION:
            return self.stage.family.attend(part.block, normed, self.contexts[part.sub_batch])
        return part.block.mlp(normed)

    # --- backward -----------------------------------------------------------------------

    def backward(self, grad: torch.Tensor, accumulate: bool) -> torch.Tensor:
        """The gradient of the blocks' input from their output's (both full, replicated);
        with ``accumulate``, the parameters' gradients accumulate too."""
        self.accumulate = accumulate
        grads = list(grad.tensor_split(self.executor.chunks))
        pending: list[tuple[_Part, _Pending] | None] = [None] * len(grads)
        for group in reversed(self.parts):
            for i, part in enumerate(group):
                grads[i] = self._finish(pending[i], grads[i])
                pending[i] = part, self._backward_part(part, grads[i])
        self.parts = []
        return torch.cat([self._finish(p, g) for p, g in zip(pending, grads, strict=True)])

    def _backward_part(self, part: _Part, grad: torch.Tensor) -> _Pending:
        partial = self.executor.segment(OpKind.BACKWARD, part.name, part.layer,
                                        lambda: self._sublayer_backward(part, grad))
        return self.executor.all_reduce(partial, (part.name, part.layer, "backward"))

    def _sublayer_backward(self, part: _Part, grad: torch.Tensor) -> torch.Tensor:
        """Rebuild the part if it was computed bare, run its sublayer's backward; the
        partial gradient of the norm's output."""
        if part.bare:
            self._rebuild(part)
        partial = self._input_grad(part.out, part.normed, grad.to(part.out_dtype))
        part.out = part.normed = None
        return partial

    def _input_grad(self, output: torch.Tensor | GradientEdge, leaf: torch.Tensor,
                    grad: torch.Tensor) -> torch.Tensor:
        """``leaf``'s gradient from ``output``'s, the parameters' accumulated on the way
        when the pass accumulates."""
        if not self.accumulate:
            return torch.autograd.grad(output, leaf, grad)[0]
        torch.autograd.backward(output, grad)
        return leaf.grad

    def _rebuild(self, part: _Part) -> None:
        device, enabled, dtype = self.autocast
        ledger = self.stage.ledger
        with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled), \
                ledger.recomputing() if ledger is not None else nullcontext():
            self._graph(part)

    def _finish(self, pending: tuple[_Part, _Pending] | None, grad: torch.Tensor
                ) -> torch.Tensor:
        """Once a part's all-reduce is in: its norm's backward, plus the residual's
        gradient; the gradient of the part's input."""
        if pending is None:
            return grad
        part, reduction = pending
        through_norm = self._input_grad(part.norm_out, part.x, reduction.result())
        part.x = part.norm_out = None
        return grad + through_norm
