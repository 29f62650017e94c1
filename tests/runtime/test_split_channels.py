"""Split P2P channels: activations and gradients on two process groups, one transfer per batch.

With ``plan.comm.split_p2p_channels`` every layout still trains exactly like
one process; the gradients going back travel on a process group of their own
(same ranks as the lane, another group); the single-stage schedules (1F1B,
GPipe) run potluck's own compute order on torch's schedule runtime, each send
and receive a batch of its own; a plan without the split still runs torch's
``Schedule1F1B`` as before.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, replace
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from runtime_helpers import LR, TINY_LLAMA, make_plan, pipe, reference_losses, run_plan
from test_equivalence import INTERLEAVED_STAGES, TOLERANCE
from test_rank_order_training import wrap_around

from potluck.ops import OpKind
from potluck.plans import CommSchedule, Plan, Schedule
from potluck.runtime.launch.checks import check_execution
from potluck.runtime.launch.local import run_local
from potluck.runtime.launch.torchrun import torchrun_rank_order
from potluck.runtime.options import TrainOptions
from potluck.runtime.timing.recorder import TRACE_FILE
from potluck.runtime.training import train_rank
from potluck.schedules import schedule_for
from potluck.schedules.lowering import runtime_schedule
from potluck.traces import read_trace

SPLIT = CommSchedule(split_p2p_channels=True)
HALVES = [(1, (0, 2)), (1, (2, 4))]
QUARTERS = [(1, (0, 1)), (1, (1, 2)), (1, (2, 3)), (1, (3, 4))]

CASES = {
    "1f1b, pp=2": ([pipe(HALVES, 1, 4)], {}),
    "1f1b, pp=4": ([pipe(QUARTERS, 1, 4)], {}),
    "gpipe, pp=2": ([pipe(HALVES, 1, 3)], {"schedule": Schedule.GPIPE}),
    "gpipe, pp=4": ([pipe(QUARTERS, 1, 3)], {"schedule": Schedule.GPIPE}),
    "interleaved, pp=2 x virtual 2": ([pipe(INTERLEAVED_STAGES, 1, 4)],
                                      {"schedule": Schedule.INTERLEAVED}),
    "zero bubble, pp=2 x virtual 2": ([pipe(INTERLEAVED_STAGES, 1, 4)],
                                      {"schedule": Schedule.ZERO_BUBBLE}),
    "dp=2 x pp=2, uneven": ([pipe(HALVES, 1, 2), pipe([(1, (0, 3)), (1, (3, 4))], 2, 2)], {}),
    "tp=2 x pp=2": ([pipe([(2, (0, 2)), (2, (2, 4))], 1, 4)], {}),
    "stages with tp 1 then 2 (leaders and a follower)": ([pipe([(1, (0, 1)), (2, (1, 4))], 1, 4)],
                                                         {}),
}


def split(plan: Plan) -> Plan:
    return replace(plan, comm=SPLIT)


@pytest.mark.parametrize("case", list(CASES))
def test_split_channels_train_like_one_process(case):
    pipelines, options = CASES[case]
    plan = split(make_plan(TINY_LLAMA, pipelines, **options))
    expected = reference_losses(TINY_LLAMA, plan.training.global_batch)
    assert run_plan(plan, timeout_s=45) == pytest.approx(expected, abs=TOLERANCE)


def test_split_channels_under_torchrun_rank_order():
    """A lane numbered out of stage order (ranks 0, 2, 3, 1): each stage still exchanges
    activations and gradients with its neighbour stages' ranks."""
    plan = split(wrap_around())
    expected = reference_losses(TINY_LLAMA, plan.training.global_batch)
    got = run_plan(plan, rank_order=torchrun_rank_order(plan), timeout_s=45)
    assert got == pytest.approx(expected, abs=TOLERANCE)


def test_a_traced_run_times_the_receives_of_both_channels(tmp_path):
    """The stages still tag every transfer, forward and backward, so a trace shows each
    receive's wait before the compute that needs it."""
    plan = split(make_plan(TINY_LLAMA, [pipe(HALVES, 1, 3)]))
    options = TrainOptions(steps=2, lr=LR, progress=False, timeout_s=45, out_dir=str(tmp_path),
                           trace_steps=1)
    run_local(train_rank, plan.devices, (plan, options), timeout_s=90)
    events = read_trace(tmp_path / TRACE_FILE).events
    waits = {(e.kind, e.stage, e.micro_batch) for e in events if e.kind.startswith("recv")}
    assert waits == {("recv_forward", 1, mb) for mb in range(3)} | {
        ("recv_backward", 0, mb) for mb in range(3)}


def test_the_runtime_runs_split_channels():
    check_execution(split(make_plan(TINY_LLAMA, [pipe(HALVES, 1, 4)])))


# --- the lowered single-stage schedule, without ranks --------------------------------------


def _fake_stage(stages: int) -> SimpleNamespace:
    """What torch's schedule runtime reads from a stage when it builds its program."""
    return SimpleNamespace(stage_index=0, num_stages=stages, group_size=stages, group_rank=0)


@pytest.mark.parametrize("name, stages, micro_batches",
                         [("1f1b", 4, 6), ("1f1b", 2, 2), ("gpipe", 3, 4)])
def test_the_lowered_program_computes_in_potluck_order(name, stages, micro_batches):
    orders = schedule_for(name).rank_orders(stages, micro_batches)
    runner = runtime_schedule(orders, [_fake_stage(stages)], micro_batches, loss_fn=None)
    kinds = {"F": OpKind.FORWARD, "B": OpKind.BACKWARD}
    for position, order in enumerate(orders):
        program = runner.pipeline_order_with_comms[position]
        compute = [(kinds[a.computation_type.value], a.stage_index, a.microbatch_index)
                   for a in program if a.is_compute_op]
        assert compute == [(kind, position, mb) for kind, _, mb in order]


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
def test_the_lowered_program_sends_at_once_and_receives_before_the_compute(name):
    """Each send is its own action right after the compute that made its data; each receive
    is its own action somewhere before the compute that needs it."""
    stages, micro_batches = 3, 4
    orders = schedule_for(name).rank_orders(stages, micro_batches)
    runner = runtime_schedule(orders, [_fake_stage(stages)], micro_batches, loss_fn=None)
    for position in range(stages):
        program = [str(a) for a in runner.pipeline_order_with_comms[position]]
        for mb in range(micro_batches):
            forward, backward = f"{position}F{mb}", f"{position}B{mb}"
            if position < stages - 1:
                assert program[program.index(forward) + 1] == f"{position}SEND_F{mb}"
                assert program.index(f"{position}RECV_B{mb}") < program.index(backward)
            if position > 0:
                assert program[program.index(backward) + 1] == f"{position}SEND_B{mb}"
                assert program.index(f"{position}RECV_F{mb}") < program.index(forward)


def _torch_lowered(orders: list, stages: int, micro_batches: int) -> dict[int, list[str]]:
    """torch's own lowering of the same compute program (no receive moved)."""
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    from potluck.schedules.lowering import compute_actions

    runner = _PipelineScheduleRuntime([_fake_stage(stages)], micro_batches, scale_grads=False)
    runner._prepare_schedule_with_comms(compute_actions(orders), format="compute_only")
    return {k: [str(a) for a in v] for k, v in runner.pipeline_order_with_comms.items()}


def _computes_before(program: list[str], action: str) -> int:
    return sum(1 for a in program[:program.index(action)] if re.fullmatch(r"\d+[FB]\d+", a))


@pytest.mark.parametrize("name, stages, micro_batches", [("1f1b", 4, 6), ("gpipe", 3, 4)])
def test_receives_are_posted_a_compute_ahead_and_each_channel_keeps_its_order(
        name, stages, micro_batches):
    """A receive moves before the compute ahead of it (its transfer overlaps that compute),
    never past its own channel's actions: each direction's sends and receives stay in the
    order torch lowered them (NCCL runs one group's operations in order)."""
    orders = schedule_for(name).rank_orders(stages, micro_batches)
    runner = runtime_schedule(orders, [_fake_stage(stages)], micro_batches, loss_fn=None)
    torch_programs = _torch_lowered(orders, stages, micro_batches)
    moved = 0
    for position in range(stages):
        ours = [str(a) for a in runner.pipeline_order_with_comms[position]]
        theirs = torch_programs[position]
        assert sorted(ours) == sorted(theirs)
        for direction in ("_F", "_B"):
            channel = [a for a in ours if "SEND" + direction in a or "RECV" + direction in a]
            assert channel == [a for a in theirs if "SEND" + direction in a
                               or "RECV" + direction in a]
        for action in (a for a in ours if "RECV" in a):
            assert _computes_before(ours, action) <= _computes_before(theirs, action)
            moved += _computes_before(ours, action) < _computes_before(theirs, action)
    assert moved > 0


# --- what ranks post, observed ---------------------------------------------------------------

STEPS = 1


@dataclass(frozen=True)
class Observed:
    """One rank's first step: the schedule class, its compute ops in order, and every batch
    of transfers it posted as ``(direction, group name, group ranks)`` per op."""

    runner: str
    computed: list[tuple[OpKind, int, int]]
    batches: list[list[tuple[str, str, tuple[int, ...]]]]


def _direction(op: dist.P2POp, rank: int) -> str:
    """Forward traffic goes to a later stage (rank, in these plans) or comes from an earlier."""
    sending = op.op is dist.isend
    return "forward" if sending == (op.peer > rank) else "backward"


def _observing_rank(plan: Plan, options: TrainOptions) -> Observed:
    """Run ``plan`` on this rank, noting what its schedule does (patches this process only)."""
    from torch.distributed.pipelining import PipelineStage, schedules

    from potluck.runtime import parallel_model

    runners, computed, batches = [], [], []
    forward, backward = PipelineStage.forward_one_chunk, PipelineStage.backward_one_chunk
    batch_p2p, build = schedules._batch_p2p, parallel_model.build_schedule

    def noting_forward(stage, chunk, *args, **kwargs):
        computed.append((OpKind.FORWARD, stage.stage_index, chunk))
        return forward(stage, chunk, *args, **kwargs)

    def noting_backward(stage, chunk, *args, **kwargs):
        computed.append((OpKind.BACKWARD, stage.stage_index, chunk))
        return backward(stage, chunk, *args, **kwargs)

    def noting_batch(ops, desc=None):
        me = dist.get_rank()
        batches.append([(_direction(op, me), op.group.group_name,
                         tuple(dist.get_process_group_ranks(op.group))) for op in ops])
        return batch_p2p(ops, desc=desc)

    def noting_build(*args, **kwargs):
        runner = build(*args, **kwargs)
        runners.append(type(runner).__name__)
        return runner

    PipelineStage.forward_one_chunk, PipelineStage.backward_one_chunk = (noting_forward,
                                                                         noting_backward)
    schedules._batch_p2p, parallel_model.build_schedule = noting_batch, noting_build
    train_rank(plan, options)
    return Observed(runners[-1], computed, batches)


def observe(plan: Plan) -> list[Observed]:
    options = TrainOptions(steps=STEPS, lr=LR, progress=False, timeout_s=45)
    return run_local(_observing_rank, plan.devices, (plan, options), timeout_s=90)


@pytest.fixture(scope="module")
def split_1f1b() -> tuple[Plan, list[Observed]]:
    plan = split(make_plan(TINY_LLAMA, [pipe(QUARTERS, 1, 6)]))
    return plan, observe(plan)


def test_gradients_travel_on_a_process_group_of_their_own(split_1f1b):
    plan, observed = split_1f1b
    lane = tuple(range(plan.pipelines[0].pp))
    for rank in observed:
        groups = defaultdict(set)
        for batch in rank.batches:
            for direction, name, ranks in batch:
                assert ranks == lane
                groups[direction].add(name)
        assert len(groups["forward"]) == len(groups["backward"]) == 1
        assert groups["forward"] != groups["backward"]


def test_each_send_and_receive_is_a_batch_of_its_own(split_1f1b):
    _, observed = split_1f1b
    assert all(len(batch) == 1 for rank in observed for batch in rank.batches)
    assert all(rank.runner == "_PipelineScheduleRuntime" for rank in observed)


def test_the_split_single_stage_schedule_runs_potluck_compute_order(split_1f1b):
    plan, observed = split_1f1b
    pipeline = plan.pipelines[0]
    orders = schedule_for(plan.schedule).rank_orders(pipeline.pp, pipeline.num_micro_batches)
    for position, (rank, order) in enumerate(zip(observed, orders, strict=True)):
        assert rank.computed == [(kind, position, mb) for kind, _, mb in order]


def test_a_plan_without_the_split_runs_torch_schedule1f1b_on_one_group():
    observed = observe(make_plan(TINY_LLAMA, [pipe(HALVES, 1, 4)]))
    assert [rank.runner for rank in observed] == ["Schedule1F1B", "Schedule1F1B"]
    for rank in observed:
        names = {name for batch in rank.batches for _, name, _ in batch}
        assert len(names) == 1
    fused = [batch for rank in observed for batch in rank.batches if len(batch) == 2]
    assert fused  # torch's 1F1B batches a forward send with a backward receive
