"""Each schedule's op order: the same as torch.distributed.pipelining's, complete and well formed."""

from __future__ import annotations

import types
from collections import Counter

import pytest

from potluck.errors import ConfigError
from potluck.ops import OpKind
from potluck.schedules import SCHEDULES, Schedule, schedule_for
from potluck.sim import p2p
from potluck.sim.engine import Program

schedules = pytest.importorskip("torch.distributed.pipelining.schedules")

# one stage of one chunk runs the runtime's LocalSchedule instead (tested below)
CASES = [(p, v, m) for p in (1, 2, 3, 4, 6) for v in (1, 2, 3) for m in (1, 2, 4, 5, 6, 8, 12)
         if m % max(1, m // p) == 0 and p * v > 1]


def schedule_orders(name: str, p: int, m: int, v: int = 1) -> list[list]:
    return schedule_for(name).rank_orders(p, m, v)


def _torch_kind(action) -> OpKind:
    kinds = {
        schedules._ComputationType.FORWARD: OpKind.FORWARD,
        schedules._ComputationType.FULL_BACKWARD: OpKind.BACKWARD,
        schedules._ComputationType.BACKWARD_INPUT: OpKind.BACKWARD_INPUT,
        schedules._ComputationType.BACKWARD_WEIGHT: OpKind.BACKWARD_WEIGHT,
    }
    return kinds[action.computation_type]


def _torch_multi_stage(cls, p: int, v: int, m: int) -> list[list[tuple]]:
    """torch's per-rank order (without its None padding), from the schedule's own generator."""
    if not hasattr(cls, "_calculate_single_rank_operations"):
        pytest.skip("this torch has no _calculate_single_rank_operations to compare with")
    rounds = max(1, m // p)
    state = types.SimpleNamespace(n_local_stages=v, pp_group_size=p, _n_microbatches=m,
                                  number_of_rounds=rounds, microbatches_per_round=m // rounds)
    return [
        [(_torch_kind(a), a.stage_index // p, a.microbatch_index)
         for a in cls._calculate_single_rank_operations(state, rank) if a is not None]
        for rank in range(p)
    ]


def _torch_single_stage(cls, p: int, m: int) -> list[list[tuple]]:
    state = types.SimpleNamespace(_num_stages=p, _n_microbatches=m)
    order = cls._get_pipeline_order(state)
    return [[(_torch_kind(a), 0, a.microbatch_index) for a in order[rank]
             if a is not None and a.computation_type != schedules._ComputationType.REDUCE_GRAD]
            for rank in range(p)]


@pytest.mark.parametrize(("p", "v", "m"), CASES)
def test_interleaved_and_zero_bubble_orders_are_torchs(p: int, v: int, m: int) -> None:
    for name, cls in (("interleaved", schedules.ScheduleInterleaved1F1B),
                      ("zb", schedules.ScheduleInterleavedZeroBubble)):
        ours = [[tuple(a) for a in rank] for rank in schedule_orders(name, p, m, v)]
        assert ours == _torch_multi_stage(cls, p, v, m), name


@pytest.mark.parametrize(("p", "m"), [(2, 2), (2, 5), (4, 4), (4, 9), (3, 12)])
def test_gpipe_order_is_torchs(p: int, m: int) -> None:
    if not hasattr(schedules.ScheduleGPipe, "_get_pipeline_order"):
        pytest.skip("this torch has no _get_pipeline_order to compare with")
    ours = [[tuple(a) for a in rank] for rank in schedule_orders("gpipe", p, m)]
    assert ours == _torch_single_stage(schedules.ScheduleGPipe, p, m)


@pytest.mark.parametrize(("p", "m"), [(2, 2), (2, 5), (4, 4), (4, 9), (3, 12)])
def test_1f1b_order_is_the_one_torch_executes(p: int, m: int) -> None:
    """Schedule1F1B._step_microbatches: min(m, p - s) forwards, then backward and forward in
    turn (its _get_pipeline_order picture is off by one on the last stage, so not that); the
    simulator's transcription of its send/receive calls runs the same order."""
    orders = schedule_orders("1f1b", p, m)
    for s, order in enumerate(orders):
        warmup = min(m, p - s)
        assert [a.kind for a in order[:warmup]] == [OpKind.FORWARD] * warmup
        assert order[warmup].kind is OpKind.BACKWARD
        program = Program()
        pairs = {peer: program.add_stream() for peer in (s - 1, s + 1) if 0 <= peer < p}
        calls = p2p.StageCalls(program, program.add_stream(), pairs, host_blocking=False)
        schedule_for(Schedule.ONE_F_ONE_B).post_p2p(calls, s, p, m, 1.0, 2.0)
        executed = sorted(calls.compute.items(), key=lambda item: item[1])
        assert [(k, mb) for (k, mb), _ in executed] == [(a.kind, a.micro_batch) for a in order]


@pytest.mark.parametrize(("schedule", "v"), [("gpipe", 1), ("1f1b", 1), ("interleaved", 2),
                                             ("zb", 1), ("zb", 3)])
def test_every_chunk_and_micro_batch_runs_each_pass_exactly_once(schedule: str, v: int) -> None:
    p, m = 4, 8
    zero_bubble = schedule == "zb"
    passes = ((OpKind.FORWARD, OpKind.BACKWARD_INPUT, OpKind.BACKWARD_WEIGHT) if zero_bubble
              else (OpKind.FORWARD, OpKind.BACKWARD))
    for order in schedule_orders(schedule, p, m, v):
        assert Counter(order) == Counter(
            (kind, chunk, mb) for kind in passes for chunk in range(v) for mb in range(m))
        position = {action: i for i, action in enumerate(order)}
        for kind, chunk, mb in order:
            if kind is not OpKind.FORWARD:  # every backward comes after its forward
                assert position[(OpKind.FORWARD, chunk, mb)] < position[(kind, chunk, mb)]


def test_1f1b_with_fewer_micro_batches_than_stages_fills_and_drains() -> None:
    """torch's Schedule1F1B refuses it; potluck runs the order Megatron-LM's 1F1B runs then
    (every micro-batch in the warm-up where it fits, the backwards after) on torch's schedule
    runtime."""
    with pytest.raises(ValueError, match="must be greater than or equal to the number of stages"):
        schedules.Schedule1F1B(_FakeStage(4), 2)
    F, B = OpKind.FORWARD, OpKind.BACKWARD
    orders = schedule_orders("1f1b", 4, 2)
    assert orders[0] == [(F, 0, 0), (F, 0, 1), (B, 0, 0), (B, 0, 1)]  # first: both in flight
    assert orders[3] == [(F, 0, 0), (B, 0, 0), (F, 0, 1), (B, 0, 1)]  # last: one at a time


class _FakeStage:
    """What torch's single-stage schedules read of a stage before they check the count."""

    def __init__(self, num_stages: int) -> None:
        self.num_stages = num_stages
        self.group_size = num_stages
        self.stage_index = 0
        self.is_first, self.is_last = True, False


@pytest.mark.parametrize("schedule", [s.value for s in SCHEDULES])
def test_one_stage_runs_forward_then_backward_per_micro_batch(schedule: str) -> None:
    assert [tuple(a)[:3:2] for a in schedule_orders(schedule, 1, 3)[0]] == [
        (OpKind.FORWARD, 0), (OpKind.BACKWARD, 0), (OpKind.FORWARD, 1), (OpKind.BACKWARD, 1),
        (OpKind.FORWARD, 2), (OpKind.BACKWARD, 2)]


def test_orders_refuse_what_torch_refuses() -> None:
    with pytest.raises(ConfigError, match="multiple of"):
        schedule_orders("interleaved", 4, 9, 2)
    with pytest.raises(ConfigError, match="virtual stages"):
        schedule_orders("1f1b", 4, 8, 2)
