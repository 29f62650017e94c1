"""ZeRO-2, ZeRO-3 (FSDP2) and optimizer offload: same losses as one process, less state per rank.

Each case trains a tiny model on 2-4 CPU ranks and compares the loss curve
with the plain single-process loop; the state bytes each rank keeps (local
parameters, gradients left after the sync, optimizer states on the device and
in host memory) follow the memory contract's arithmetic: ZeRO-1 divides the
optimizer states by ``d``, ZeRO-2 the gradients too, ZeRO-3 the parameters too,
and offload moves the optimizer states plus a 4-byte master copy per
parameter to host memory.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from dp_workers import SMALL_BUCKETS, train_plan, with_offload, with_options
from runtime_helpers import LR, TINY_LLAMA, make_plan, pipe, reference_losses

from potluck.cluster.spec import parse_cluster
from potluck.errors import ConfigError
from potluck.placement import block_unit
from potluck.plans import Schedule
from potluck.plans.feasibility import ZERO3_UNIFORM
from potluck.runtime import TrainOptions, build_model
from potluck.runtime.grads.buckets import SyncedParam
from potluck.runtime.grads.zero import assign_owners
from potluck.runtime.grads.zero3 import check_zero3, gathered_after_forward
from potluck.runtime.launch.local import run_local
from potluck.runtime.layout import Layout
from potluck.runtime.models.adapters import detect_family
from potluck.runtime.parallel.pipeline import StageModule
from potluck.runtime.training import train_rank

STEPS = 20
TOLERANCE = 2e-3
DP2 = [pipe([(1, (0, 4))], 2, 2)] * 2


def _losses_match(plan, reports, steps=STEPS):
    expected = reference_losses(plan.model, plan.training.global_batch, steps=steps)
    assert reports[0].losses == pytest.approx(expected, abs=TOLERANCE)


def test_zero2_shards_gradients_after_every_micro_batch():
    plan = make_plan(TINY_LLAMA, DP2)
    zero1 = train_plan(with_options(plan, zero=1), steps=1, bucket_elements=SMALL_BUCKETS)
    zero2 = train_plan(with_options(plan, zero=2), steps=STEPS, bucket_elements=SMALL_BUCKETS)
    _losses_match(plan, zero2)
    for rank, (one, two) in enumerate(zip(zero1, zero2, strict=True)):
        last = two.stats[-1]
        assert last.scattered == 2 * last.buckets, f"rank {rank}: one per micro-batch"
        assert two.grad_bytes == pytest.approx(one.grad_bytes / 2, rel=0.1), f"rank {rank}"
        assert two.state_bytes == one.state_bytes


def test_zero2_on_a_heterogeneous_layout_with_uneven_micro_batch_counts():
    """pp=2 beside pp=1 with 2 and 3 micro-batches: every group reduces twice a step."""
    plan = make_plan(TINY_LLAMA, [pipe([(1, (0, 1)), (1, (1, 4))], 2, 2), pipe([(1, (0, 4))], 1, 3)])
    reports = train_plan(with_options(plan, zero=2), steps=STEPS, bucket_elements=SMALL_BUCKETS)
    _losses_match(plan, reports)


def test_offload_keeps_optimizer_states_and_masters_in_host_memory():
    plan = make_plan(TINY_LLAMA, DP2)
    plain = train_plan(plan, steps=1)
    offloaded = train_plan(with_offload(plan), steps=STEPS)
    _losses_match(plan, offloaded)
    for mine, base in zip(offloaded, plain, strict=True):
        assert mine.state_bytes == 0
        # per fp32 parameter of 4 bytes: Adam's two moments (8 B) and the master copy (4 B)
        assert mine.host_bytes == 3 * base.param_bytes


@pytest.mark.parametrize("schedule", [Schedule.ONE_F_ONE_B, Schedule.ZERO_BUBBLE])
def test_offload_without_replicas_copies_each_gradient_once_final(schedule):
    """No replica sums these gradients: each goes to the host after its last micro-batch's
    accumulation, during the backward pass (zero bubble's weight passes, which run no
    hooks, at the step), and the losses are the plain loop's."""
    plan = make_plan(TINY_LLAMA, [pipe([(1, (0, 2)), (1, (2, 4))], 1, 4)], schedule=schedule)
    _losses_match(plan, train_plan(with_offload(plan), steps=STEPS))


def test_offload_with_zero2_offloads_the_owned_share_only():
    plan = make_plan(TINY_LLAMA, DP2)
    plain = train_plan(plan, steps=1)
    reports = train_plan(with_offload(with_options(plan, zero=2)), steps=STEPS,
                         bucket_elements=SMALL_BUCKETS)
    _losses_match(plan, reports)
    one_replica = 3 * plain[0].param_bytes  # moments and masters of every parameter once
    assert sum(r.host_bytes for r in reports) == one_replica
    assert all(r.host_bytes < 0.7 * one_replica for r in reports)


def test_zero3_refuses_replicas_that_hold_layers_differently():
    hetero = make_plan(TINY_LLAMA, [pipe([(1, (0, 1)), (1, (1, 4))], 2, 2), pipe([(2, (0, 4))], 1, 2)])
    with pytest.raises(ConfigError, match="zero 3 needs every replica") as err:
        check_zero3(with_options(hetero, zero=3))
    assert str(err.value) == ZERO3_UNIFORM
    check_zero3(with_options(hetero, zero=2))
    zero_bubble = make_plan(TINY_LLAMA, [pipe([(1, (0, 2)), (1, (2, 4))], 1, 4)] * 2,
                            schedule=Schedule.ZERO_BUBBLE)
    with pytest.raises(ConfigError, match="zero bubble"):
        check_zero3(with_options(zero_bubble, zero=3))
    check_zero3(with_options(make_plan(TINY_LLAMA, DP2), zero=3))


ZERO3_CASES = {
    "dp=2": (TINY_LLAMA, DP2),
    "dp=2 x pp=2": (TINY_LLAMA, [pipe([(1, (0, 2)), (1, (2, 4))], 1, 2)] * 2),
    "dp=2 x tp=2": (TINY_LLAMA, [pipe([(2, (0, 4))], 2, 2)] * 2),
}


@pytest.mark.parametrize("case", list(ZERO3_CASES))
def test_zero3_shards_parameters_with_fsdp2(case):
    spec, pipelines = ZERO3_CASES[case]
    plan = make_plan(spec, pipelines)
    plain = train_plan(plan, steps=1)
    reports = train_plan(with_options(plan, zero=3), steps=STEPS)
    _losses_match(plan, reports)
    for rank, (mine, base) in enumerate(zip(reports, plain, strict=True)):
        for name in ("param_bytes", "grad_bytes", "state_bytes"):
            assert getattr(mine, name) == pytest.approx(getattr(base, name) / 2, rel=0.02), \
                f"rank {rank}: {name}"


MIXED_MEMORY = parse_cluster(
    "devices:\n  big: {base: rtx3090}\n  small: {base: rtx3060}\n"
    "nodes:\n  - {name: a, gpu: big, gpus_per_node: 1}\n  - {name: b, gpu: small, gpus_per_node: 1}\n",
    "mixed.yaml")


class _Param:
    def __init__(self, numel: int) -> None:
        self._numel = numel

    def numel(self) -> int:
        return self._numel


def _owner_shares(plan) -> list[float]:
    layout = Layout.for_local_ranks(plan, 0)
    params = [SyncedParam(f"model.layers.{i}.w{j}", _Param(1000 + 37 * j), block_unit(i),
                          layout.sync_group(block_unit(i))) for i in range(4) for j in range(8)]
    owners = assign_owners(layout, params)
    total = sum(p.param.numel() for p in params)
    return [sum(p.param.numel() for p in params if owners[p.name] == k) / total
            for k in range(plan.dp)]


def test_zero_shares_follow_device_memory():
    """A 24 GB and a 12 GB replica keep 2/3 and 1/3 of the optimizer states; equal memory
    halves them."""
    mixed = make_plan(TINY_LLAMA, DP2, cluster=MIXED_MEMORY, device_ids=["a.0:0", "b.0:0"])
    big, small = _owner_shares(replace(mixed, zero=1))
    assert big == pytest.approx(2 / 3, abs=0.03)
    assert small == pytest.approx(1 / 3, abs=0.03)
    even = _owner_shares(with_options(make_plan(TINY_LLAMA, DP2), zero=1))
    assert even == pytest.approx([0.5, 0.5], abs=0.03)


def _losses(plan, options):
    return [m.loss for m in train_rank(plan, options)]


DP2_MB1 = make_plan(TINY_LLAMA, [pipe([(1, (0, 4))], 1, 2)] * 2)
SINGLE = make_plan(TINY_LLAMA, [pipe([(1, (0, 1)), (1, (1, 4))], 2, 2)])
RESUME_CHAINS = {
    "zero 2, then one pipeline with offload, then zero 1 with offload": (
        with_options(DP2_MB1, zero=2), with_offload(SINGLE),
        with_offload(with_options(DP2_MB1, zero=1))),
    "zero 3, then one pipeline, then zero 3 with offload": (
        with_options(DP2_MB1, zero=3), SINGLE, with_offload(with_options(DP2_MB1, zero=3))),
}


@pytest.mark.parametrize("chain", list(RESUME_CHAINS))
def test_checkpoints_resume_across_zero_stages_and_offload(tmp_path, chain):
    """Two steps on each plan in turn, each resuming from the previous one's checkpoint:
    the curve of one uninterrupted run."""
    common = {"lr": LR, "out_dir": str(tmp_path), "progress": False, "timeout_s": 60,
              "checkpoint_every": 2}
    curve = []
    for plan, steps in zip(RESUME_CHAINS[chain], (2, 4, 6), strict=True):
        options = TrainOptions(steps=steps, resume=steps > 2, **common)
        curve += run_local(_losses, plan.devices, (plan, options), timeout_s=120)[0]
    assert curve == pytest.approx(reference_losses(TINY_LLAMA, 4, steps=6), abs=2e-5)


# the units each rank keeps gathered from a micro-batch's forward to its backward: without
# pipelining, the head (norm and output layer) and the last block, which that backward
# starts with at once; under 1F1B other micro-batches' forwards come between, so none
KEPT_AFTER_FORWARD = {"dp=2": ["lm_head", "model.layers.3", "model.norm"], "dp=2 x pp=2": []}


@pytest.mark.parametrize("case", list(KEPT_AFTER_FORWARD))
def test_zero3_reshards_all_but_the_backwards_first_units_after_forward(case):
    """torch makes each FSDP module that runs outside an FSDP parent a root, and a root
    keeps its weights unsharded from forward to backward: each stage must be the one root,
    so that a block's weights are sharded again once its forward is done (all but the units
    a backward that follows at once starts with); and torch's pipeline stage must not defer
    an FSDP stage's gradient reduction to the last micro-batch, holding full-size gradients
    in between."""
    from zero3_workers import inspect_fsdp

    spec, pipelines = ZERO3_CASES[case]
    views = inspect_fsdp(with_options(make_plan(spec, pipelines), zero=3))
    for rank, view in enumerate(views):
        assert view.fsdp_modules > 2, f"rank {rank}: blocks, embedding and head sharded"
        assert view.roots == ["0.<stage>"], f"rank {rank}: roots {view.roots}"
        assert view.unsharded_after_forward == KEPT_AFTER_FORWARD[case], f"rank {rank}"
        assert view.unsharded_grads_between_micro_batches == [], f"rank {rank}"


def test_zero3_units_kept_for_the_backward_add_nothing_to_the_gathered_peak():
    """The head and last block kept gathered after forward are what the backward gathers
    first anyway: the most weight elements gathered at once in a step (two blocks: one
    computed, one prefetched) is that of every unit resharded, as the cost model's ZeRO-3
    working set has it."""
    from zero3_workers import inspect_fsdp

    plan = with_options(make_plan(*ZERO3_CASES["dp=2"]), zero=3)
    kept = [view.most_gathered_elements for view in inspect_fsdp(plan)]
    resharded = [view.most_gathered_elements for view in inspect_fsdp(plan, reshard_all=True)]
    assert kept == resharded


def test_zero3_keeps_the_last_chunks_tail_gathered_in_a_pipeline_of_one_stage_only():
    """A rank's chunks of a one-stage pipeline run one after the other: only the last
    chunk's head and last block meet their backward right after their forward."""
    model = build_model(TINY_LLAMA)
    family = detect_family(model)
    chunks = [StageModule(model, family, (0, 2), first=True, last=False),
              StageModule(model, family, (2, 4), first=False, last=True)]
    kept = gathered_after_forward(chunks, family, pp=1)
    names = [f"{i}.{name}" for i, chunk in enumerate(chunks)
             for name, module in chunk.named_modules() if id(module) in kept]
    assert sorted(names) == ["1.lm_head", "1.model.layers.3", "1.model.norm"]
    assert gathered_after_forward(chunks, family, pp=2) == set()


def test_zero3_forward_under_autocast_follows_the_sharded_weights():
    """Autocast caches its 16-bit cast of an FP32 leaf for the whole autocast region, and
    FSDP2 reuses one unsharded parameter object across reshards: without 16-bit gathers
    and the cache off, a forward after the weights changed would use the old weights."""
    from zero3_workers import outputs_follow_weights

    plan = with_options(make_plan(TINY_LLAMA, [pipe([(1, (0, 4))], 1, 2)] * 2), zero=3)
    assert outputs_follow_weights(plan) == [True, True]


def test_zero2_sums_16_bit_micro_batches_in_fp32(tmp_path):
    """300 micro-batches of two replicas' bf16 gradients of one: 600, not bf16's 512 (at
    512 a bf16 step is 4, so adding 2 rounds back to 512)."""
    import json

    from dist_harness import run_ranks
    from zero2_workers import sum_bf16_micro_batches

    out = tmp_path / "sum.json"
    run_ranks(sum_bf16_micro_batches, 2, 300, str(out), timeout_s=60)
    assert json.loads(out.read_text()) == [600.0] * 4
