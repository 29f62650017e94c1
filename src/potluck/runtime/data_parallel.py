"""Data parallelism across replicas with unequal batch shares and unequal layouts.

Every replica's loss is its share of the *global* token-weighted mean (token
losses summed, divided by the global batch's token count), so the gradient of
the whole batch is the plain **sum** of the replicas' gradients, whatever
their shares. :class:`GradSync` sums each parameter's gradient over the ranks
that hold the same parameter in every pipeline (the layout's sync group of its
unit: embedding, block ``i``, head, or the tied embedding/head):

- aligned groups (all holders shard the unit the same way): local shards are
  flattened into one bucket per group and all-reduced, as DDP would;
- full-layout groups (holders with different TP degrees): each rank writes
  its shard into a zero tensor of the full parameter's shape (a replicated
  parameter only from TP rank 0), the full tensors are summed, and each rank
  takes back its shard. Exact, and costs ``tp`` times the traffic of the
  aligned case; only heterogeneous plans pay it.

torch's DDP and FSDP2 assume one model layout on every replica and average
gradients, so neither fits uneven shares with per-layer groups; this module
is the small piece that is missing. It also computes the global gradient norm,
counting every parameter once (pipeline 0's copy, TP rank 0 for replicated
parameters).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from potluck.runtime.layout import Layout, SyncGroup

BUCKET_ELEMENTS = 2**25  # 128 MiB of fp32 gradients per all-reduce


@dataclass
class SyncedParam:
    """One local parameter, the unit it belongs to and where its gradient is summed."""

    name: str
    param: nn.Parameter
    unit: str
    group: SyncGroup


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def is_sharded(param: torch.Tensor) -> bool:
    """Whether the parameter is split over its TP group (rather than replicated)."""
    if not isinstance(param, DTensor):
        return False
    return any(not isinstance(p, Replicate) for p in param.placements)


class GradSync:
    """Sums gradients over each parameter's holders; knows which copy counts for the norm."""

    def __init__(self, layout: Layout, params: list[SyncedParam],
                 wire_dtype: torch.dtype | None = None) -> None:
        self.layout = layout
        self.params = params
        self.wire_dtype = wire_dtype  # e.g. bf16 on the wire; None: the gradients' own dtype
        self._buckets: dict[tuple[tuple[int, ...], bool], list[SyncedParam]] = defaultdict(list)
        for item in sorted(params, key=lambda item: (item.unit, item.name)):
            if not item.group.trivial:
                self._buckets[(item.group.ranks, item.group.aligned)].append(item)
        self._full_index: dict[str, torch.Tensor] = {}

    def sync(self) -> None:
        """Sum every gradient over its group (after the backward of all micro-batches)."""
        for item in self.params:
            _match_grad_layout(item.param)
        # Every rank walks its groups in one global order, so no two ranks wait on each other.
        for (ranks, aligned), items in sorted(self._buckets.items(), key=lambda kv: kv[0]):
            group = self.layout.group(ranks)
            for chunk in _chunks(items, aligned):
                if aligned:
                    self._sync_aligned(chunk, group)
                else:
                    self._sync_full(chunk, group)

    def _sync_aligned(self, items: list[SyncedParam], group: dist.ProcessGroup) -> None:
        grads = [_local(_grad(item.param)) for item in items]
        flat = self._on_wire(torch.cat([g.reshape(-1) for g in grads]))
        dist.all_reduce(flat, group=group)
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()

    def _sync_full(self, items: list[SyncedParam], group: dist.ProcessGroup) -> None:
        fulls = [self._to_full(item) for item in items]
        flat = self._on_wire(torch.cat([f.reshape(-1) for f in fulls]))
        dist.all_reduce(flat, group=group)
        offset = 0
        for item, full in zip(items, fulls, strict=True):
            summed = flat[offset:offset + full.numel()]
            offset += full.numel()
            local = _local(_grad(item.param))
            local.copy_(summed[self._index(item)].view_as(local))

    def _on_wire(self, flat: torch.Tensor) -> torch.Tensor:
        return flat if self.wire_dtype is None else flat.to(self.wire_dtype)

    def _index(self, item: SyncedParam) -> torch.Tensor:
        """Flat positions, in the full parameter, of this rank's local elements."""
        if item.name not in self._full_index:
            param = item.param
            positions = torch.arange(param.numel(), device=_local(param).device).view(param.shape)
            if isinstance(param, DTensor):
                positions = distribute_tensor(positions, param.device_mesh, param.placements,
                                              src_data_rank=None).to_local()
            self._full_index[item.name] = positions.reshape(-1)
        return self._full_index[item.name]

    def _to_full(self, item: SyncedParam) -> torch.Tensor:
        local = _local(_grad(item.param))
        full = local.new_zeros(item.param.numel())
        if is_sharded(item.param) or self.layout.role.tp_rank == 0:
            full[self._index(item)] = local.reshape(-1)
        return full

    def norm_squared(self) -> torch.Tensor:
        """This rank's part of the squared global gradient norm (sum over ranks = total)."""
        role = self.layout.role
        squares = []
        for item in self.params:
            if self.layout.norm_owner(item.unit) != (role.pipeline, role.stage):
                continue
            if not is_sharded(item.param) and role.tp_rank != 0:
                continue
            grad = item.param.grad
            if grad is not None:
                squares.append(_local(grad).detach().double().pow(2).sum())
        if not squares:
            return torch.zeros((), dtype=torch.float64)
        return torch.stack(squares).sum()


def _chunks(items: list[SyncedParam], aligned: bool) -> list[list[SyncedParam]]:
    """Consecutive runs of at most BUCKET_ELEMENTS elements (one all-reduce each), so the
    flat copy of a bucket stays small next to the gradients themselves."""
    chunks: list[list[SyncedParam]] = [[]]
    size = 0
    for item in items:
        numel = _local(item.param).numel() if aligned else item.param.numel()
        if chunks[-1] and size + numel > BUCKET_ELEMENTS:
            chunks.append([])
            size = 0
        chunks[-1].append(item)
        size += numel
    return chunks


def _match_grad_layout(param: nn.Parameter) -> None:
    """Give a DTensor gradient its parameter's placements (DTensor may hand back, say, a
    replicated gradient for a vocabulary-sharded embedding; slicing it costs nothing)."""
    grad = param.grad
    if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(param.placements):
        param.grad = grad.redistribute(param.device_mesh, param.placements)


def _grad(param: nn.Parameter) -> torch.Tensor:
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    return param.grad
