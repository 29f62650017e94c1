"""The gradient all-reduce overlaps the backward pass, and changes no number.

Each case trains a plan with small gradient buckets twice: with
``overlap_grad_reduce`` (the default, what the cost model assumes) and
without. With overlap, every bucket of every rank must be launched by a
gradient hook while the schedule is still running, some while other
gradients of that rank are still being computed; the loss curves must be
identical to the non-overlapped run and match a single process.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from dp_workers import SMALL_BUCKETS, tied_group_is_not_the_lane, train_plan, with_options
from runtime_helpers import TINY_GPT2, TINY_LLAMA, make_plan, pipe, reference_losses

from potluck.plans import Schedule

TIED_LLAMA = replace(TINY_LLAMA, tied_embeddings=True)
INTERLEAVED = [(1, ((0, 1), (2, 3))), (1, ((1, 2), (3, 4)))]

CASES = {
    "dp=2 x pp=2, gpipe": (TINY_LLAMA, [pipe([(1, (0, 1)), (1, (1, 4))], 1, 3),
                                        pipe([(1, (0, 2)), (1, (2, 4))], 1, 2)],
                           {"schedule": Schedule.GPIPE}),
    "dp=2 x pp=2, 1f1b": (TINY_LLAMA, [pipe([(1, (0, 2)), (1, (2, 4))], 1, 2)] * 2, {}),
    "interleaved, two chunks per rank, beside a one-stage replica": (
        TINY_LLAMA, [pipe(INTERLEAVED, 1, 4), pipe([(1, ((0, 2), (2, 4)))], 1, 2)],
        {"schedule": Schedule.INTERLEAVED}),
    "zero bubble (split weight gradients), dp=2": (
        TINY_LLAMA, [pipe(INTERLEAVED, 1, 4), pipe(INTERLEAVED, 1, 2)],
        {"schedule": Schedule.ZERO_BUBBLE}),
    "mixed tp pipeline beside a tp=2 replica, tied": (
        TIED_LLAMA, [pipe([(1, (0, 1)), (2, (1, 4))], 1, 2), pipe([(2, (0, 4))], 1, 2)], {}),
    "gpt2, pp=2 tp=1 beside pp=1 tp=2 (full-layout groups)": (
        TINY_GPT2, [pipe([(1, (0, 3)), (1, (3, 4))], 1, 3), pipe([(2, (0, 4))], 1, 2)], {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_buckets_reduce_during_the_backward_pass_with_unchanged_losses(case):
    spec, pipelines, options = CASES[case]
    plan = make_plan(spec, pipelines, **options)
    overlapped = train_plan(with_options(plan, overlap=True), bucket_elements=SMALL_BUCKETS)
    after = train_plan(with_options(plan, overlap=False), bucket_elements=SMALL_BUCKETS)

    for report in overlapped:
        for stats in report.stats:
            assert stats.buckets > 0
            assert stats.launched_in_backward == stats.buckets
    pending = [stats.launched_with_grads_pending for r in overlapped for stats in r.stats]
    assert max(pending) > 0, "some bucket must start while gradients are still being computed"
    for report in after:
        assert all(stats.launched_in_backward == 0 for stats in report.stats)

    assert overlapped[0].losses == after[0].losses
    expected = reference_losses(spec, plan.training.global_batch)
    assert overlapped[0].losses == pytest.approx(expected, abs=2e-5)


def test_a_sync_group_with_a_lanes_ranks_gets_its_own_process_group():
    """One pipeline, tied embedding and head: their gradients are summed over the lane's
    two ranks, on another communicator, so the all-reduce that overlaps the schedule never
    waits behind the pipeline's sends."""
    plan = make_plan(TIED_LLAMA, [pipe([(1, (0, 2)), (1, (2, 4))], 1, 2)])
    assert tied_group_is_not_the_lane(plan) == [True, True]
