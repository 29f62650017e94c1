"""Gradient buckets: which local parameters are summed together, over which ranks, in what order.

Every local parameter belongs to a unit (the embedding, block ``i``, the head,
or the tied embedding/head) and the unit to a sync group: the ranks that hold
it in every pipeline (:meth:`potluck.runtime.layout.Layout.sync_group`). A
:class:`Bucket` is a run of parameters of one group that cross the wire as
one flat tensor: at most ``bucket_elements`` elements, local shards where the
group is aligned (every member shards the unit alike), full tensors where it
is not (members with different TP degrees meet in the full layout).

Buckets are ordered the way one backward pass finishes them: head first, then
the blocks from last to first, then the embedding, then the tied weight. The
order is a pure function of the plan, so every rank sorts the buckets it
shares with any other rank alike, and launching collectives in that order
never deadlocks (NCCL needs one order across communicators; DDP does the same).
Both the gradient sum (:mod:`potluck.runtime.grads.data_parallel`) and ZeRO-1's
parameter gather (:mod:`potluck.runtime.grads.zero`) walk these buckets.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import reduce

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from potluck.placement import EMBED, HEAD, TIED, block_index
from potluck.runtime.layout import Layout, SyncGroup
from potluck.runtime.shards import ShardIndex, shard_index

BUCKET_ELEMENTS = 2**25  # 128 MiB of fp32 gradients per all-reduce


@dataclass
class SyncedParam:
    """One local parameter, the unit it belongs to and where its gradient is summed."""

    name: str
    param: nn.Parameter
    unit: str
    group: SyncGroup


@dataclass(frozen=True)
class Bucket:
    """Parameters of one sync group that travel as one flat tensor."""

    ranks: tuple[int, ...]
    aligned: bool  # True: local shards line up on every member; False: full layout
    items: tuple[SyncedParam, ...]
    group: dist.ProcessGroup | None


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def is_sharded(param: torch.Tensor) -> bool:
    """Whether the parameter is split over its TP group (rather than replicated)."""
    if not isinstance(param, DTensor):
        return False
    return any(not isinstance(p, Replicate) for p in param.placements)


def unit_order(unit: str, num_layers: int) -> int:
    """Position of ``unit`` in the order one backward pass finishes its gradients."""
    if unit == HEAD:
        return 0
    if unit == EMBED:
        return num_layers + 1
    if unit == TIED:
        return num_layers + 2
    return num_layers - block_index(unit)


def plan_buckets(layout: Layout, params: list[SyncedParam],
                 bucket_elements: int = BUCKET_ELEMENTS,
                 alone: frozenset[str] = frozenset()) -> list[Bucket]:
    """This rank's buckets (groups of more than one rank only), in launch order; the
    parameters named in ``alone`` get a bucket each (the sparse embedding gradient)."""
    layers = layout.plan.model.num_layers
    by_group: dict[tuple[tuple[int, ...], bool], list[SyncedParam]] = defaultdict(list)
    for item in sorted(params, key=lambda item: (unit_order(item.unit, layers), item.name)):
        if not item.group.trivial:
            by_group[(item.group.ranks, item.group.aligned)].append(item)
    keyed = []
    for (ranks, aligned), items in by_group.items():
        group = layout.sync_process_group(ranks)
        for chunk in _chunks(items, aligned, bucket_elements, alone):
            key = (unit_order(chunk[0].unit, layers), ranks, aligned)
            keyed.append((key, Bucket(ranks, aligned, tuple(chunk), group)))
    return [bucket for _, bucket in sorted(keyed, key=lambda pair: pair[0])]


def _chunks(items: list[SyncedParam], aligned: bool, limit: int,
            alone: frozenset[str] = frozenset()) -> list[list[SyncedParam]]:
    """Consecutive runs of at most ``limit`` elements (one collective each), so the flat
    copy of a bucket stays small next to the gradients themselves; an item named in
    ``alone`` is a run of its own."""
    chunks: list[list[SyncedParam]] = [[]]
    size = 0
    for item in items:
        numel = local(item.param).numel() if aligned else item.param.numel()
        if chunks[-1] and (size + numel > limit or item.name in alone
                           or chunks[-1][-1].name in alone):
            chunks.append([])
            size = 0
        chunks[-1].append(item)
        size += numel
    return chunks


class FullLayout:
    """Puts local shards into full-size flat tensors and takes them back out (the
    full-layout groups, whose members shard a parameter differently). Where a shard
    goes is a :class:`~potluck.runtime.shards.ShardIndex`: positions along the one
    sharded dimension, never an index of the parameter's size (a full-size int64
    index of a 128k x 8k embedding would be 8.4 GB, made inside a backward hook)."""

    def __init__(self, tp_rank: int) -> None:
        self.tp_rank = tp_rank
        self._index: dict[int, ShardIndex] = {}

    def index(self, param: nn.Parameter) -> ShardIndex:
        """Where this rank's local elements of ``param`` sit in the full parameter."""
        key = id(param)
        if key not in self._index:
            self._index[key] = shard_index(param)
        return self._index[key]

    def write(self, param: nn.Parameter, values: torch.Tensor, out: torch.Tensor,
              contributes: bool = True) -> None:
        """Fill the flat ``out`` (the full parameter's size) with zeros and this rank's
        ``values`` (its local shard of a parameter or gradient) in their places; a
        replicated parameter only from TP rank 0."""
        out.zero_()
        if contributes and (is_sharded(param) or self.tp_rank == 0):
            self.index(param).write(out, values)

    def take(self, param: nn.Parameter, full: torch.Tensor, out: torch.Tensor) -> None:
        """Copy this rank's elements of the flat full tensor ``full`` into ``out``."""
        self.index(param).read(full, out)

    def flat(self, items: Sequence[SyncedParam], values: Sequence[torch.Tensor],
             dtype: torch.dtype | None = None,
             contributes: Sequence[bool] | None = None) -> torch.Tensor:
        """One flat tensor of the items' full sizes, each written by :meth:`write` (built
        in place: no per-item full tensor, no concatenated copy)."""
        dtype = dtype or reduce(torch.promote_types, (value.dtype for value in values))
        flat = values[0].new_empty(sum(item.param.numel() for item in items), dtype=dtype)
        offset = 0
        for i, (item, value) in enumerate(zip(items, values, strict=True)):
            size = item.param.numel()
            self.write(item.param, value, flat[offset:offset + size],
                       contributes=contributes[i] if contributes is not None else True)
            offset += size
        return flat
