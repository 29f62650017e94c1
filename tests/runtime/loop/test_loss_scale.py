"""Dynamic loss scaling (fp16): the policy, and the trainer dividing the scale out exactly
and skipping a step whose gradients overflowed on any rank, on every rank alike.

CPU ranks compute in fp32, so a scale of 2**10 must leave the training curve as it
is without one; plain SGD is used because Adam would hide a scale left in the
gradients (it is nearly scale-invariant).
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from runtime_helpers import LR, TINY_LLAMA, make_plan, pipe

from potluck.cluster import Cluster, parse_cluster
from potluck.errors import TrainingError
from potluck.plans import DType, Plan
from potluck.runtime import Trainer, build_model, parallelize, start
from potluck.runtime.checkpoints import training_run
from potluck.runtime.launch.local import run_local
from potluck.runtime.launch.session import Session
from potluck.runtime.layout import Layout
from potluck.runtime.loop.batches import RandomTokens
from potluck.runtime.loop.loss_scale import DynamicLossScale
from potluck.runtime.loop.trainer import MAX_SKIPPED_STEPS

STEPS = 4
POISONED_STEP = 1  # rank 1 makes one gradient inf in this step


def test_an_overflow_halves_the_scale_and_a_run_of_finite_steps_doubles_it():
    scale = DynamicLossScale(scale=1024.0, growth_interval=3)
    scale.update(grads_finite=False)
    assert scale.scale == 512.0
    for _ in range(2):
        scale.update(grads_finite=True)
    assert scale.scale == 512.0
    scale.update(grads_finite=False)  # an overflow restarts the count
    scale.update(grads_finite=True)
    scale.update(grads_finite=True)
    assert scale.scale == 256.0
    scale.update(grads_finite=True)
    assert scale.scale == 512.0


def test_the_scale_never_drops_below_its_floor_and_survives_a_checkpoint():
    scale = DynamicLossScale(scale=4.0, min_scale=1.0)
    for _ in range(5):
        scale.update(grads_finite=False)
    assert scale.scale == 1.0
    scale.update(grads_finite=True)
    restored = DynamicLossScale()
    restored.load_state_dict(scale.state_dict())
    assert (restored.scale, restored.finite_steps) == (1.0, 1)


@pytest.mark.parametrize("bad", [{"scale": 0.0}, {"scale": math.inf}, {"growth_factor": 1.0},
                                 {"backoff_factor": 1.5}, {"growth_interval": 0}])
def test_a_policy_that_cannot_work_is_refused(bad):
    with pytest.raises(ValueError):
        DynamicLossScale(**bad)


def _train(plan: Plan, scale: float | None, poison: bool) -> list[tuple[float, float, bool, float]]:
    """(loss, grad norm, skipped, sum of this rank's parameters) after every step."""
    session = start(plan, timeout_s=60)
    try:
        model = parallelize(build_model(plan.model), session)
        optimizer = torch.optim.SGD(list(model.parameters()), lr=LR * 10)
        policy = None if scale is None else DynamicLossScale(scale=scale)
        trainer = Trainer(model, optimizer, loss_scale=policy)
        data = RandomTokens(plan.model.vocab_size, plan.training.seq_len, plan.training.global_batch)
        first = next(iter(model.parameters()))
        results = []
        for step in range(STEPS):
            hook = None
            if poison and step == POISONED_STEP and session.rank == 1:
                hook = first.register_hook(lambda grad: grad * math.inf)
            metrics = trainer.step(data.replica_rows(step, *session.layout.batch_rows))
            if hook is not None:
                hook.remove()
            total = float(sum(p.detach().double().sum() for p in model.parameters()))
            results.append((metrics.loss, metrics.grad_norm, metrics.skipped, total))
        return results
    finally:
        session.close()


def _run(scale: float | None, poison: bool = False) -> list[list[tuple[float, float, bool, float]]]:
    plan = make_plan(TINY_LLAMA, [pipe([(1, (0, 1)), (1, (1, 4))], 1, 2), pipe([(1, (0, 4))], 2, 1)])
    return run_local(_train, plan.devices, (plan, scale, poison), timeout_s=120)


def test_a_scaled_loss_trains_exactly_like_an_unscaled_one():
    plain, scaled = _run(None), _run(2.0**10)
    for rank, (mine, reference) in enumerate(zip(scaled, plain, strict=True)):
        for step, (got, want) in enumerate(zip(mine, reference, strict=True)):
            assert got[0] == pytest.approx(want[0], rel=1e-5), f"loss, rank {rank} step {step}"
            assert got[1] == pytest.approx(want[1], rel=1e-5), f"norm, rank {rank} step {step}"
            assert got[3] == pytest.approx(want[3], rel=1e-5), f"params, rank {rank} step {step}"
            assert not got[2]


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank():
    runs = _run(2.0**10, poison=True)
    for rank, steps in enumerate(runs):
        assert [skipped for _, _, skipped, _ in steps] == [
            step == POISONED_STEP for step in range(STEPS)], f"rank {rank}"
        before, during = steps[POISONED_STEP - 1][3], steps[POISONED_STEP][3]
        assert during == before, f"rank {rank} changed its parameters in a skipped step"
        assert steps[-1][3] != during and all(math.isfinite(s[3]) for s in steps)
        assert math.isfinite(steps[POISONED_STEP][0])  # the loss itself was fine


def _scale_after_resume(plan: Plan, out_dir: str) -> tuple[float, float]:
    """The scale after two growing steps, and what a fresh trainer resumes with."""
    session = start(plan, timeout_s=60)
    try:
        data = RandomTokens(plan.model.vocab_size, plan.training.seq_len, plan.training.global_batch)
        model = parallelize(build_model(plan.model), session)
        trainer = Trainer(model, loss_scale=DynamicLossScale(scale=8.0, growth_interval=1))
        for step in range(2):
            trainer.step(data.replica_rows(step, *session.layout.batch_rows))
        training_run.save(trainer, data, out_dir)
        fresh = Trainer(parallelize(build_model(plan.model), session),
                        loss_scale=DynamicLossScale())
        training_run.resume(fresh, data, out_dir)
        return trainer.loss_scale.scale, fresh.loss_scale.scale
    finally:
        session.close()


def test_a_resumed_run_continues_with_the_scale_it_had(tmp_path):
    plan = make_plan(TINY_LLAMA, [pipe([(1, (0, 4))], 2, 1)])
    saved, resumed = run_local(_scale_after_resume, plan.devices, (plan, str(tmp_path)),
                               timeout_s=120)[0]
    assert saved == 32.0
    assert resumed == saved


def _gpu_session(gpus: str, dtype: DType, rank: int = 0) -> Session:
    """A session as a GPU rank would hold it (no GPU needed to ask its dtypes)."""
    cluster = parse_cluster(f"nodes:\n{gpus}", "gpus.yaml")
    ids = [d.id for d in Cluster(cluster).devices]
    plan = make_plan(TINY_LLAMA, [pipe([(1, (0, 2)), (1, (2, 4))], 1, 4)], cluster=cluster,
                     device_ids=ids)
    plan = replace(plan, training=replace(plan.training, dtype=dtype))
    return Session(plan, Layout.for_local_ranks(plan, rank), torch.device("cuda", 0), None)


def test_gpus_without_bf16_compute_in_fp16_with_loss_scaling_in_a_bf16_plan():
    session = _gpu_session("  - {name: v, gpu: v100-32g, gpus_per_node: 2}\n", DType.BF16)
    assert session.autocast_dtype is torch.float16
    assert session.any_fp16 and not session.all_bf16


def test_a_mixed_plan_scales_the_loss_on_every_rank_and_reduces_in_full_precision():
    gpus = ("  - {name: a, gpu: a100-80g-sxm, gpus_per_node: 1}\n"
            "  - {name: t, gpu: t4, gpus_per_node: 1}\n")
    a100, t4 = _gpu_session(gpus, DType.BF16, 0), _gpu_session(gpus, DType.BF16, 1)
    assert a100.autocast_dtype is torch.bfloat16 and t4.autocast_dtype is torch.float16
    assert a100.any_fp16 and t4.any_fp16
    assert not a100.all_bf16


def test_a_bf16_plan_on_bf16_gpus_stays_bf16():
    session = _gpu_session("  - {name: a, gpu: a100-80g-sxm, gpus_per_node: 2}\n", DType.BF16)
    assert session.autocast_dtype is torch.bfloat16
    assert session.all_bf16 and not session.any_fp16


def _steps_until_stopped(plan: Plan, scale: float | None) -> tuple[int, str]:
    """Poison every step's gradients; how many steps ran before the run stopped, and why."""
    session = start(plan, timeout_s=60)
    try:
        model = parallelize(build_model(plan.model), session)
        policy = None if scale is None else DynamicLossScale(scale=scale)
        trainer = Trainer(model, loss_scale=policy)
        data = RandomTokens(plan.model.vocab_size, plan.training.seq_len, plan.training.global_batch)
        next(iter(model.parameters())).register_hook(lambda grad: grad * math.inf)
        for step in range(100):
            try:
                trainer.step(data.replica_rows(step, *session.layout.batch_rows))
            except TrainingError as err:
                return step + 1, str(err)
        return 100, ""
    finally:
        session.close()


@pytest.mark.parametrize("scale", [None, 2.0**4])
def test_a_run_whose_every_step_overflows_stops_once_a_lower_scale_cannot_help(scale):
    """Skips while fp16's scale still halves (16 -> 1: four) are what loss scaling is for;
    after that MAX_SKIPPED_STEPS in a row stop the run. Without scaling (bf16, fp32)
    nothing overflows from scaling: the first non-finite step stops it."""
    plan = make_plan(TINY_LLAMA, [pipe([(1, (0, 4))], 2, 1)])
    ran, why = run_local(_steps_until_stopped, plan.devices, (plan, scale), timeout_s=120)[0]
    if scale is None:
        assert ran == 1
        assert "stopped at step 0: its loss or gradients are inf or NaN in fp32" in why
    else:
        assert ran == 4 + MAX_SKIPPED_STEPS
        assert f"{MAX_SKIPPED_STEPS} steps in a row were skipped" in why
    assert "no checkpoint of this run is known to be good" in why
