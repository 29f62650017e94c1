"""ZeRO-1: optimizer states sharded over replicas, same numbers as the unsharded optimizer.

Each layout trains with and without ZeRO-1 (``zero=1``): the loss curves are
identical, each rank keeps about ``1/d`` of the optimizer state, and the
states of all ranks together are one replica's. Checkpoints taken with
sharded states resume under plans without ZeRO-1 and back.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from dp_workers import SMALL_BUCKETS, sgd_with_momentum, train_plan, with_options
from runtime_helpers import LR, TINY_GPT2, TINY_LLAMA, make_plan, pipe, reference_losses

from potluck.plans import Schedule
from potluck.runtime import TrainOptions
from potluck.runtime.launch.local import run_local
from potluck.runtime.layout import Layout
from potluck.runtime.training import train_rank

TIED_LLAMA = replace(TINY_LLAMA, tied_embeddings=True)

CASES = {
    "dp=2, one stage each": (TINY_LLAMA, [pipe([(1, (0, 4))], 2, 2)] * 2),
    "dp=2 x pp=2 x tp=2, tied": (TIED_LLAMA, [pipe([(2, (0, 2)), (2, (2, 4))], 1, 2)] * 2),
    "heterogeneous: pp=2 tp=1 beside pp=1 tp=2": (
        TINY_LLAMA, [pipe([(1, (0, 1)), (1, (1, 4))], 2, 2), pipe([(2, (0, 4))], 1, 3)]),
    "three replicas, mixed tp pipeline, tied gpt2": (
        TINY_GPT2, [pipe([(1, (0, 1)), (2, (1, 4))], 1, 2), pipe([(1, (0, 4))], 1, 2),
                    pipe([(1, (0, 3)), (1, (3, 4))], 1, 1)], {"schedule": Schedule.GPIPE}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sharded_states_give_the_same_losses_in_a_fraction_of_the_memory(case):
    spec, pipelines, *options = CASES[case]
    plan = make_plan(spec, pipelines, **(options[0] if options else {}))
    full = train_plan(with_options(plan, zero=0), bucket_elements=SMALL_BUCKETS)
    sharded = train_plan(with_options(plan, zero=1), bucket_elements=SMALL_BUCKETS)

    # reduce-scatter may add three replicas' gradients in another order than all-reduce
    assert sharded[0].losses == pytest.approx(full[0].losses, abs=1e-6)
    assert sharded[0].grad_norms == pytest.approx(full[0].grad_norms, rel=1e-5)
    assert full[0].losses == pytest.approx(reference_losses(spec, plan.training.global_batch),
                                           abs=2e-5)
    dp = len(pipelines)
    for rank, (mine, everything) in enumerate(zip(sharded, full, strict=True)):
        assert mine.state_bytes <= 1.6 * everything.state_bytes / dp, f"rank {rank}"
    replica = Layout.for_local_ranks(plan, 0)
    one_replica = sum(full[r].state_bytes for r, role in enumerate(replica.roles)
                      if role.pipeline == 0)
    assert sum(r.state_bytes for r in sharded) == pytest.approx(one_replica, rel=0.01)


def test_gradients_are_reduce_scattered_to_their_owners_not_all_reduced():
    """Under ZeRO-1 every aligned bucket goes to its owners by reduce-scatter (half the
    traffic of an all-reduce); the tied weight's two copies in pipeline 0 still all-reduce."""
    spec, pipelines = CASES["dp=2 x pp=2 x tp=2, tied"]
    plan = make_plan(spec, pipelines)
    full = train_plan(with_options(plan, zero=0), bucket_elements=SMALL_BUCKETS)
    sharded = train_plan(with_options(plan, zero=1), bucket_elements=SMALL_BUCKETS)
    assert all(s.scattered == 0 for report in full for s in report.stats)
    for rank, report in enumerate(sharded):
        last = report.stats[-1]
        assert 0 < last.scattered < last.buckets, f"rank {rank}: {last}"


def test_any_torch_optimizer_keeps_states_for_its_share_only():
    plan = make_plan(TINY_LLAMA, [pipe([(1, (0, 1)), (1, (1, 4))], 1, 2), pipe([(2, (0, 4))], 1, 2)])
    full = train_plan(with_options(plan, zero=0), optimizer=sgd_with_momentum)
    sharded = train_plan(with_options(plan, zero=1), optimizer=sgd_with_momentum)
    assert sharded[0].losses == pytest.approx(full[0].losses, abs=1e-6)
    for mine, everything in zip(sharded, full, strict=True):
        assert mine.state_bytes == pytest.approx(everything.state_bytes / 2, rel=0.3)


def _losses(plan, options):
    return [m.loss for m in train_rank(plan, options)]


def test_a_zero1_checkpoint_resumes_without_zero1_and_back(tmp_path):
    """dp=2 with sharded states -> one pipeline of two stages, unsharded -> heterogeneous
    dp=2 with sharded states: the curve of one uninterrupted run."""
    sharded = with_options(make_plan(TINY_LLAMA, [pipe([(1, (0, 4))], 1, 2)] * 2), zero=1)
    single = make_plan(TINY_LLAMA, [pipe([(1, (0, 1)), (1, (1, 4))], 2, 2)])
    hetero = with_options(make_plan(TINY_LLAMA, [pipe([(2, (0, 4))], 1, 1),
                                                 pipe([(1, (0, 2)), (1, (2, 4))], 1, 3)]),
                          zero=1)
    common = {"lr": LR, "out_dir": str(tmp_path), "progress": False, "timeout_s": 60,
              "checkpoint_every": 2}
    curve = []
    for plan, steps in ((sharded, 2), (single, 4), (hetero, 6)):
        options = TrainOptions(steps=steps, resume=steps > 2, **common)
        curve += run_local(_losses, plan.devices, (plan, options), timeout_s=120)[0]
    assert curve == pytest.approx(reference_losses(TINY_LLAMA, 4, steps=6), abs=2e-5)
