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
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from potluck.placement import EMBED, HEAD, TIED
from potluck.runtime.layout import Layout, SyncGroup

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
    return num_layers - int(unit.split(".", 1)[1])


def plan_buckets(layout: Layout, params: list[SyncedParam],
                 bucket_elements: int = BUCKET_ELEMENTS) -> list[Bucket]:
    """This rank's buckets (groups of more than one rank only), in launch order."""
    layers = layout.plan.model.num_layers
    by_group: dict[tuple[tuple[int, ...], bool], list[SyncedParam]] = defaultdict(list)
    for item in sorted(params, key=lambda item: (unit_order(item.unit, layers), item.name)):
        if not item.group.trivial:
            by_group[(item.group.ranks, item.group.aligned)].append(item)
    keyed = []
    for (ranks, aligned), items in by_group.items():
        group = layout.sync_process_group(ranks)
        for chunk in _chunks(items, aligned, bucket_elements):
            key = (unit_order(chunk[0].unit, layers), ranks, aligned)
            keyed.append((key, Bucket(ranks, aligned, tuple(chunk), group)))
    return [bucket for _, bucket in sorted(keyed, key=lambda pair: pair[0])]


def _chunks(items: list[SyncedParam], aligned: bool, limit: int) -> list[list[SyncedParam]]:
    """Consecutive runs of at most ``limit`` elements (one collective each), so the flat
    copy of a bucket stays small next to the gradients themselves."""
    chunks: list[list[SyncedParam]] = [[]]
    size = 0
    for item in items:
        numel = local(item.param).numel() if aligned else item.param.numel()
        if chunks[-1] and size + numel > limit:
            chunks.append([])
            size = 0
        chunks[-1].append(item)
        size += numel
    return chunks


class FullLayout:
    """Puts local shards into full-size flat tensors and takes them back out (the
    full-layout groups, whose members shard a parameter differently)."""

    def __init__(self, tp_rank: int) -> None:
        self.tp_rank = tp_rank
        self._index: dict[int, torch.Tensor] = {}

    def index(self, param: nn.Parameter) -> torch.Tensor:
        """Flat positions, in the full parameter, of this rank's local elements."""
        key = id(param)
        if key not in self._index:
            positions = torch.arange(param.numel(), device=local(param).device).view(param.shape)
            if isinstance(param, DTensor):
                positions = distribute_tensor(positions, param.device_mesh, param.placements,
                                              src_data_rank=None).to_local()
            self._index[key] = positions.reshape(-1)
        return self._index[key]

    def to_full(self, param: nn.Parameter, values: torch.Tensor, contributes: bool = True
                ) -> torch.Tensor:
        """A zero tensor of the full parameter's size holding this rank's ``values`` (its
        local shard of a parameter or gradient); a replicated parameter only from TP rank 0."""
        full = values.new_zeros(param.numel())
        if contributes and (is_sharded(param) or self.tp_rank == 0):
            full[self.index(param)] = values.reshape(-1)
        return full

    def take(self, param: nn.Parameter, full: torch.Tensor, out: torch.Tensor) -> None:
        """Copy this rank's elements of the flat full tensor ``full`` into ``out``."""
        out.copy_(full[self.index(param)].view_as(out))
