"""Gradients as views of their bucket's flat tensor: all-reduced (and ZeRO-1
reduce-scattered) where autograd wrote them, no concatenated copy either way, the same
losses as one process."""

from __future__ import annotations

import pytest
from dp_workers import SMALL_BUCKETS, bucket_views, train_plan, with_options
from runtime_helpers import TINY_LLAMA, make_plan, pipe, reference_losses

DP2 = [pipe([(1, (0, 4))], 2, 2)] * 2


@pytest.mark.parametrize("zero", [0, 1])
def test_gradients_are_summed_in_their_bucket_without_a_copy(zero):
    plan = with_options(make_plan(TINY_LLAMA, DP2), zero=zero)
    for rank, (buckets, in_place, cats) in enumerate(bucket_views(plan)):
        assert buckets > 1, f"rank {rank}: several buckets"
        assert in_place == buckets, f"rank {rank}: every bucket's gradients are its views"
        assert cats == 0, f"rank {rank}: no bucket concatenated"


@pytest.mark.parametrize("zero", [0, 1])
def test_bucket_views_train_as_one_process(zero):
    plan = make_plan(TINY_LLAMA, DP2)
    reports = train_plan(with_options(plan, zero=zero), steps=6, bucket_elements=SMALL_BUCKETS)
    expected = reference_losses(plan.model, plan.training.global_batch, steps=6)
    assert reports[0].losses == pytest.approx(expected, abs=2e-3)
