"""Simulated schedules against their closed forms, and the order of every event.

Closed forms (Narayanan et al. SC'21; Qi et al. 2024), for p identical stages,
m micro-batches, forward f, backward b (of which w is weight gradient) and
transfers that take no time:

- GPipe and 1F1B: T = (m + p - 1)(f + b), bubble fraction (p - 1)/(m + p - 1);
- interleaved 1F1B with v chunks per device: the bubble (p - 1)(f + b) divided by v;
- zero bubble (ZB-H1, torch's interleaved zero bubble): bubble (p - 1)(f + b - 2w)/v.
"""

from __future__ import annotations

import pytest
from simkit import SLOW_NETWORK, cluster, flat_model, make_plan, synthetic_pipeline

from potluck.plans import Schedule
from potluck.schedules import schedule_for
from potluck.sim import simulate
from potluck.sim.simulator import run_pipelines
from potluck.sim.stats import bubble_fraction, pipeline_end_s

F, B, W = 1.0, 2.0, 0.5


def _run(schedule: str, p: int, m: int, v: int = 1, weight_grad_s: float = 0.0):
    work, network = synthetic_pipeline(p, m, v, F, B, weight_grad_s)
    runs, _ = run_pipelines([work], schedule_for(schedule), v, network)
    return work, runs


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("p", "m"), [(2, 2), (4, 4), (4, 8), (4, 13), (8, 32)])
def test_gpipe_and_1f1b_take_m_plus_p_minus_1_stage_times(schedule: str, p: int, m: int) -> None:
    work, runs = _run(schedule, p, m)
    assert pipeline_end_s(runs[0]) == pytest.approx((m + p - 1) * (F + B))
    assert bubble_fraction([work], runs) == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 12), (8, 16)])
def test_interleaving_divides_the_bubble_by_v(p: int, m: int, v: int) -> None:
    _, runs = _run("interleaved", p, m, v)
    bubble_s = pipeline_end_s(runs[0]) - m * (F + B)
    assert bubble_s == pytest.approx((p - 1) * (F + B) / v)


@pytest.mark.parametrize("v", [1, 2])
@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (8, 16)])
def test_zero_bubble_fills_the_bubble_with_weight_gradients(p: int, m: int, v: int) -> None:
    _, runs = _run("zb", p, m, v, weight_grad_s=W)
    bubble_s = pipeline_end_s(runs[0]) - m * (F + B)
    assert bubble_s == pytest.approx((p - 1) * (F + B - 2 * W) / v)
    _, one_f_one_b = _run("1f1b", p, m)
    assert pipeline_end_s(runs[0]) < pipeline_end_s(one_f_one_b[0])


def _by_key(run, p: int) -> dict:
    return {(op.kind, op.chunk * p + op.stage, op.micro_batch): op
            for op in run.ops if op.peer == -1}


def _transfers(run, p: int) -> dict:
    """(kind, receiving virtual stage, micro-batch) -> transfer."""
    found = {}
    for op in run.ops:
        if op.kind == "send_forward":
            found[("forward", op.chunk * p + op.stage + 1, op.micro_batch)] = op
        elif op.kind == "send_backward":
            found[("backward", op.chunk * p + op.stage - 1, op.micro_batch)] = op
    return found


def _check_dependencies(result) -> None:
    p, v = result.plan.pipelines[0].pp, result.plan.virtual_stages
    last, eps = p * v - 1, 1e-12
    for run in result.pipelines:
        ops, moved = _by_key(run, p), _transfers(run, p)
        for (kind, virtual, mb), op in ops.items():
            if kind == "forward" and virtual > 0:
                source, transfer = ops[(kind, virtual - 1, mb)], moved.get((kind, virtual, mb))
            elif kind in ("backward", "backward_input") and virtual < last:
                source = ops[(kind, virtual + 1, mb)]
                transfer = moved.get(("backward", virtual, mb))
            elif kind == "backward_weight":
                source, transfer = ops[("backward_input", virtual, mb)], None
            else:
                source, transfer = ops.get(("forward", virtual, mb)), None
            if source is not None and source is not op:
                assert op.start_s >= source.end_s - eps, (kind, virtual, mb)
            if transfer is not None:
                assert transfer.start_s >= source.end_s - eps
                assert op.start_s >= transfer.end_s - eps
        for stage in range(p):  # one op at a time on a stage's compute stream
            spans = sorted((op.start_s, op.end_s) for op in run.ops
                           if op.peer == -1 and op.stage == stage)
            assert all(a[1] <= b[0] + eps for a, b in zip(spans, spans[1:], strict=False))
    _check_gradients_then_optimizer(result)


def _check_gradients_then_optimizer(result) -> None:
    last_backward = {}
    for run in result.pipelines:
        for op in run.ops:
            if op.peer == -1:
                key = (run.index, op.stage)
                last_backward[key] = max(last_backward.get(key, 0.0), op.end_s)
    for sync in result.gradient_syncs:
        assert sync.end_s >= max(last_backward[m] for m in sync.members)
    for step in result.optimizer_steps:
        assert step.start_s >= last_backward[(step.pipeline, step.stage)]
        for sync in result.gradient_syncs:
            if (step.pipeline, step.stage) in sync.members:
                assert step.start_s >= sync.end_s
    assert result.iteration_time_s == max(s.end_s for s in result.optimizer_steps)


@pytest.mark.parametrize(("schedule", "v"), [(Schedule.GPIPE, 1), (Schedule.ONE_F_ONE_B, 1),
                                             (Schedule.INTERLEAVED, 2), (Schedule.ZERO_BUBBLE, 2)])
def test_every_event_waits_for_what_it_consumes(schedule: Schedule, v: int) -> None:
    """On slow links, with tensor parallelism and two replicas, nothing runs early."""
    plan = make_plan(cluster(SLOW_NETWORK), flat_model(8), pp=4, micro_batches=8, tp=2, dp=2,
                     schedule=schedule, virtual_stages=v)
    result = simulate(plan)
    _check_dependencies(result)
    assert len(result.gradient_syncs) == 4  # one per stage, across the two replicas


def test_1f1b_on_a_slow_link_pays_the_round_trip_every_micro_batch() -> None:
    """torch's 1F1B waits for its forward send before each backward and receives the next
    forward only after its own backward, so every micro-batch pays a transfer (activations
    and gradients cross at once, one each way), not just while the pipeline fills."""
    plan = make_plan(cluster(SLOW_NETWORK), flat_model(4), pp=2, micro_batches=16,
                     devices=["box.0:0", "box.1:0"])
    result = simulate(plan)
    run = result.pipelines[0]
    send_s = next(op.end_s - op.start_s for op in run.ops if op.kind == "send_forward")
    stage_s = sum(op.end_s - op.start_s for op in run.ops
                  if op.stage == 1 and op.micro_batch == 0 and op.peer == -1)
    steady = [op.start_s for op in run.ops if op.stage == 1 and op.kind == "forward"][4:12]
    period_s = (steady[-1] - steady[0]) / (len(steady) - 1)
    assert send_s > 0.3 * stage_s  # a slow link
    assert period_s == pytest.approx(stage_s + send_s, rel=1e-6)


def test_the_critical_path_covers_the_pipeline_and_names_what_it_waits_for() -> None:
    """Compute-bound: the path is all compute, its length the pipeline's time. On a slow
    link under 1F1B, the transfers take their share of every micro-batch's period."""
    fast = simulate(make_plan(cluster(), flat_model(8), pp=4, micro_batches=8))
    assert sum(s.seconds for s in fast.critical_path) == pytest.approx(fast.pipeline_time_s)
    assert sum(s.fraction for s in fast.critical_path if s.kind == "compute") > 0.9999
    slow = simulate(make_plan(cluster(SLOW_NETWORK), flat_model(4), pp=2, micro_batches=16,
                              devices=["box.0:0", "box.1:0"]))
    assert sum(s.seconds for s in slow.critical_path) == pytest.approx(slow.pipeline_time_s)
    run = slow.pipelines[0]
    send_s = next(op.end_s - op.start_s for op in run.ops if op.kind == "send_forward")
    moved = sum(s.seconds for s in slow.critical_path if s.kind == "transfer")
    assert moved == pytest.approx(17 * send_s, rel=0.02)  # one per micro-batch, one to fill
