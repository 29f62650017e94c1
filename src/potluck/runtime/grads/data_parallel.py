"""Data parallelism across replicas with unequal batch shares and unequal layouts.

Every replica's loss is its share of the *global* token-weighted mean (token
losses summed, divided by the global batch's token count), so the gradient of
the whole batch is the plain **sum** of the replicas' gradients, whatever
their shares (islands that synchronize rarely: the island's batch and pipelines,
:mod:`potluck.runtime.grads.islands`). :class:`GradSync` sums each parameter's gradient
over the ranks that hold the same parameter in every pipeline, bucket by bucket
(:mod:`potluck.runtime.grads.buckets`):

- aligned buckets (all holders shard the unit the same way): local shards are
  all-reduced as one flat tensor, as DDP would; the gradients are views of it
  (:mod:`potluck.runtime.grads.bucket_views`), so nothing is copied either way;
- with ZeRO-1, aligned buckets are reduce-scattered instead: each owner gets
  the sums of the parameters whose optimizer state it keeps
  (:func:`potluck.runtime.grads.zero.owner_slots`, the layout of the parameter all-gather;
  the gradients are views of that layout too), half an all-reduce's traffic;
- with ZeRO-2 those buckets are reduce-scattered after every micro-batch and
  the full-size gradients dropped (:mod:`potluck.runtime.grads.zero2`);
- full-layout buckets (holders with different TP degrees): each rank writes
  its shard into a zero tensor of the full parameter's shape (a replicated
  parameter only from TP rank 0), the full tensors are summed, and each rank
  takes back its shard. Exact, and costs ``tp`` times the traffic of the
  aligned case; only heterogeneous plans pay it;
- with ``plan.comm.sparse_embedding_grads`` the untied input embedding has a
  bucket of its own, whose touched rows alone are all-gathered and added up
  (:mod:`potluck.runtime.grads.sparse_embedding`; aligned or full layout, and
  under ZeRO-1 instead of the reduce-scatter: every member gets the sum).

**Overlap with the backward pass** (``Execution.overlap_grad_reduce``, what
the cost model assumes): a bucket's asynchronous all-reduce starts as soon as
every gradient in it is final for the step, while the schedule is still
running. A gradient is final once it has been accumulated once per
micro-batch: :class:`potluck.runtime.grads.grad_ready.GradReady` counts
accumulations (post-accumulate-grad hooks, plus zero-bubble's separate
weight passes, which write ``.grad`` without them). Buckets start in the
fixed bucket order; :meth:`GradSync.finish` starts whatever has not started
(a parameter that got no gradient), waits for all and writes the sums back.
The sums are the same numbers either way. Before a step's first bucket starts,
``before_reduce`` runs (the priority schedule's parameter all-gathers still in
flight are finished there, :mod:`potluck.runtime.grads.gather`).

torch's DDP and FSDP2 assume one model layout on every replica and average
gradients, so neither fits uneven shares with per-layer groups; this module
is the small piece that is missing. It also computes the global gradient norm,
counting every parameter once (pipeline 0's copy, or the first of the island's; under
ZeRO-1 the owner's; TP rank 0 for replicated parameters).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from potluck.runtime.grads.bucket_views import BucketViews
from potluck.runtime.grads.buckets import (
    BUCKET_ELEMENTS,
    Bucket,
    FullLayout,
    SyncedParam,
    is_sharded,
    local,
    plan_buckets,
)
from potluck.runtime.grads.grad_ready import GradReady
from potluck.runtime.grads.sparse_embedding import SparseEmbeddingGrad
from potluck.runtime.grads.zero import OwnerSlots, owner_slots, read_slot, scatters, write_slot
from potluck.runtime.grads.zero2 import ShardedGrads, reduction_counts
from potluck.runtime.layout import Layout


@dataclass
class SyncStats:
    """How the last step's buckets were reduced (for tests and logs)."""

    buckets: int = 0
    launched_in_backward: int = 0  # started by a gradient hook, before the schedule returned
    launched_with_grads_pending: int = 0  # ... while other gradients were still being computed
    scattered: int = 0  # ZeRO-1: buckets reduce-scattered to their owners (not all-reduced)
    # sparse embedding gradient (this rank in its group): the rows each member of the group
    # touched (its replica's distinct token ids in its vocabulary rows; group-rank order), the
    # bytes the exchange's all-gathers delivered here (counts, padded ids and rows), and the
    # bytes a dense all-reduce of the embedding would have carried
    embed_rows: tuple[int, ...] = ()
    embed_exchange_bytes: int = 0
    embed_dense_bytes: int = 0


@dataclass
class _Reduction:
    bucket: Bucket
    flat: torch.Tensor
    grads: list[torch.Tensor]  # local gradients the sums go back into
    work: dist.Work | None
    mine: tuple[int, ...] | None = None  # reduce-scattered: the items whose sums it gets
    in_place: bool = False  # all-reduced in the gradients' own bucket view: nothing to copy


class GradSync:
    """Sums gradients over each parameter's holders; knows which copy counts for the norm."""

    def __init__(self, layout: Layout, params: list[SyncedParam],
                 wire_dtype: torch.dtype | None = None, *, micro_batches: int = 1,
                 overlap: bool = False, bucket_elements: int = BUCKET_ELEMENTS,
                 owners: dict[str, int] | None = None, shard_grads: bool = False,
                 norm_params: Sequence[nn.Parameter] = (), sparse: str | None = None,
                 before_reduce: Callable[[], None] | None = None,
                 accumulations: Mapping[str, int] | None = None) -> None:
        """``shard_grads`` (ZeRO-2, with ``owners``): reduce-scatter after every micro-batch
        (:mod:`potluck.runtime.grads.zero2`); ``norm_params``: parameters synced elsewhere
        (FSDP2's, each rank holding a distinct shard) whose local gradients count in the norm;
        ``sparse``: the input embedding's name, whose gradient is summed sparsely
        (:mod:`potluck.runtime.grads.sparse_embedding`; :meth:`start` then needs the ids);
        ``before_reduce``: runs once a step, before its first bucket starts (the parameter
        all-gathers still in flight are finished there); ``accumulations``: parameters (by
        name) accumulated that many times per micro-batch (an explicit TP stage's blocks:
        once per sub-batch)."""
        self.layout = layout
        self.before_reduce = before_reduce
        self.params = params
        self.norm_params = tuple(norm_params)
        self.wire_dtype = wire_dtype  # e.g. bf16 on the wire; None: the gradients' own dtype
        alone = frozenset() if sparse is None else frozenset({sparse})
        self.buckets = plan_buckets(layout, params, bucket_elements, alone)
        self.sparse = next((SparseEmbeddingGrad(b, layout.role.tp_rank, wire_dtype)
                            for b in self.buckets if b.items[0].name == sparse), None)
        # ZeRO-1: the buckets whose sums go to their owners only, and per item of those
        # whether this rank is its owner
        self._slots = {id(b): owner_slots(layout, owners, b) for b in self.buckets
                       if owners is not None and scatters(b) and not self._is_sparse(b)}
        self._owns = {item.name: i in self._slots[id(b)].mine for b in self.buckets
                      if id(b) in self._slots for i, item in enumerate(b.items)}
        self.full = FullLayout(layout.role.tp_rank)
        self.sharded = ShardedGrads(wire_dtype) if shard_grads and self._slots else None
        self.views = BucketViews([b for b in self.buckets if self._summed_in_place(b)],
                                 self._slots)
        levels = [reduction_counts(layout, b, micro_batches) if self._per_micro_batch(b)
                  else (micro_batches,) for b in self.buckets]
        # launch order, the same on every rank: by the share of the step done, then bucket
        self._sequence = sorted((Fraction(j + 1, len(counts)), i, j)
                                for i, counts in enumerate(levels) for j in range(len(counts)))
        self._position = {(i, j): n for n, (_, i, j) in enumerate(self._sequence)}
        self.ready = GradReady(self.buckets, micro_batches, self._bucket_ready, levels,
                               accumulations) \
            if (overlap or self.sharded is not None) and self.buckets else None
        self.stats = SyncStats(buckets=len(self.buckets))
        # called with a bucket's parameters once their sums are written back (optimizer
        # offload starts copying them to the host there)
        self.on_final: Callable[[list[nn.Parameter]], None] | None = None
        # called when the step's schedule is over, before the remaining buckets start
        # (gradients summed apart in FP32 write their leftovers there)
        self.on_schedule_end: Callable[[], None] | None = None
        self._next = 0
        self._is_ready: list[bool] = []
        self._inflight: list[_Reduction] = []

    def reduced_every_micro_batch(self) -> set[int]:
        """``id`` of each parameter whose gradient is taken after every micro-batch
        (ZeRO-2's reduce-scattered buckets)."""
        return {id(item.param) for bucket in self.buckets if self._per_micro_batch(bucket)
                for item in bucket.items}

    def gradients_apart(self, params: Iterable[nn.Parameter]) -> None:
        """``params``' gradients appear only once final (summed apart over micro-batches,
        :mod:`~potluck.runtime.grads.fp32_accumulation`): their buckets copy them instead
        of keeping them as views of a flat tensor, which would hold a second copy between
        steps."""
        apart = {id(p) for p in params}
        self.views = BucketViews(
            [b for b in self.buckets if self._summed_in_place(b)
             and not any(id(item.param) in apart for item in b.items)], self._slots)

    def _per_micro_batch(self, bucket: Bucket) -> bool:
        return self.sharded is not None and id(bucket) in self._slots

    def _is_sparse(self, bucket: Bucket) -> bool:
        return self.sparse is not None and bucket is self.sparse.bucket

    def _summed_in_place(self, bucket: Bucket) -> bool:
        """Whether the bucket's gradients live in its flat tensor
        (:mod:`potluck.runtime.grads.bucket_views`)."""
        dtype = local(bucket.items[0].param).dtype
        return (bucket.aligned and not self._is_sparse(bucket)
                and not self._per_micro_batch(bucket)
                and self.wire_dtype in (None, dtype)
                and all(local(item.param).dtype == dtype for item in bucket.items))

    def start(self, ids: torch.Tensor | None = None) -> None:
        """Before the schedule: from now on, buckets start as their gradients become final.
        ``ids``: the token ids of this replica's step (the sparse embedding's rows)."""
        self._next = 0
        self._is_ready = [False] * len(self._sequence)
        self._inflight = []
        self.stats = SyncStats(buckets=len(self.buckets))
        self.views.install()
        if self.sparse is not None:
            self._start_sparse(ids)
        if self.sharded is not None:
            self.sharded.start()
        if self.ready is not None:
            self.ready.start()

    def _start_sparse(self, ids: torch.Tensor | None) -> None:
        """Exchange the touched rows' counts and ids, before any bucket launches."""
        if ids is None:
            raise RuntimeError("the sparse embedding gradient needs the step's token ids: "
                               "pass them to GradSync.start")
        self.sparse.start(ids)
        self.stats.embed_rows = self.sparse.counts
        self.stats.embed_exchange_bytes = self.sparse.exchange_bytes
        self.stats.embed_dense_bytes = self.sparse.dense_bytes

    def finish(self) -> None:
        """After the schedule: start the remaining buckets, wait for all, write the sums back."""
        if self.ready is not None:
            self.ready.stop()
        if self.on_schedule_end is not None:
            self.on_schedule_end()
        self._launch_rest()
        for reduction in self._inflight:
            self._write_back(reduction)
            self._final(reduction.bucket)
        self._inflight = []
        if self.sparse is not None:
            self.sparse.write_back()
            self._final(self.sparse.bucket)
        if self.sharded is not None:
            for bucket in self.buckets:
                if self._per_micro_batch(bucket):
                    self.sharded.write_back(bucket, self._slots[id(bucket)])
                    self._final(bucket)
            self.stats.scattered += self.sharded.launched
        for item in self.params:
            _match_grad_layout(item.param)

    def _final(self, bucket: Bucket) -> None:
        if self.on_final is not None:
            self.on_final([item.param for item in bucket.items])

    def weight_pass(self, module: nn.Module) -> AbstractContextManager[None]:
        """Wrap a zero-bubble weight pass of ``module``: one accumulation of each of its
        parameters' gradients."""
        return nullcontext() if self.ready is None else self.ready.weight_pass(module)

    # --- launching -------------------------------------------------------------------------

    def _bucket_ready(self, index: int, level: int) -> None:
        """A gradient hook found ``level`` of bucket ``index`` ready: start it and any ready
        ones after it in the launch order."""
        self._is_ready[self._position[(index, level)]] = True
        before = self._next
        while self._next < len(self._sequence) and self._is_ready[self._next]:
            self._launch_next()
        launched = self._next - before
        self.stats.launched_in_backward += launched
        if self.ready is not None and self.ready.unfinished > 0:
            self.stats.launched_with_grads_pending += launched

    def _launch_rest(self) -> None:
        while self._next < len(self._sequence):
            self._launch_next()

    def _launch_next(self) -> None:
        if self._next == 0 and self.before_reduce is not None:
            self.before_reduce()
        _, index, _ = self._sequence[self._next]
        self._next += 1
        bucket = self.buckets[index]
        if self._per_micro_batch(bucket):
            for item in bucket.items:
                _match_grad_layout(item.param)
            self.sharded.launch(bucket, self._slots[id(bucket)])
        else:
            self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        for item in bucket.items:
            _match_grad_layout(item.param)
        grads = [local(_grad(item.param)) for item in bucket.items]
        if self._is_sparse(bucket):
            self.sparse.launch(grads[0])
            return
        slots = self._slots.get(id(bucket))
        in_place = self.views.flat(bucket) if bucket in self.views else None
        if slots is not None:
            self._inflight.append(self._scatter(bucket, grads, slots, in_place))
            return
        if in_place is not None:
            work = dist.all_reduce(in_place, group=bucket.group, async_op=True)
            self._inflight.append(_Reduction(bucket, in_place, grads, work, in_place=True))
            return
        if bucket.aligned:
            flat = torch.cat([g.reshape(-1) for g in grads])
            flat = flat if self.wire_dtype is None else flat.to(self.wire_dtype)
        else:
            flat = self.full.flat(bucket.items, grads, self.wire_dtype)
        work = dist.all_reduce(flat, group=bucket.group, async_op=True)
        self._inflight.append(_Reduction(bucket, flat, grads, work))

    def _scatter(self, bucket: Bucket, grads: list[torch.Tensor], slots: OwnerSlots,
                 flat: torch.Tensor | None = None) -> _Reduction:
        """ZeRO-1: reduce-scatter the bucket so each owner gets the sums of its own
        parameters (in the slots the parameter all-gather uses); ``flat``: the gradients
        already laid out so (their bucket views), else they are copied into a new one."""
        if flat is None:
            flat = grads[0].new_zeros(slots.numel,
                                      dtype=self.wire_dtype or grads[0].dtype)
            for slot, indices in enumerate(slots.members):
                write_slot(flat[slot * slots.width:], grads, indices)
        out = flat.new_empty(slots.width)
        work = dist.reduce_scatter_single(out, flat, group=bucket.group, async_op=True)
        self.stats.scattered += 1
        return _Reduction(bucket, out, grads, work, slots.mine)

    def _write_back(self, reduction: _Reduction) -> None:
        if reduction.work is not None:
            reduction.work.wait()
        if reduction.in_place:  # summed where the gradients live
            return
        if reduction.mine is not None:  # the other items' sums went to their owners
            read_slot(reduction.flat, reduction.grads, reduction.mine)
            return
        bucket, offset = reduction.bucket, 0
        for item, grad in zip(bucket.items, reduction.grads, strict=True):
            size = grad.numel() if bucket.aligned else item.param.numel()
            part = reduction.flat[offset:offset + size]
            offset += size
            if bucket.aligned:
                grad.copy_(part.view_as(grad))
            else:
                self.full.take(item.param, part, grad)

    # --- the norm ----------------------------------------------------------------------------

    def norm_squared(self) -> torch.Tensor:
        """This rank's part of the squared global gradient norm (sum over ranks = total),
        in FP64 from FP32 norms of the gradients (no copy of any gradient)."""
        grads = [local(item.param.grad).detach() for item in self._norm_items()
                 if item.param.grad is not None]
        grads += [local(p.grad).detach() for p in self.norm_params if p.grad is not None]
        return sum_of_squares(grads)

    def _norm_items(self) -> list[SyncedParam]:
        """The parameters whose gradient this rank counts: pipeline 0's copy (the norm
        owner's) or, reduce-scattered, the owner's; TP rank 0 for replicated ones."""
        role = self.layout.role
        items = []
        for item in self.params:
            owns = self._owns.get(item.name)
            if owns is False:
                continue  # reduce-scattered: only the owner holds the sum
            if owns is None and self.layout.norm_owner(item.unit) != (role.pipeline, role.stage):
                continue
            if not is_sharded(item.param) and role.tp_rank != 0:
                continue
            items.append(item)
        return items


def sum_of_squares(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The sum of the tensors' squared L2 norms, an FP64 scalar (on the first tensor's
    device; CPU if none). One foreach norm per device and dtype, 16-bit tensors reduced in
    FP32 (``_foreach_norm``'s ``dtype``, as ``clip_grad_norm_`` groups them); each norm is
    squared in FP64, so only a tensor whose own norm passes FP32's range turns inf."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    total = torch.zeros((), dtype=torch.float64,
                        device=tensors[0].device if tensors else "cpu")
    for (_, dtype), group in groups.items():
        wide = torch.float32 if dtype.itemsize < 4 else None
        norms = torch._foreach_norm(group, 2, dtype=wide)
        total += torch.stack(norms).double().square().sum().to(total.device)
    return total


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
