"""Sparse embedding gradients: only the rows a replica touched travel, and nothing changes.

With ``plan.comm.sparse_embedding_grads`` the input embedding's gradient is all-gathered
as the touched rows of each replica (its batch's distinct token ids, within the rank's
vocabulary shard under TP) and added up, instead of all-reduced whole. Each layout trains
sparse and must match one process; the rows each member sent must be exactly the
distinct ids of its replica's step; a tied embedding and ZeRO-2 are refused in one line.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from dist_harness import run_ranks
from dp_workers import SMALL_BUCKETS, train_plan, with_options
from runtime_helpers import SEQ_LEN, STEPS, TINY_LLAMA, make_plan, pipe, reference_losses

from potluck.errors import ConfigError
from potluck.placement import EMBED
from potluck.plans import CommSchedule, Plan, Schedule, check_plan
from potluck.runtime.grads.buckets import Bucket, SyncedParam
from potluck.runtime.grads.sparse_embedding import SparseEmbeddingGrad, sparse_embedding_name
from potluck.runtime.layout import SyncGroup

TOLERANCE = 2e-5  # the equivalence tests': fp32 sums in another order
SPARSE = CommSchedule(sparse_embedding_grads=True)
INTERLEAVED = [(1, ((0, 1), (2, 3))), (1, ((1, 2), (3, 4)))]

CASES = {
    "dp=2": (TINY_LLAMA, [pipe([(1, (0, 4))], 2, 2)] * 2, {}),
    "dp=2 x pp=2": (TINY_LLAMA, [pipe([(1, (0, 2)), (1, (2, 4))], 1, 2)] * 2, {}),
    "dp=2 x tp=2, vocabulary-parallel": (TINY_LLAMA, [pipe([(2, (0, 4))], 1, 2)] * 2, {}),
    "unequal shares 6+2": (TINY_LLAMA, [pipe([(1, (0, 4))], 2, 3), pipe([(1, (0, 4))], 1, 2)],
                           {}),
    "zero 1, dp=2 x tp=2": (TINY_LLAMA, [pipe([(2, (0, 4))], 1, 2)] * 2, {"zero": 1}),
    "heterogeneous (full layout): pp=2 tp=1 beside tp=2": (
        TINY_LLAMA, [pipe([(1, (0, 1)), (1, (1, 4))], 2, 2), pipe([(2, (0, 4))], 1, 3)], {}),
    "mixed tp pipeline (a follower holds half the vocabulary) beside tp=2": (
        TINY_LLAMA, [pipe([(2, (0, 1)), (1, (1, 4))], 1, 2), pipe([(2, (0, 4))], 1, 2)], {}),
    "zero bubble (the embedding's weight pass), dp=2": (
        TINY_LLAMA, [pipe(INTERLEAVED, 1, 4), pipe(INTERLEAVED, 1, 2)],
        {"schedule": Schedule.ZERO_BUBBLE}),
}


def sparse(plan: Plan) -> Plan:
    return replace(plan, comm=SPARSE)


@pytest.mark.parametrize("case", list(CASES))
def test_sparse_embedding_gradients_train_like_one_process(case):
    spec, pipelines, options = CASES[case]
    schedule = {key: value for key, value in options.items() if key != "zero"}
    plan = with_options(sparse(make_plan(spec, pipelines, **schedule)), zero=options.get("zero"))
    reports = train_plan(plan, bucket_elements=SMALL_BUCKETS)

    assert reports[0].losses == pytest.approx(
        reference_losses(spec, plan.training.global_batch), abs=TOLERANCE)
    exchanged = [s for report in reports for s in report.stats if s.embed_rows]
    embedding_ranks = sum(stages[0][0] for stages, _, _ in pipelines)  # first stages' tp
    assert len(exchanged) == embedding_ranks * STEPS
    for stats in exchanged:
        assert stats.launched_in_backward == stats.buckets  # the rows overlap the backward
        assert 0 < stats.embed_exchange_bytes < stats.embed_dense_bytes


def test_sparse_sums_equal_the_dense_all_reduce():
    """Same gradient norms as the dense path, step by step (not only the losses)."""
    spec, pipelines, _ = CASES["unequal shares 6+2"]
    plan = make_plan(spec, pipelines)
    dense = train_plan(plan, bucket_elements=SMALL_BUCKETS)
    rows = train_plan(sparse(plan), bucket_elements=SMALL_BUCKETS)
    assert rows[0].losses == pytest.approx(dense[0].losses, abs=1e-6)
    assert rows[0].grad_norms == pytest.approx(dense[0].grad_norms, rel=1e-5)
    assert all(not s.embed_rows for report in dense for s in report.stats)


class FewTokens:
    """Global batches whose first ``share`` rows use only the ids of ``first`` and the
    rest only those of ``second``, every id in every row."""

    def __init__(self, share: int, first: tuple[int, ...], second: tuple[int, ...],
                 global_batch: int) -> None:
        self.share, self.pools, self.global_batch_size = share, (first, second), global_batch

    def global_batch(self, step: int) -> torch.Tensor:
        rows = []
        for row in range(self.global_batch_size):
            pool = self.pools[row >= self.share]
            rows.append([pool[(row + step + j) % len(pool)] for j in range(SEQ_LEN + 1)])
        return torch.tensor(rows)

    def replica_rows(self, step: int, start: int, count: int) -> torch.Tensor:
        return self.global_batch(step)[start:start + count]


FIRST, SECOND = (5, 17, 99, 200), (17, 250)  # TINY_LLAMA: 260 ids; tp=2 splits at 130


@pytest.mark.parametrize(("tp", "expected"), [(1, {0: (4, 2)}), (2, {0: (3, 1), 1: (1, 1)})])
def test_only_the_rows_a_replica_touched_travel(tp, expected):
    """Replica 0 reads four ids, replica 1 two: so many rows travel from each, per TP
    rank the ids of its half of the vocabulary; the bytes are those rows' (padded)."""
    plan = sparse(make_plan(TINY_LLAMA, [pipe([(tp, (0, 4))], 2, 1)] * 2))
    data = FewTokens(2, FIRST, SECOND, plan.training.global_batch)
    reports = train_plan(plan, data=data)

    hidden = TINY_LLAMA.hidden_size
    for rank, report in enumerate(reports):
        tp_rank = rank % tp
        for stats in report.stats:
            assert stats.embed_rows == expected[tp_rank], f"rank {rank}"
            width = max(expected[tp_rank])
            assert stats.embed_exchange_bytes == 2 * (8 + width * (4 + 4 * hidden))
            assert stats.embed_dense_bytes == 4 * hidden * TINY_LLAMA.vocab_size // tp
    assert reports[0].losses == pytest.approx(
        reference_losses(TINY_LLAMA, 4, data=data), abs=TOLERANCE)


def _exchange_in_bf16(rank: int, world_size: int, vocab: int, hidden: int) -> None:
    """Each rank touches its own ids; the sum is the bf16-rounded rows added in fp32, the
    same on every rank."""
    group = torch.distributed.group.WORLD
    param = torch.nn.Parameter(torch.zeros(vocab, hidden))
    item = SyncedParam("embed.weight", param, EMBED, SyncGroup((0, 1), aligned=True))
    exchange = SparseEmbeddingGrad(Bucket((0, 1), True, (item,), group), 0, torch.bfloat16)
    ids = [torch.tensor([[1, 4, 4, 9]]), torch.tensor([[4, 7]])]
    grads = []
    for r in range(world_size):
        grad = torch.zeros(vocab, hidden)
        touched = ids[r].unique()
        generator = torch.Generator().manual_seed(r)
        grad[touched] = torch.randn(len(touched), hidden, generator=generator)
        grads.append(grad)
    exchange.start(ids[rank])
    assert exchange.counts == (3, 2)
    grad = grads[rank].clone()
    exchange.launch(grad)
    exchange.write_back()
    expected = torch.zeros(vocab, hidden)
    for g in grads:
        expected += g.to(torch.bfloat16).float()
    assert torch.equal(grad, expected)
    assert grad[[0, 2, 3]].abs().sum() == 0


def test_rows_cross_the_wire_in_bf16_and_every_rank_gets_the_same_sum():
    run_ranks(_exchange_in_bf16, 2, 12, 8, timeout_s=60)


def test_a_tied_embedding_and_zero_2_are_refused_in_one_line():
    tied = sparse(make_plan(replace(TINY_LLAMA, tied_embeddings=True),
                            [pipe([(1, (0, 4))], 1, 1)] * 2))
    with pytest.raises(ConfigError, match="needs an untied input embedding") as err:
        check_plan(tied)
    assert "\n" not in str(err.value)
    zero2 = with_options(sparse(make_plan(TINY_LLAMA, [pipe([(1, (0, 4))], 1, 1)] * 2)), zero=2)
    with pytest.raises(ConfigError, match="does not run under zero 2.*use zero 0 or 1") as err:
        check_plan(zero2)
    assert "\n" not in str(err.value)
    check_plan(with_options(zero2, zero=1))


def test_a_model_whose_embedding_potluck_does_not_know_is_refused():
    from runtime_helpers import toy_on_meta

    plan = sparse(make_plan(TINY_LLAMA, [pipe([(1, (0, 4))], 1, 1)] * 2))
    with pytest.raises(ConfigError, match="needs a model whose input embedding potluck knows"):
        sparse_embedding_name(plan, toy_on_meta(), None)
    assert sparse_embedding_name(make_plan(TINY_LLAMA, [pipe([(1, (0, 4))], 1, 1)]),
                                 toy_on_meta(), None) is None
