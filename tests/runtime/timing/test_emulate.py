"""Emulation: a plan for GPUs runs on CPU ranks, timed like the GPUs, computing the same numbers."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist
from runtime_helpers import TINY_LLAMA, make_plan, pipe, run_plan

from potluck.cluster.spec import parse_cluster
from potluck.ops import OpKind
from potluck.runtime.launch.local import run_local
from potluck.runtime.layout import Layout
from potluck.runtime.models.stand_in import compute_plan
from potluck.runtime.options import TrainOptions
from potluck.runtime.timing.emulate import (
    OVERRUN_BUDGET,
    EmulationClock,
    OpTargets,
    needed_dilation,
    predict,
    stage_targets,
)
from potluck.runtime.training import train_rank

FAST_AND_SLOW = parse_cluster(
    "nodes:\n"
    "  - {name: fast, gpu: a100-80g-sxm, gpus_per_node: 1}\n"
    "  - {name: slow, gpu: rtx3090, gpus_per_node: 1}\n",
    "fast-and-slow.yaml",
)


def gpu_plan():
    return make_plan(TINY_LLAMA, [pipe([(1, (0, 3)), (1, (3, 4))], 1, 4)],
                     cluster=FAST_AND_SLOW, device_ids=["fast.0:0", "slow.0:0"])


def _busy(seconds: float, result: int) -> int:
    """Compute for ``seconds`` (at least) and return ``result``."""
    began = time.perf_counter()
    while time.perf_counter() - began < seconds:
        pass
    return result


def test_clock_pads_each_op_to_dilated_prediction(monkeypatch):
    """The clock sleeps what is left of ``dilation x predicted`` once the op has run.

    The sleep asked for is checked, not the time a sleep took: a busy machine wakes a
    sleeper late by any amount, but what the clock asks for lies between two bounds it
    cannot escape: the target minus the whole time until it asked, and the target minus
    the op's own time."""
    asked = []
    sleep = time.sleep

    def noting_sleep(seconds):
        asked.append((seconds, time.perf_counter()))
        sleep(seconds)

    monkeypatch.setattr(time, "sleep", noting_sleep)
    clock = EmulationClock({0: OpTargets(forward_s=0.05, backward_s=0.02)}, dp_sync_s=0.0,
                           optimizer_s=0.0, dilation=3.0)
    began = time.perf_counter()
    assert clock.run(OpKind.FORWARD, 0, lambda: _busy(0.01, 7)) == 7  # 0.01 s of 0.15 s
    ended = time.perf_counter()
    [(padding_s, asked_at)] = asked
    assert 0.15 - (asked_at - began) <= padding_s <= 0.15 - 0.01
    assert ended - began >= 0.15
    clock.run(OpKind.BACKWARD, 0, lambda: _busy(0.08, 0))  # slower than 3 x 0.02 s
    assert clock.overruns == 1 and len(asked) == 1  # an overrun is not padded


def test_targets_follow_the_cost_model_and_the_device():
    plan = gpu_plan()
    fast = stage_targets(plan, Layout.for_local_ranks(plan, 0))[0]
    slow = stage_targets(plan, Layout.for_local_ranks(plan, 1))[1]
    assert fast.forward_s > 0 and slow.forward_s > 0
    # three blocks on the A100 are still quicker than one block and the head on the 3090
    assert fast.backward_s < 3 * slow.backward_s


TWO_MACHINES = parse_cluster(
    "nodes:\n"
    "  - {name: fast, gpu: a100-80g-sxm, gpus_per_node: 2, inter_bandwidth: 10Gb/s}\n"
    "  - {name: slow, gpu: rtx3090, gpus_per_node: 2, inter_bandwidth: 10Gb/s}\n",
    "two-machines.yaml",
)


def test_pipelines_sharing_a_network_card_are_padded_as_the_cost_model_charges_them():
    """Two pipelines crossing from one machine to the other share its card: each transfer
    gets half the bandwidth, in the emulation as in the prediction."""
    from potluck.planner.cost import CostModel
    from potluck.planner.evaluate import stage_op_times
    from potluck.planner.network import NicSharing

    one = make_plan(TINY_LLAMA, [pipe([(1, (0, 2)), (1, (2, 4))], 1, 2)], cluster=TWO_MACHINES,
                    device_ids=["fast.0:0", "slow.0:0"])
    two = make_plan(TINY_LLAMA, [pipe([(1, (0, 2)), (1, (2, 4))], 1, 2)] * 2,
                    cluster=TWO_MACHINES, device_ids=["fast.0:0", "slow.0:0", "fast.0:1", "slow.0:1"])
    cost = CostModel.for_plan(two)
    a, b = cost.cluster.device("fast.0:0"), cost.cluster.device("slow.0:0")
    sends = []
    for plan in (one, two):
        target = stage_targets(plan, Layout.for_local_ranks(plan, 0))[0]
        sends.append(target.forward_s - stage_op_times(plan)[0][0].forward_s)
    assert sends[0] == pytest.approx(cost.send_s((a,), (b,), 1))
    assert sends[1] == pytest.approx(cost.send_s((a,), (b,), 1, NicSharing({"fast.0": 2, "slow.0": 2})))
    assert sends[1] > sends[0]


def test_calibration_makes_the_dilation_cover_the_op_but_for_the_overrun_budget():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        clock = EmulationClock({0: OpTargets(1e-4, 2e-4)}, 0.0, 0.0)
        began = time.perf_counter()
        clock.run(OpKind.FORWARD, 0, lambda: _busy(0.01, 0))
        took_s = time.perf_counter() - began  # the clock's own measure lies in [0.01, took_s]
        at_least = 1.5 * 0.01 / 1e-4 / (1 + OVERRUN_BUDGET)
        assert at_least * (1 - 1e-9) <= clock.calibrate(margin=1.5) <= 1.5 * took_s / 1e-4
    finally:
        dist.destroy_process_group()


def _stretched_s(ops, dilation):
    """What the ops take padded to ``dilation`` x their predictions (an overrun: its own time)."""
    return sum(max(took_s, dilation * predicted_s) for took_s, predicted_s in ops)


def test_tiny_ops_that_cost_the_cpu_a_fixed_overhead_do_not_set_the_dilation():
    """A layer's sub-batch pieces under tp_overlap_chunks: predicted at microseconds, they
    cost the CPU its fixed per-op overhead. Covering their ratio (10,000 here) would make
    the step 100x longer than the big ops need; the chosen stretch covers the big ops and
    lets the tiny ones overrun by at most the budget of the step."""
    big = [(0.1, 1e-3)] * 10  # 100x their prediction
    tiny = [(1e-3, 1e-7)] * 20  # 10,000x theirs, 2% of the CPU's time
    ops = big + tiny
    dilation = needed_dilation(ops)
    assert 100 / (1 + OVERRUN_BUDGET) <= dilation < 110  # the tiny ones: 10,000
    predicted_s = sum(p for _, p in ops)
    assert _stretched_s(ops, dilation) <= (1 + OVERRUN_BUDGET) * dilation * predicted_s * (1 + 1e-9)
    assert needed_dilation(big) == pytest.approx(100 / (1 + OVERRUN_BUDGET), rel=1e-6)
    assert needed_dilation([]) == 0.0
    # the budget is of the whole step, which also holds communication and bubbles
    assert needed_dilation(big, step_s=0.02) < needed_dilation(big, step_s=0.01)
    assert needed_dilation(big, step_s=0.001) == needed_dilation(big)  # at least the ops' sum


def test_ops_that_hold_the_cpus_time_set_the_dilation_whatever_their_size():
    """When the slow ops are where the time goes, the stretch covers them: a smaller one
    would make the step longer than the budget allows."""
    ops = [(0.1, 1e-3)] * 10 + [(1.0, 1e-3)] * 10  # 100x and 1,000x, the latter most of the time
    dilation = needed_dilation(ops)
    assert dilation > 800
    predicted_s = sum(p for _, p in ops)
    assert _stretched_s(ops, 0.9 * dilation) > (1 + OVERRUN_BUDGET) * 0.9 * dilation * predicted_s


def _assert_emulated_step(measured_s: float, predicted_s: float) -> None:
    """The clock pads every op up to its target, so an emulated step never ends early; on a
    busy machine it may overrun, but not by a whole second step (padding applied twice)."""
    assert 0.9 * predicted_s <= measured_s < 2.0 * predicted_s


def _emulated(plan, options):
    return [(m.loss, m.step_time_s, m.predicted_step_time_s) for m in train_rank(plan, options)]


def test_emulation_changes_timing_never_numerics():
    plan = gpu_plan()
    dilation = 0.4 / predict(plan).iteration_time_s  # a 0.4 s emulated step
    options = TrainOptions(steps=4, lr=3e-3, emulate=True, dilation=dilation, progress=False,
                           timeout_s=60)
    results = run_local(_emulated, plan.devices, (plan, options), timeout_s=120)[0]
    losses = [loss for loss, _, _ in results]
    plain = run_plan(make_plan(TINY_LLAMA, [pipe([(1, (0, 3)), (1, (3, 4))], 1, 4)]), steps=4)
    assert losses == plain
    for _, measured_s, predicted_s in results[1:]:
        assert predicted_s == pytest.approx(0.4)
        _assert_emulated_step(measured_s, predicted_s)


def test_calibrating_the_dilation_neither_trains_nor_uses_up_steps():
    plan = gpu_plan()
    options = TrainOptions(steps=2, lr=3e-3, emulate=True, progress=False, timeout_s=60)
    results = run_local(_emulated, plan.devices, (plan, options), timeout_s=120)[0]
    plain = run_plan(make_plan(TINY_LLAMA, [pipe([(1, (0, 3)), (1, (3, 4))], 1, 4)]), steps=2)
    assert [loss for loss, _, _ in results] == plain


def test_a_tiny_stand_in_keeps_the_layout_and_the_block_count():
    plan = make_plan(TINY_LLAMA, [pipe([(2, (0, 3)), (2, (3, 4))], 1, 4)])
    computed = compute_plan(plan, TrainOptions(stand_in="tiny"))
    assert computed.pipelines == plan.pipelines
    assert computed.model.num_layers == plan.model.num_layers
    assert computed.model.hidden_size == 64 and computed.model.num_heads % 2 == 0


@pytest.mark.parametrize(("step_s", "stand_in", "hinted"),
                         [(10.0, None, False), (40.0, None, True), (40.0, "tiny", False)])
def test_a_long_emulated_step_is_announced_with_the_way_to_speed_it_up(step_s, stand_in, hinted):
    from potluck.runtime.loop.metrics import StepEstimate, estimate_line

    line = estimate_line(12, StepEstimate(step_s, dilation=step_s / 0.1), stand_in)
    assert f"12 emulated steps of about {step_s:.0f} s each" in line
    assert f"every op {step_s / 0.1:.0f}x its predicted time" in line
    assert f"about {12 * step_s / 60:.2g} min in all (an estimate)" in line
    assert ("--stand-in tiny" in line) is hinted


def test_an_op_nested_in_another_is_padded_apart_and_not_counted_twice(monkeypatch):
    """The explicit TP executor's pieces run inside their stage's op: each is padded to its
    own target, and the op around them pads only its own work to its (smaller) target."""
    from potluck.planner.compute import BlockTimes, PartTimes
    from potluck.planner.cost import ExplicitTP
    from potluck.runtime.timing.clock import Segment
    from potluck.runtime.timing.targets import RankTargets

    part = BlockTimes(0.02, 0.04, 0.0)
    pieces = ExplicitTP((PartTimes(part, part),), chunks=1, allreduce_s=0.0, boundary_s=0.0)
    clock = EmulationClock(RankTargets({0: OpTargets(0.01, 0.01)}, explicit={0: pieces},
                                       first_layers={0: 3}), dilation=2.0)
    segment = Segment(OpKind.FORWARD, 0, "attention", layer=3)
    began = time.perf_counter()
    clock.run(OpKind.FORWARD, 0, lambda: [clock.run_segment(segment, lambda: 0) for _ in range(3)])
    took = time.perf_counter() - began
    padded_s = 3 * 0.04 + 0.02  # not padded to the op's 0.02 only
    assert padded_s <= took < 1.8 * padded_s  # nor counted twice (slack for a busy machine)
    assert clock.overruns == 0


def test_collectives_queue_on_their_channel_and_a_wait_lasts_until_the_end():
    """Two all-reduces started at once on the TP channel end one after the other; waiting
    for the second lasts both, and the wait is not the op's own work."""
    from potluck.planner.compute import BlockTimes, PartTimes
    from potluck.planner.cost import ExplicitTP
    from potluck.runtime.timing.clock import CommOp
    from potluck.runtime.timing.targets import RankTargets

    part = BlockTimes(0.0, 0.0, 0.0)
    pieces = ExplicitTP((PartTimes(part, part),), chunks=2, allreduce_s=0.05, boundary_s=0.0)
    clock = EmulationClock(RankTargets({0: OpTargets(0.0, 0.0)}, explicit={0: pieces}),
                           dilation=1.0)

    class Done:
        def wait(self):
            return None

    def op():
        first = clock.start_comm(CommOp(OpKind.TP_ALLREDUCE, 0), Done())
        second = clock.start_comm(CommOp(OpKind.TP_ALLREDUCE, 0), Done())
        second.wait()
        first.wait()

    began = time.perf_counter()
    clock.run(OpKind.FORWARD, 0, op)
    assert time.perf_counter() - began >= 0.1
    assert clock.max_ratio == 0.0 and clock.overruns == 0  # the op's own work: nothing


def test_a_received_transfer_arrives_after_both_ends_were_ready():
    """The receiver knows when it was ready and the stamp says when the sender was: the
    transfer starts at the later of the two and takes its dilated time; a send's channel is
    busy until its estimated end, so the next send on it starts after."""
    import torch

    from potluck.runtime.timing.p2p_emulation import P2PEmulation

    class Op:
        def __init__(self, peer):
            self.peer, self.group = peer, None

    emulation = P2PEmulation({(OpKind.RECV_FORWARD, 1): 0.5, (OpKind.SEND_FORWARD, 1): 0.25},
                             dilation=2.0)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        recv = Op(peer=0)
        emulation.tag([recv], OpKind.RECV_FORWARD, 1)
        batch, posted = emulation.post([recv])
        assert len(batch) == 2 and batch[1].op is torch.distributed.irecv  # the stamp follows
        sender_ready = posted[0].ready_s + 3.0
        posted[0].stamp.fill_(sender_ready)
        assert emulation.arrival_s(posted) == pytest.approx(sender_ready + 2.0 * 0.5)
        first, second = Op(peer=0), Op(peer=0)
        emulation.tag([first, second], OpKind.SEND_FORWARD, 1)
        _, sent = emulation.post([first])
        _, queued = emulation.post([second])
        assert queued[0].ready_s == pytest.approx(sent[0].ready_s + 2.0 * 0.25)
    finally:
        dist.destroy_process_group()


def test_split_channels_stay_timed_after_the_clock_starts_timing_them():
    """The wrapping of torch's batch and wait functions lasts while the clock lives, not
    only while the statement that installed it runs (a dropped context manager is closed
    when collected: the emulated transfers then took no time at all)."""
    import gc

    from torch.distributed.pipelining import schedules

    from potluck.runtime.timing.targets import RankTargets

    original = schedules._batch_p2p
    clock = EmulationClock(RankTargets({}, sends_s={(OpKind.SEND_FORWARD, 0): 0.1}),
                           dilation=2.0)
    clock.time_transfers()
    try:
        gc.collect()
        assert schedules._batch_p2p is not original
    finally:
        clock.stop_timing_transfers()
    assert schedules._batch_p2p is original


def test_split_channels_are_emulated_beside_the_compute_with_unchanged_numerics():
    """With split channels the transfers are not padded into the compute ops but timed on
    their channels; the step still takes what the cost model predicts."""
    from dataclasses import replace

    from potluck.plans import CommSchedule

    plan = replace(gpu_plan(), comm=CommSchedule(split_p2p_channels=True))
    plan = replace(plan, prediction=predict(replace(plan, prediction=None)))
    targets = stage_targets(plan, Layout.for_local_ranks(plan, 0))
    blocking = stage_targets(gpu_plan(), Layout.for_local_ranks(gpu_plan(), 0))
    assert targets[0].forward_s < blocking[0].forward_s  # the send is no longer inside
    dilation = 0.4 / plan.prediction.iteration_time_s
    options = TrainOptions(steps=4, lr=3e-3, emulate=True, dilation=dilation, progress=False,
                           timeout_s=60)
    results = run_local(_emulated, plan.devices, (plan, options), timeout_s=120)[0]
    plain = run_plan(make_plan(TINY_LLAMA, [pipe([(1, (0, 3)), (1, (3, 4))], 1, 4)]), steps=4)
    assert [loss for loss, _, _ in results] == pytest.approx(plain, abs=2e-3)
    for _, measured_s, predicted_s in results[1:]:
        _assert_emulated_step(measured_s, predicted_s)


def test_an_explicit_tp_stage_is_padded_piece_by_piece_to_the_cost_models_total():
    """The executor's parts and all-reduces are timed apart; the stage's own ops keep the
    rest, so the pieces add up to the forward and backward the cost model charges (the
    send padded in, as torch's schedule blocks on it)."""
    from tp_workers import with_comm

    from potluck.planner.evaluate import stage_op_times, stage_send_s
    from potluck.plans import StageComm
    from potluck.runtime.timing.targets import rank_targets

    cluster = parse_cluster("nodes:\n  - {name: box, gpu: rtx3090, gpus_per_node: 4}\n")
    plan = make_plan(TINY_LLAMA, [pipe([(2, (0, 2)), (2, (2, 4))], 2, 2)], cluster=cluster,
                     device_ids=[f"box.0:{i}" for i in range(4)])
    plan = with_comm(plan, {(0, 0): StageComm(2), (0, 1): StageComm(2)})
    targets = rank_targets(plan, Layout.for_local_ranks(plan, 0))
    pieces, own = targets.explicit[0], targets.stages[0]
    work = stage_op_times(plan)[0][0]
    send = stage_send_s(plan, 0, 0, 1)
    assert pieces.chunks == 2 and len(pieces.blocks) == 2 and pieces.allreduce_s > 0
    assert own.forward_s + pieces.forward_s() == pytest.approx(work.forward_s + send)
    assert own.backward_s + pieces.backward_s() == pytest.approx(work.backward_s)
    assert pieces.forward_s() < 2 * (sum(p.attention.forward_s + p.mlp.forward_s
                                         for p in pieces.blocks) + 4 * pieces.allreduce_s)


def test_a_tiny_stand_in_of_a_model_read_through_its_config_keeps_its_kind():
    """Qwen3-MoE (read through the model itself): the stand-in is its config shrunk, same
    blocks, experts, top-k and per-head norms, built and counted the same way."""
    from potluck.model.loading import load_model
    from potluck.runtime.models.stand_in import tiny_stand_in

    model = load_model("qwen3-30b-a3b")
    plan = make_plan(model, [pipe([(1, (0, 24)), (1, (24, 48))], 1, 2)])
    tiny = tiny_stand_in(plan)
    assert (tiny.family, tiny.num_layers, tiny.num_experts, tiny.experts_per_token) == (
        "qwen3_moe", 48, 128, 8)
    assert tiny.hidden_size == 64 and tiny.vocab_size == 260 and tiny.params is not None
    assert tiny.hf_config["num_experts"] == 128 and not tiny.dropout
