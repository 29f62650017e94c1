"""The input embedding's gradient summed over replicas sparsely: only the touched rows travel.

A replica's batch touches only the embedding rows of the token ids it holds; every other
row of its embedding gradient is zero. With ``plan.comm.sparse_embedding_grads``
(TriRace, Li et al. TPDS 2024) the replicas exchange just those rows instead of
all-reducing the whole ``vocab x hidden`` matrix. :class:`SparseEmbeddingGrad` runs the
exchange for the one bucket that holds the untied input embedding alone
(:func:`potluck.runtime.grads.buckets.plan_buckets`, ``alone``), inside
:class:`potluck.runtime.grads.data_parallel.GradSync`:

1. :meth:`~SparseEmbeddingGrad.start`, before the schedule (the replica's token ids are
   known): each member of the bucket's group takes the distinct ids of its replica's step,
   all micro-batches, that fall in its rows of the vocabulary (its shard under
   vocabulary-parallel TP), all-gathers the counts (a few bytes; blocking, like the step's
   token count) and starts an all-gather of the ids, padded to the largest count;
2. :meth:`~SparseEmbeddingGrad.launch`, when the gradient is final (the bucket's place in
   the launch order): the touched rows, in the wire dtype, padded to the largest count,
   start an all-gather;
3. :meth:`~SparseEmbeddingGrad.write_back`, at ``finish``: the gradient is zeroed and each
   member's rows are added at their ids, member by member in group order. A member's ids
   are distinct and every rank adds the same numbers (its own rows as they crossed the
   wire too) in the same order, so all copies of the sum are identical.

The sum is the dense all-reduce's up to summation order and wire rounding (the rows are
added in the gradient's dtype). The rows travel under their global ids and each rank keeps
those in its own range, so members may hold different rows: a full-layout group (holders
with different TP degrees) runs sparse too, a replicated copy sent by TP rank 0 only, as
the dense full layout does. Under ZeRO-1 every member gets the whole sum (the owner keeps
its own; the others' optimizers never read theirs). A tied embedding and ZeRO-2/3 are
refused by the plan checks (:func:`potluck.plans.check_plan`), a model whose input
embedding potluck does not know by :func:`sparse_embedding_name`.

Launch order is the same on every member: counts and ids in ``start``, before any bucket;
the rows at the bucket's place. When no member touched a row (an empty vocabulary shard),
no member launches the ids or rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from potluck.errors import ConfigError
from potluck.plans import Plan
from potluck.runtime.grads.buckets import Bucket, is_sharded, local
from potluck.runtime.models.adapters import Family, is_tied
from potluck.runtime.shards import shard_index

ID_DTYPE = torch.int32  # token ids on the wire (vocabularies stay far below 2**31)
COUNT_BYTES = 8  # one int64 count per member


def sparse_embedding_name(plan: Plan, model: nn.Module, family: Family | None) -> str | None:
    """The input embedding's parameter name when the plan exchanges its gradient sparsely
    (None otherwise); one ConfigError line when this model cannot (the same on every rank)."""
    if not plan.comm.sparse_embedding_grads:
        return None
    if family is None:
        raise ConfigError("sparse_embedding_grads needs a model whose input embedding potluck "
                          "knows (LLaMA, Mistral, Qwen, GPT-2 families); make the plan with "
                          "sparse_embedding_grads false in the execution section")
    if is_tied(model, family):
        raise ConfigError("sparse_embedding_grads needs an untied input embedding, but this "
                          "model ties it to the head; make the plan with "
                          "sparse_embedding_grads false in the execution section")
    return family.embedding_weight


def row_range(param: nn.Parameter) -> tuple[int, int]:
    """``[first, end)``: the rows of the full embedding this rank's local tensor holds."""
    index = shard_index(param)
    if index.dim is None:
        return 0, param.shape[0]
    positions = index.positions
    if index.dim != 0 or positions is None:
        raise ValueError("a sparse embedding gradient needs the embedding split by rows")
    if positions.numel() == 0:
        return 0, 0
    first, end = int(positions[0]), int(positions[-1]) + 1
    if end - first != positions.numel():
        raise ValueError("a sparse embedding gradient needs contiguous row shards")
    return first, end


class SparseEmbeddingGrad:
    """The sparse sum of one bucket holding only the input embedding (module docstring)."""

    def __init__(self, bucket: Bucket, tp_rank: int, wire_dtype: torch.dtype | None) -> None:
        (item,) = bucket.items
        self.bucket = bucket
        self.param = item.param
        self.first_row, self.end_row = row_range(item.param)
        self.sends = is_sharded(item.param) or tp_rank == 0  # a replicated copy: TP rank 0
        self.wire_dtype = wire_dtype or local(item.param).dtype
        self.counts: tuple[int, ...] = ()  # rows each member touched this step, group order
        self._ids = torch.empty(0, dtype=torch.int64)
        self._grad: torch.Tensor | None = None
        self._gathered_ids: list[torch.Tensor] = []
        self._gathered_rows: list[torch.Tensor] = []
        self._works: list[dist.Work] = []

    @property
    def width(self) -> int:
        """Rows per member on the wire: the largest count."""
        return max(self.counts, default=0)

    @property
    def exchange_bytes(self) -> int:
        """Bytes the step's all-gathers deliver to this rank (every member's count, padded
        ids and padded rows, its own included): the collectives' output size."""
        row_bytes = local(self.param).shape[1] * self.wire_dtype.itemsize
        per_row = ID_DTYPE.itemsize + row_bytes
        return len(self.counts) * (COUNT_BYTES + self.width * per_row)

    @property
    def dense_bytes(self) -> int:
        """Bytes the dense all-reduce would carry: the bucket's flat tensor."""
        numel = local(self.param).numel() if self.bucket.aligned else self.param.numel()
        return numel * self.wire_dtype.itemsize

    def start(self, ids: torch.Tensor) -> None:
        """Before the schedule: this replica's step's token ids ``ids`` (any shape)."""
        touched = torch.unique(ids.reshape(-1))
        inside = (touched >= self.first_row) & (touched < self.end_row)
        self._ids = touched[inside] if self.sends else touched[:0]
        self.counts = self._gather_counts(self._ids.numel(), ids.device)
        self._works, self._gathered_rows, self._gathered_ids, self._grad = [], [], [], None
        if self.width == 0:
            return
        send = self._ids.new_zeros(self.width, dtype=ID_DTYPE)
        send[:self._ids.numel()] = self._ids
        self._gathered_ids = [torch.empty_like(send) for _ in self.counts]
        self._works.append(dist.all_gather(self._gathered_ids, send, group=self.bucket.group,
                                           async_op=True))

    def _gather_counts(self, count: int, device: torch.device) -> tuple[int, ...]:
        mine = torch.tensor([count], dtype=torch.int64, device=device)
        counts = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.bucket.group))]
        dist.all_gather(counts, mine, group=self.bucket.group)
        return tuple(int(c) for c in torch.cat(counts).tolist())

    def launch(self, grad: torch.Tensor) -> None:
        """The gradient (this rank's local rows) is final: start the rows' all-gather."""
        self._grad = grad
        if self.width == 0:
            return
        send = grad.new_zeros(self.width, grad.shape[1], dtype=self.wire_dtype)
        send[:self._ids.numel()] = grad.index_select(0, self._ids - self.first_row)
        self._gathered_rows = [torch.empty_like(send) for _ in self.counts]
        self._works.append(dist.all_gather(self._gathered_rows, send, group=self.bucket.group,
                                           async_op=True))

    def write_back(self) -> None:
        """Wait for the exchange and write the sum into the gradient given to :meth:`launch`."""
        if self._grad is None:
            raise RuntimeError("the sparse embedding gradient was never launched this step")
        for work in self._works:
            work.wait()
        self._grad.zero_()
        if self.width > 0:
            self._add_rows(self._grad)
        self._works, self._gathered_rows, self._gathered_ids, self._grad = [], [], [], None

    def _add_rows(self, grad: torch.Tensor) -> None:
        """Add every member's rows that fall in this rank's range, member by member."""
        for count, ids, rows in zip(self.counts, self._gathered_ids, self._gathered_rows,
                                    strict=True):
            ids, rows = ids[:count].long(), rows[:count]
            keep = (ids >= self.first_row) & (ids < self.end_row)
            grad.index_add_(0, ids[keep] - self.first_row, rows[keep].to(grad.dtype))
