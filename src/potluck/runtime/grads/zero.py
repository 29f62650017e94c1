"""ZeRO-1: optimizer states sharded over the replicas that hold the same parameters.

Every pipeline holds every unit (the embedding, each block, the head), laid
out its own way. With ``plan.shards_optimizer`` (ZeRO-1 or higher) each parameter gets one
**owner pipeline**, and only the owner's rank(s) holding the parameter keep its
optimizer state (AdamW's moments and step) and update it:

- owners are chosen per holder set (the stages holding a unit, one per
  pipeline), largest parameters first, each to the holder whose share of
  the set's elements, relative to its device memory (the memory of the
  stage's smallest device, :func:`holder_memory_bytes`), would be smallest after
  taking it. Each holder keeps the states of a share of the set's
  parameters proportional to its memory (Cephalo's uneven shards): with
  equal memory about ``1/d`` each, and each rank about ``1/d`` of its
  unsharded states, as the cost model assumes (``4 + 12/d`` bytes per
  parameter). It is a pure function of the plan and the parameters' full
  shapes, so every rank agrees without talking. The tied embedding/head belongs to
  pipeline 0 (both its copies when that pipeline has several stages), which
  keeps checkpoints keyed by the same names as without ZeRO-1; holder sets
  whose stages all hold the tied weight count it in pipeline 0's load.
- the optimizer is any torch optimizer over all local parameters. A step
  pre-hook hides the gradients of parameters this rank does not own (torch
  optimizers skip parameters without a gradient, and create no state for
  them); the post-hook puts them back. The runtime keeps no fp32 master
  copy (parameters are fp32, autocast computes in 16 bits), so the moments
  are all there is to shard.
- :meth:`Zero1.gather_parameters` then copies the owners' updated values to
  the other holders, bucket by bucket (the gradient buckets,
  :mod:`potluck.runtime.grads.buckets`): aligned buckets all-gather each member's
  owned local shards (padded to the largest); full-layout buckets sum
  full-size tensors to which only the owner contributes (``x + 0 = x``). Under the
  data-parallel priority schedule the same all-gathers are started per bucket
  (:meth:`Zero1.launch_gather`) and left in flight into the next forward
  (:mod:`potluck.runtime.grads.gather`).

Numerics equal the unsharded optimizer: every holder would have applied the
same elementwise update to the same values and gradients. The gradients of
buckets that :func:`scatters` are reduce-scattered to their owners in the same
padded layout (:mod:`potluck.runtime.grads.data_parallel`), so gradients and updates
together cost one all-reduce's traffic; only the owner's copy of such a
gradient holds the sum, and only it counts in the global norm.

torch's ``ZeroRedundancyOptimizer`` is not used: it shards one parameter list
over one process group, with the same dense parameters on every rank, while a
rank here holds units of several groups (per-layer groups, the tied weight),
DTensor shards, and in heterogeneous plans differently sharded copies; its
state dict is consolidated on one rank rather than saved per FQN with DCP,
and it broadcasts inside ``step``, which DCP also calls to initialize states.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import reduce
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from potluck.cluster.topology import Cluster
from potluck.placement import TIED
from potluck.plans import Plan
from potluck.runtime.grads.buckets import Bucket, FullLayout, SyncedParam, local
from potluck.runtime.layout import Layout

Holder = tuple[int, int]  # (pipeline, stage)


def assign_owners(layout: Layout, params: list[SyncedParam]) -> dict[str, int]:
    """The owner pipeline of each local parameter, by name (see the module docstring)."""
    plan = layout.plan
    by_holders: dict[tuple[Holder, ...], list[SyncedParam]] = defaultdict(list)
    for item in params:
        by_holders[layout.holders(item.unit)].append(item)
    tied_holders = set(layout.holders(TIED)) if plan.model.tied_embeddings else set()
    tied_numel = sum(item.param.numel() for item in params if item.unit == TIED)
    memory = holder_memory_bytes(plan)
    first = layout.island_pipelines[0]  # pipeline 0, or the first of this rank's island
    owners: dict[str, int] = {}
    for holders, items in by_holders.items():
        load = [0] * len(holders)  # parameter elements whose states each holder keeps
        weight = [memory[h] for h in holders]
        if tied_numel and all(h in tied_holders for h in holders):
            load[next(i for i, (p, _) in enumerate(holders) if p == first)] += tied_numel
        for item in sorted(items, key=lambda i: (-i.param.numel(), i.name)):
            if item.unit == TIED:
                owners[item.name] = first
                continue
            numel = item.param.numel()
            best = min(range(len(holders)),
                       key=lambda h: ((load[h] + numel) / weight[h], load[h], h))
            load[best] += numel
            owners[item.name] = holders[best][0]
    return owners


def holder_memory_bytes(plan: Plan) -> dict[Holder, float]:
    """Device memory of each stage ``(pipeline, stage)``: its smallest device's. Holders of
    equal memory get equal shares (``1/d``, what the cost model assumes) whatever their TP
    degrees; a TP stage's ranks split its share."""
    cluster = Cluster(plan.cluster)
    return {(p, s): min(cluster.device(d).type.memory_bytes for d in stage.devices)
            for p, pipeline in enumerate(plan.pipelines)
            for s, stage in enumerate(pipeline.stages)}


def source_rank(layout: Layout, owners: dict[str, int], item: SyncedParam) -> int:
    """The rank of ``item``'s aligned sync group that keeps its optimizer state and sends
    its update: the owner pipeline's first holder, at this rank's TP index."""
    holder = next(h for h in layout.holders(item.unit) if h[0] == owners[item.name])
    return layout.stage_ranks(*holder)[layout.role.tp_rank]


@dataclass(frozen=True)
class OwnerSlots:
    """An aligned bucket laid out for ZeRO-1's collectives: one slot per rank of the
    bucket's process group, in group-rank order (as reduce-scatter and all-gather number
    them), holding the bucket's items that rank owns, back to back, padded to ``width``."""

    members: tuple[tuple[int, ...], ...]  # per slot: indices into the bucket's items
    width: int  # elements per slot
    index: int  # this rank's slot

    @property
    def mine(self) -> tuple[int, ...]:
        return self.members[self.index]

    @property
    def numel(self) -> int:
        """Elements of the bucket's flat tensor: every slot, padded."""
        return self.width * len(self.members)

    def offsets(self, sizes: Sequence[int]) -> tuple[int, ...]:
        """Where each item (of ``sizes[i]`` elements) starts in the bucket's flat tensor:
        its slot's start, then the slot's items back to back."""
        offsets = [0] * len(sizes)
        for slot, indices in enumerate(self.members):
            for i, offset in zip(indices, back_to_back([sizes[i] for i in indices]), strict=True):
                offsets[i] = slot * self.width + offset
        return tuple(offsets)


def back_to_back(sizes: Sequence[int]) -> list[int]:
    """Offsets of items of ``sizes`` elements laid out one after another from 0."""
    offsets, position = [], 0
    for size in sizes:
        offsets.append(position)
        position += size
    return offsets


def owner_slots(layout: Layout, owners: dict[str, int], bucket: Bucket) -> OwnerSlots:
    """The slots of aligned ``bucket`` (see :class:`OwnerSlots`)."""
    ranks = dist.get_process_group_ranks(bucket.group)
    sources = [source_rank(layout, owners, item) for item in bucket.items]
    members = tuple(tuple(i for i, s in enumerate(sources) if s == rank) for rank in ranks)
    width = max(sum(local(bucket.items[i].param).numel() for i in indices)
                for indices in members)
    return OwnerSlots(members, width, ranks.index(layout.rank))


def write_slot(slot: torch.Tensor, tensors: list[torch.Tensor], indices: tuple[int, ...]) -> None:
    """Put ``tensors[i]`` for ``i`` in ``indices`` back to back at the start of ``slot``."""
    if indices:
        part = torch.cat([tensors[i].reshape(-1) for i in indices])
        slot[:part.numel()] = part


def read_slot(slot: torch.Tensor, tensors: list[torch.Tensor], indices: tuple[int, ...]) -> None:
    """Copy :func:`write_slot`'s layout of ``slot`` into ``tensors[i]`` for ``i`` in ``indices``."""
    offsets = back_to_back([tensors[i].numel() for i in indices])
    for i, offset in zip(indices, offsets, strict=True):
        tensors[i].copy_(slot[offset:offset + tensors[i].numel()].view_as(tensors[i]))


def scatters(bucket: Bucket) -> bool:
    """Whether ``bucket``'s gradients are reduce-scattered to their owners: aligned, and
    one holder per pipeline (not the tied weight, whose two copies in pipeline 0 both
    need the sum)."""
    return bucket.aligned and all(item.unit != TIED for item in bucket.items)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state on this rank (local shards of DTensor states)."""
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                tensor = local(value)
                total += tensor.numel() * tensor.element_size()
    return total


class Zero1:
    """Which local parameters this rank updates, and the gather of everyone's updates."""

    def __init__(self, layout: Layout, params: list[SyncedParam], buckets: list[Bucket],
                 owners: dict[str, int] | None = None) -> None:
        self.layout = layout
        self.owners = owners if owners is not None else assign_owners(layout, params)
        pipeline = layout.role.pipeline
        self.owned = {id(i.param) for i in params if self.owners[i.name] == pipeline}
        self._local = {id(i.param) for i in params}
        self.buckets = buckets
        self.slots = {id(b): owner_slots(layout, self.owners, b) for b in buckets if b.aligned}
        self.full = FullLayout(layout.role.tp_rank)

    def updates(self, param: nn.Parameter) -> bool:
        """Whether this rank's optimizer updates ``param`` (its own share, or a parameter
        this class does not shard, such as FSDP2's)."""
        return id(param) in self.owned or id(param) not in self._local

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer`` step (and keep state for) this rank's own parameters only."""
        hidden: list[tuple[nn.Parameter, torch.Tensor]] = []

        def hide(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            for group in opt.param_groups:
                for param in group["params"]:
                    if id(param) in self._local and id(param) not in self.owned \
                            and param.grad is not None:
                        hidden.append((param, param.grad))
                        param.grad = None

        def restore(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            for param, grad in hidden:
                param.grad = grad
            hidden.clear()

        optimizer.register_step_pre_hook(hide)
        optimizer.register_step_post_hook(restore)

    @torch.no_grad()
    def gather_parameters(self) -> None:
        """Copy every owner's updated parameters to the other holders (collective)."""
        pending = [self.launch_gather(bucket) for bucket in self.buckets]
        for work, write_back in pending:
            work.wait()
            write_back()

    @torch.no_grad()
    def launch_gather(self, bucket: Bucket) -> tuple[dist.Work, Callable[[], None]]:
        """Start ``bucket``'s all-gather of its owners' updated values; torch's handle and
        what writes the received values into the parameters once it is done."""
        if bucket.aligned:
            return self._launch_aligned(bucket)
        return self._launch_full(bucket)

    def _launch_aligned(self, bucket: Bucket) -> tuple[dist.Work, Callable[[], None]]:
        slots = self.slots[id(bucket)]
        locals_ = [local(item.param) for item in bucket.items]
        dtype = reduce(torch.promote_types, (t.dtype for t in locals_))
        send = locals_[0].new_zeros(slots.width, dtype=dtype)
        write_slot(send, locals_, slots.mine)
        received = [torch.empty_like(send) for _ in slots.members]
        work = dist.all_gather(received, send, group=bucket.group, async_op=True)

        def write_back() -> None:
            for slot, (indices, flat) in enumerate(zip(slots.members, received, strict=True)):
                if slot != slots.index:
                    read_slot(flat, locals_, indices)

        return work, write_back

    def _launch_full(self, bucket: Bucket) -> tuple[dist.Work, Callable[[], None]]:
        pipeline = self.layout.role.pipeline
        firsts = [self._is_first_owner(item) for item in bucket.items]
        flat = self.full.flat(bucket.items, [local(item.param) for item in bucket.items],
                              contributes=firsts)
        work = dist.all_reduce(flat, group=bucket.group, async_op=True)

        def write_back() -> None:
            offset = 0
            for item in bucket.items:
                size = item.param.numel()
                if self.owners[item.name] != pipeline:
                    self.full.take(item.param, flat[offset:offset + size], local(item.param))
                offset += size

        return work, write_back

    def _is_first_owner(self, item: SyncedParam) -> bool:
        """Whether this rank's stage is the owner pipeline's first holder of ``item``."""
        role = self.layout.role
        holder = next(h for h in self.layout.holders(item.unit) if h[0] == self.owners[item.name])
        return holder == (role.pipeline, role.stage)
