"""ZeRO-2: gradients reduce-scattered to their owners after every micro-batch, not kept whole.

Under ``plan.zero >= 2`` every bucket that ZeRO-1 reduce-scatters
(:func:`potluck.runtime.grads.zero.scatters`: aligned, not the tied weight) is
reduce-scattered **once per micro-batch**, as soon as that micro-batch's
backward pass has accumulated every gradient of the bucket
(:class:`~potluck.runtime.grads.grad_ready.GradReady` with one level per
micro-batch). The flat send buffer takes a copy of the bucket's gradients and
the full-size ``.grad`` tensors are dropped at once (the next micro-batch
allocates fresh ones), so a device holds the full-size gradients of the
buckets still being computed, plus its own shard of the accumulated sum: the
owner adds each reduce-scatter's output into an accumulator of its slot
(:class:`~potluck.runtime.grads.zero.OwnerSlots`). After the schedule the
accumulated shard becomes the owned parameters' ``.grad``; the parameters this
rank does not own have none, which the ZeRO-1 step hook and the norm already
expect. The optimizer step and the parameter all-gather are ZeRO-1's.

Replicas of a heterogeneous plan may run different numbers of micro-batches,
and a reduce-scatter is a collective: every member of a bucket's group launches
``M`` of them, ``M`` the fewest micro-batches among the group's pipelines; a
rank with ``m > M`` launches its ``k``-th after ``ceil(k m / M)`` micro-batches
(sending what accumulated since the previous one). Uniform plans reduce after
every micro-batch. Full-layout buckets (members with different TP degrees)
and the tied weight keep ZeRO-1's behaviour: one sum after the last micro-batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from potluck.runtime.grads.buckets import Bucket, local
from potluck.runtime.grads.zero import OwnerSlots, read_slot, write_slot
from potluck.runtime.layout import Layout


def reduction_counts(layout: Layout, bucket: Bucket, micro_batches: int) -> tuple[int, ...]:
    """After how many of this rank's micro-batches each of the bucket's reduce-scatters
    starts (the last after all of them)."""
    plan = layout.plan
    fewest = min(plan.pipelines[layout.roles[r].pipeline].num_micro_batches
                 for r in bucket.ranks)
    return tuple(math.ceil(k * micro_batches / fewest) for k in range(1, fewest + 1))


@dataclass
class _Pending:
    out: torch.Tensor
    work: dist.Work
    sent: torch.Tensor  # kept alive until the collective is done


class ShardedGrads:
    """Per-micro-batch reduce-scatters of the scattering buckets and each owner's sum."""

    def __init__(self, wire_dtype: torch.dtype | None) -> None:
        self.wire_dtype = wire_dtype
        self._sums: dict[int, torch.Tensor] = {}  # id(bucket) -> this rank's slot, summed
        self._pending: dict[int, list[_Pending]] = {}
        self.launched = 0  # reduce-scatters this step (for tests and logs)

    def start(self) -> None:
        self._sums = {}
        self._pending = {}
        self.launched = 0

    def launch(self, bucket: Bucket, slots: OwnerSlots) -> None:
        """Reduce-scatter what the bucket's gradients hold now, then drop them."""
        self._fold(bucket)
        grads = []
        for item in bucket.items:
            grad = item.param.grad
            grads.append(local(grad) if grad is not None else torch.zeros_like(local(item.param)))
        flat = grads[0].new_zeros(slots.numel,
                                  dtype=self.wire_dtype or grads[0].dtype)
        for slot, indices in enumerate(slots.members):
            write_slot(flat[slot * slots.width:], grads, indices)
        for item in bucket.items:
            item.param.grad = None
        out = flat.new_empty(slots.width)
        work = dist.reduce_scatter_single(out, flat, group=bucket.group, async_op=True)
        self._pending.setdefault(id(bucket), []).append(_Pending(out, work, flat))
        self.launched += 1

    def _fold(self, bucket: Bucket) -> None:
        """Add the finished reduce-scatters of ``bucket`` into its sum, kept in at least FP32
        (16-bit gradients are rounded once, when written back, as DeepSpeed and torch AMP
        accumulate)."""
        for pending in self._pending.pop(id(bucket), []):
            pending.work.wait()
            total = self._sums.get(id(bucket))
            if total is None:
                dtype = torch.promote_types(local(bucket.items[0].param).dtype, torch.float32)
                self._sums[id(bucket)] = pending.out.to(dtype)
            else:
                total.add_(pending.out)

    def write_back(self, bucket: Bucket, slots: OwnerSlots) -> None:
        """The owned parameters' gradients become this rank's summed shard; the others none."""
        self._fold(bucket)
        total = self._sums.pop(id(bucket))
        grads = []
        for i, item in enumerate(bucket.items):
            if i in slots.mine:
                item.param.grad = torch.zeros_like(item.param)
            else:
                item.param.grad = None
            grads.append(local(item.param.grad) if i in slots.mine else None)
        read_slot(total, grads, slots.mine)
