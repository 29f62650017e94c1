"""Islands at run time: inner steps inside each island, DiLoCo's outer step and bounded
staleness across islands, on CPU ranks (tiny Llama, plain SGD, a few steps)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
from dp_workers import with_offload
from family_configs import tiny_family
from island_workers import as_tensors, split, train_islands
from runtime_helpers import TINY_LLAMA, make_plan, pipe, potluck, run_plan

from potluck.plans import Compression, InnerLR, SyncMethod, save_plan
from potluck.plans.islands import INT8_BLOCK
from potluck.runtime import TrainOptions
from potluck.runtime.grads.islands import inner_lr_scale
from potluck.runtime.launch.local import run_local
from potluck.runtime.layout import Layout
from potluck.runtime.training import train_rank

ONE_STAGE = [(1, (0, 4))]


def _replicas(count: int, micro_batches: int = 2):
    return make_plan(TINY_LLAMA, [pipe(ONE_STAGE, 1, micro_batches)] * count)


def _assert_same_weights(a, b, **tolerance):
    a, b = as_tensors(a), as_tensors(b)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], **tolerance, msg=name)


def _differ(a, b, names=None) -> bool:
    a, b = as_tensors(a), as_tensors(b)
    return any(not torch.equal(a[n], b[n]) for n in (names or a))


def test_diloco_with_one_inner_step_is_synchronous_data_parallelism():
    """H=1, no compression, outer lr 1 and no momentum, inner SGD: each island's
    pseudo-gradient is lr times its batch's mean gradient, and their batch-weighted mean is
    the global mean gradient; unequal shares (3 rows against 1) test the weighting."""
    plan = make_plan(TINY_LLAMA, [pipe(ONE_STAGE, 1, 3), pipe(ONE_STAGE, 1, 1)])
    diloco = split(plan, (0,), (1,), inner_steps=1, outer_lr=1.0, outer_momentum=0.0)
    sync_runs, diloco_runs = train_islands(plan, 2), train_islands(diloco, 2)
    for sync_rank, diloco_rank in zip(sync_runs, diloco_runs, strict=True):
        for step in (1, 2):
            _assert_same_weights(sync_rank.weights[step], diloco_rank.weights[step],
                                 atol=2e-6, rtol=1e-5)
        for sync, diloco in zip(sync_rank.metrics, diloco_rank.metrics, strict=True):
            assert math.isclose(sync.loss, diloco.loss, rel_tol=1e-6)
    assert [m.outer_step for m in diloco_runs[0].metrics] == [1, 2]
    assert sync_runs[0].metrics[0].outer_step is None


def test_inner_steps_sum_gradients_inside_the_island_only():
    """Two islands of two replicas: after the first of H=2 steps the replicas of one island
    agree and the islands differ; the outer step after the second makes them all equal."""
    plan = split(_replicas(4, 1), (0, 1), (2, 3), inner_steps=2)
    runs = sorted(train_islands(plan, 2), key=lambda r: r.pipeline)
    first = [r.weights[1] for r in runs]
    _assert_same_weights(first[0], first[1], atol=0, rtol=0)
    _assert_same_weights(first[2], first[3], atol=0, rtol=0)
    assert _differ(first[0], first[2])
    for run in runs[1:]:
        _assert_same_weights(runs[0].weights[2], run.weights[2], atol=1e-7, rtol=0)
    assert [m.outer_step for m in runs[0].metrics] == [0, 1]
    assert len({m.loss for r in runs for m in r.metrics[:1]}) == 1  # the world's loss


UNITS = ["embed", *[f"block.{i}" for i in range(TINY_LLAMA.num_layers)], "head"]


def _fragment_of(unit: str, fragments: int = 2) -> int:
    """The plan data's rule (Islands.fragment_of), spelled out: contiguous runs of units."""
    return UNITS.index(unit) * fragments // len(UNITS)


def _values(run, fragment: int) -> int:
    """How many values of ``fragment`` this run's rank holds."""
    return sum(run.weights[0][name].size for name, unit in run.units.items()
               if _fragment_of(unit) == fragment)


def test_fragments_are_exchanged_at_their_steps_only_and_applied_h_over_f_steps_late():
    """H=2, two fragments, outer lr 1 and no momentum (the new outer weights are the mean of
    the islands' weights when sent): the last blocks and the head are sent after step 1 and
    applied after step 2, keeping each island's progress of step 2; the embedding and first
    blocks are sent after step 2 and applied at the end of the run (streaming DiLoCo). The
    bytes counted are those of the fragment sent (FP32)."""
    plan = split(_replicas(2), (0,), (1,), inner_steps=2, fragments=2, outer_lr=1.0,
                 outer_momentum=0.0)
    runs = sorted(train_islands(plan, 2), key=lambda r: r.pipeline)
    late, first = ([n for n, u in runs[0].units.items() if _fragment_of(u) == f] for f in (1, 0))
    after_one = [r.weights[1] for r in runs]
    assert _differ(after_one[0], after_one[1], late)  # in flight: not applied yet
    outer = _mean([r.weights[1] for r in runs], late)
    for run in runs:
        before, after, sent = (as_tensors(w) for w in (run.before[1], run.weights[2],
                                                      run.weights[1]))
        for name in late:  # new outer weights + progress since sent
            torch.testing.assert_close(after[name], outer[name] + before[name] - sent[name],
                                       atol=1e-6, rtol=1e-5, msg=name)
    assert _differ(runs[0].weights[2], runs[1].weights[2], late)  # their own progress
    drained = _mean([r.before[1] for r in runs], first)
    for run in runs:
        _assert_same_weights({n: run.drained[n] for n in first},
                             {n: drained[n].numpy() for n in first}, atol=1e-6, rtol=1e-5)
    sent_bytes = [m.bytes_exchanged_across_islands for m in runs[0].metrics]
    assert sent_bytes == [2 * 4 * _values(runs[0], 1), 2 * 4 * _values(runs[0], 0)]  # FP32


def _mean(weights: list[dict], names: list[str]) -> dict[str, torch.Tensor]:
    """The islands' mean of ``names`` (equal batch shares)."""
    tensors = [as_tensors(w) for w in weights]
    return {n: sum(t[n] for t in tensors) / len(tensors) for n in names}


def _moved(run, step: int) -> float:
    """The largest change of any weight from the start to ``step``."""
    start, now = as_tensors(run.weights[0]), as_tensors(run.weights[step])
    return max(float((now[n] - start[n]).abs().max()) for n in start)


def _gap(a, b) -> float:
    a, b = as_tensors(a), as_tensors(b)
    return max(float((a[n] - b[n]).abs().max()) for n in a)


@pytest.mark.parametrize("compression, relative", [
    (Compression.BF16, 2.0**-7), (Compression.INT8, 2.0 / 127)])
def test_a_compressed_exchange_counts_its_wire_bytes_and_rounds_the_average(
        compression, relative):
    """bf16: 2 bytes a value; int8: 1 byte a value and an FP32 scale per block. The weights
    after the outer step differ from the FP32 exchange's by no more than the rounding of the
    pseudo-gradients (relative to the step's largest move; int8: half a step of a block's
    absmax / 127 per island), and do differ."""
    plan = split(_replicas(2), (0,), (1,), inner_steps=2)
    exact = train_islands(plan, 2)[0]
    rounded = train_islands(replace(plan, islands=replace(
        plan.islands, compression=compression)), 2)[0]
    values = _values(rounded, 0) + _values(rounded, 1)
    wire = values * 2 if compression is Compression.BF16 else \
        values + 4 * math.ceil(values / INT8_BLOCK)
    assert [m.bytes_exchanged_across_islands for m in rounded.metrics] == [0, 2 * wire]
    gap = _gap(exact.weights[2], rounded.weights[2])
    assert 0 < gap <= relative * _moved(exact, 2)


@pytest.mark.parametrize("staleness", [0, 1])
def test_bounded_averages_every_h_steps_at_most_staleness_pushes_late(staleness):
    """Every step (H=1) each island pushes its update. With staleness 0 the average is
    applied at once: the islands agree after every step (and, with SGD, this is synchronous
    data parallelism). With staleness 1 a push's average lands one push later: the islands
    differ after each step, report one push in flight, and agree once the last lands."""
    plan = split(_replicas(2), (0,), (1,), sync=SyncMethod.BOUNDED, staleness=staleness)
    runs = sorted(train_islands(plan, 3), key=lambda r: r.pipeline)
    assert [m.staleness for m in runs[0].metrics] == [staleness] * 3
    assert [m.outer_step for m in runs[0].metrics] == [1, 2, 3]
    gaps = [_gap(runs[0].weights[s], runs[1].weights[s]) for s in (1, 2, 3)]
    assert [gap < 1e-6 for gap in gaps] == [staleness == 0] * 3  # up to the last bit
    assert _gap(runs[0].drained, runs[1].drained) < 1e-6
    if staleness == 0:
        sync = train_islands(_replicas(2), 3)[0]
        _assert_same_weights(sync.weights[3], runs[0].weights[3], atol=2e-6, rtol=1e-5)


def test_calibrating_an_emulation_leaves_the_outer_state_as_it_was():
    """The dilation's calibration steps are undone, the snapshot and outer steps too: an
    emulated run's losses are the plain run's."""
    plan = split(_replicas(2), (0,), (1,), inner_steps=2)
    assert run_plan(plan, steps=3, emulate=True) == run_plan(plan, steps=3)


def test_potluck_train_runs_a_split_plan_and_writes_the_islands_metrics(tmp_path):
    plan = split(_replicas(2), (0,), (1,), sync=SyncMethod.BOUNDED, staleness=1)
    save_plan(plan, tmp_path / "plan.json")
    run = potluck("train", "--plan", str(tmp_path / "plan.json"), "--steps", "2",
                  "--out", str(tmp_path / "run"))
    assert run.returncode == 0, run.stderr
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [(r["outer_step"], r["staleness"]) for r in rows] == [(1, 1), (2, 1)]
    assert all(r["bytes_exchanged_across_islands"] > 0 for r in rows)


@pytest.mark.parametrize("inner_lr", list(InnerLR))
def test_an_islands_adaptive_optimizer_steps_at_lr_over_the_root_of_its_share(inner_lr):
    """Islands of 3 rows and 1 row of 4: under ``sqrt_share`` AdamW (also wrapped, as the
    master-weights and offload optimizers wrap it) runs at 1/sqrt(3/4) and 1/sqrt(1/4) = 2
    times the run's rate; SGD, a synchronous plan and ``same`` at the run's rate."""
    plan = make_plan(TINY_LLAMA, [pipe(ONE_STAGE, 1, 3), pipe(ONE_STAGE, 1, 1)])
    split_plan = split(plan, (0,), (1,), inner_lr=inner_lr)
    adam = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))])
    wrapped = type("Wrapper", (), {"inner": adam})()
    scales = [inner_lr_scale(Layout.for_local_ranks(split_plan, rank), optimizer)
              for rank in (0, 1) for optimizer in (adam, wrapped, sgd)]
    expected = [1 / math.sqrt(0.75)] * 2 + [1.0] + [2.0] * 2 + [1.0]
    if inner_lr is InnerLR.SAME:
        expected = [1.0] * 6
    assert scales == pytest.approx(expected)
    assert inner_lr_scale(Layout.for_local_ranks(plan, 1), adam) == 1.0


def test_a_ranks_per_step_groups_stay_in_its_island_and_the_outer_ones_cross():
    """Pure layout: two islands of two one-rank replicas (ranks 0-1, 2-3)."""
    plan = split(_replicas(4, 1), (0, 1), (2, 3), inner_steps=2)
    layout = Layout.for_local_ranks(plan, 2)
    assert layout.sync_group("block.0").ranks == (2, 3)
    assert layout.cross_island_group("block.0").ranks == (0, 1, 2, 3)
    assert layout.norm_owner("head") == (2, 0)  # the island's first pipeline counts
    assert [layout.island_ranks(k) for k in (0, 1)] == [(0, 1), (2, 3)]
    assert Layout.for_local_ranks(_replicas(4, 1), 2).sync_group("block.0").ranks == \
        (0, 1, 2, 3)


TIED_LLAMA = replace(TINY_LLAMA, tied_embeddings=True)


def _same(plan):
    return plan


def _zero1(plan):
    return replace(plan, zero=1)


def _zero1_priority(plan):
    return replace(plan, zero=1, comm=replace(plan.comm, dp_priority_schedule=True))


def _experts(plan):
    return replace(plan, expert_parallel=2)


LAYOUTS = {
    # a holder of a unit counts its island's weight over the island's holders: the tied
    # weight has two per pipeline here (first and last stage)
    "tied weight, two stages": (TIED_LLAMA, [pipe([(1, (0, 2)), (1, (2, 4))], 1, 2)] * 2, _same),
    # tp=2 beside tp=1: the cross-island sum is in the full tensors' layout
    "tp=2 beside tp=1": (TINY_LLAMA, [pipe([(2, (0, 4))], 1, 2), pipe(ONE_STAGE, 1, 2)], _same),
    # ZeRO-1 owners are chosen inside each island
    "zero 1, two replicas an island": (TIED_LLAMA, [pipe(ONE_STAGE, 1, 1)] * 4, _zero1),
    # the token count in flight and the parameter all-gathers left in flight (finished
    # before the outer step reads the weights)
    "zero 1 under the priority schedule": (TINY_LLAMA, [pipe(ONE_STAGE, 1, 1)] * 4,
                                           _zero1_priority),
    # each island one expert group: a shard's cross-island group is its holders' in both
    "expert parallel, one group an island": (tiny_family("mixtral"),
                                             [pipe(ONE_STAGE, 1, 1)] * 4, _experts),
    # the optimizer steps host masters: the outer step reads and writes them
    "offloaded optimizer": (TINY_LLAMA, [pipe(ONE_STAGE, 1, 2)] * 2, with_offload),
}


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_diloco_with_one_inner_step_is_synchronous_on_other_layouts(case):
    spec, pipelines, change = LAYOUTS[case]
    plan = change(make_plan(spec, pipelines))
    half = len(pipelines) // 2
    diloco = split(plan, tuple(range(half)), tuple(range(half, len(pipelines))),
                   inner_steps=1, outer_lr=1.0, outer_momentum=0.0)
    for sync_rank, diloco_rank in zip(train_islands(plan, 2), train_islands(diloco, 2),
                                      strict=True):
        _assert_same_weights(sync_rank.weights[2], diloco_rank.weights[2],
                             atol=2e-6, rtol=1e-5)


def _losses_of_rank(plan, options):
    return [m.loss for m in train_rank(plan, options)]


def test_a_resumed_diloco_run_continues_the_uninterrupted_one(tmp_path):
    """Saved after step 3 of H=2 with two fragments: the islands' weights and AdamW states
    differ, a fragment is half way, the outer momentum is set; resuming gives the
    uninterrupted losses."""
    plan = split(_replicas(2), (0,), (1,), inner_steps=2, fragments=2)
    common = {"lr": 3e-3, "progress": False, "timeout_s": 60}
    whole = run_local(_losses_of_rank, plan.devices, (plan, TrainOptions(steps=5, **common)))
    out = {"out_dir": str(tmp_path), **common}
    before = run_local(_losses_of_rank, plan.devices,
                       (plan, TrainOptions(steps=3, checkpoint_every=3, **out)))[0]
    after = run_local(_losses_of_rank, plan.devices,
                      (plan, TrainOptions(steps=5, resume=True, **out)))[0]
    assert before + after == whole[0]
