"""Gradients as views of their bucket's flat tensor, so a bucket is summed where autograd
wrote it: no concatenated copy before the collective and no copy back after it (DDP's
``gradient_as_bucket_view``; Megatron-LM's contiguous gradient buffer does the same).

A :class:`BucketViews` holds one flat tensor per eligible bucket and makes each of the
bucket's parameters' ``.grad`` a view of its place there; autograd then accumulates every
micro-batch's gradient in place (``AccumulateGrad`` adds into an existing ``.grad``) and
the optimizer zeroes it in place (``zero_grad(set_to_none=False)``), so the views last
from step to step. The layout follows the bucket's collective:

- an all-reduced bucket: its items back to back, the flat tensor is the all-reduce's
  buffer and the sums land in the gradients themselves;
- a ZeRO-1 reduce-scattered bucket: one slot per member of the bucket's group, holding the
  items that member owns, back to back, padded to the slot width
  (:class:`~potluck.runtime.grads.zero.OwnerSlots`): the flat tensor is the
  reduce-scatter's input, and only the owner's share (1/d of the bucket) is copied back.

Left with their own tensors (and the copying path): buckets summed in the full layout
(members shard a parameter differently), on a wire dtype other than the gradients' (the
cast is a copy anyway), ZeRO-2's per-micro-batch reduce-scatters (the send buffer must
stay intact while the next micro-batch accumulates; DeepSpeed's stage 2 copies too), the
sparse embedding gradient, and any gradient something else replaced (a DTensor gradient
redistributed to its parameter's placements): :meth:`BucketViews.flat` checks that every
item's gradient is still its view before the collective uses the buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from potluck.runtime.grads.buckets import Bucket, local
from potluck.runtime.grads.zero import OwnerSlots, back_to_back


@dataclass(frozen=True)
class _Layout:
    """Where each item of a bucket sits in its flat tensor."""

    offsets: tuple[int, ...]  # per item, in elements
    numel: int  # the flat tensor's elements


def _layout(bucket: Bucket, slots: OwnerSlots | None) -> _Layout:
    sizes = [local(item.param).numel() for item in bucket.items]
    if slots is None:
        return _Layout(tuple(back_to_back(sizes)), sum(sizes))
    return _Layout(slots.offsets(sizes), slots.numel)


class BucketViews:
    """The flat gradient tensors of the buckets whose gradients live in them."""

    def __init__(self, buckets: Sequence[Bucket], slots: dict[int, OwnerSlots]) -> None:
        """``buckets``: the eligible ones (aligned, summed in the gradients' dtype, once a
        step); ``slots``: the ZeRO-1 layout of those reduce-scattered, by ``id``."""
        self._layouts = {id(b): _layout(b, slots.get(id(b))) for b in buckets}
        self._buckets = list(buckets)
        self._flats: dict[int, torch.Tensor] = {}

    def __contains__(self, bucket: Bucket) -> bool:
        return id(bucket) in self._layouts

    def install(self) -> None:
        """Before a step: make every eligible gradient a view of its bucket's flat tensor
        (a gradient already there keeps its values; none yet is zero). Nothing to do once
        the views are in place."""
        for bucket in self._buckets:
            if not self._intact(bucket):
                self._install(bucket)

    def flat(self, bucket: Bucket) -> torch.Tensor | None:
        """The bucket's flat tensor, holding its gradients now; None where some gradient
        is no longer its view (the caller copies then)."""
        return self._flats[id(bucket)] if self._intact(bucket) else None

    def _install(self, bucket: Bucket) -> None:
        layout = self._layouts[id(bucket)]
        first = local(bucket.items[0].param)
        flat = self._flats.get(id(bucket))
        if flat is None:
            flat = first.new_zeros(layout.numel, dtype=first.dtype)
            self._flats[id(bucket)] = flat
        else:
            flat.zero_()
        for item, offset in zip(bucket.items, layout.offsets, strict=True):
            param = item.param
            shard = local(param)
            view = flat[offset:offset + shard.numel()].view(shard.shape)
            if param.grad is not None:
                view.copy_(local(param.grad))
            param.grad = _as_grad(param, view)

    def _intact(self, bucket: Bucket) -> bool:
        flat = self._flats.get(id(bucket))
        if flat is None:
            return False
        layout = self._layouts[id(bucket)]
        base = flat.data_ptr()
        for item, offset in zip(bucket.items, layout.offsets, strict=True):
            grad = item.param.grad
            if grad is None:
                return False
            tensor = local(grad)
            if tensor.data_ptr() != base + offset * flat.element_size() \
                    or not tensor.is_contiguous():
                return False
        return True


def _as_grad(param: nn.Parameter, view: torch.Tensor) -> torch.Tensor:
    """``view`` as ``param``'s gradient: a DTensor of the parameter's mesh and placements
    for a DTensor parameter, else the view itself."""
    if isinstance(param, DTensor):
        return DTensor.from_local(view, param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
    return view
