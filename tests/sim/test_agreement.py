"""Simulator against the analytic cost model where the model's formula is exact.

Identical stages and transfers that take no time leave nothing for the two to
disagree about: the iteration times must agree within 2% (they agree to
rounding), and so must each device's peak memory under GPipe and 1F1B. The
simulator is the reference where they could differ; the cost model follows it for
torch's 1F1B (which waits for a transfer per micro-batch on a real link) and for
zero bubble (ZB-H1's bubble (p - 1)(f + b - 2w)/v).
"""

from __future__ import annotations

import pytest
from simkit import SLOW_NETWORK, cluster, flat_model, make_plan

from potluck.planner.evaluate import predict
from potluck.plans import Schedule
from potluck.sim import simulate

LAYOUTS = [(4, 8, 1, 1), (4, 16, 2, 2), (8, 8, 1, 2), (2, 4, 4, 2)]  # pp, m, tp, dp


@pytest.mark.parametrize(("schedule", "v"), [(Schedule.GPIPE, 1), (Schedule.ONE_F_ONE_B, 1),
                                             (Schedule.INTERLEAVED, 2)])
@pytest.mark.parametrize(("pp", "m", "tp", "dp"), LAYOUTS)
def test_iteration_time_agrees_with_the_cost_model_within_2_percent(
        schedule: Schedule, v: int, pp: int, m: int, tp: int, dp: int) -> None:
    plan = make_plan(cluster(), flat_model(16), pp=pp, micro_batches=m, tp=tp, dp=dp,
                     schedule=schedule, virtual_stages=v)
    result = simulate(plan)
    assert result.iteration_time_s == pytest.approx(result.predicted_time_s, rel=0.02)


@pytest.mark.parametrize("schedule", [Schedule.GPIPE, Schedule.ONE_F_ONE_B])
def test_peak_memory_agrees_with_the_cost_model(schedule: Schedule) -> None:
    from potluck.planner.cost import CostModel

    plan = make_plan(cluster(), flat_model(16), pp=4, micro_batches=8, tp=2, dp=2,
                     schedule=schedule)
    cost = CostModel.for_plan(plan)
    predicted = {m.device: m.total_bytes for m in predict(plan, cost).memory}
    for device in simulate(plan).devices:
        assert device.peak_memory_bytes == pytest.approx(predicted[device.device], rel=0.01)


def test_zero_bubble_agrees_with_the_cost_model() -> None:
    plan = make_plan(cluster(), flat_model(16), pp=8, micro_batches=8, dp=2,
                     schedule=Schedule.ZERO_BUBBLE, virtual_stages=2)
    result = simulate(plan)
    assert result.iteration_time_s == pytest.approx(result.predicted_time_s, rel=0.02)


@pytest.mark.parametrize("pp", [2, 4])
def test_1f1b_over_a_slow_network_agrees_with_the_cost_model(pp: int) -> None:
    plan = make_plan(cluster(SLOW_NETWORK), flat_model(16), pp=pp, micro_batches=8,
                     devices=[f"box.{i}:0" for i in range(pp)])
    result = simulate(plan)
    assert result.iteration_time_s == pytest.approx(result.predicted_time_s, rel=0.03)


def test_rerank_orders_candidates_by_simulated_time() -> None:
    from potluck.sim import rerank

    spec, model = cluster(SLOW_NETWORK), flat_model(8)
    across = make_plan(spec, model, pp=2, micro_batches=16, devices=["box.0:0", "box.1:0"])
    inside = make_plan(spec, model, pp=4, micro_batches=16,
                       devices=["box.0:0", "box.0:1", "box.0:2", "box.0:3"])
    alone = make_plan(spec, model, pp=1, micro_batches=16, devices=["box.0:0"])
    ranked = rerank([across, alone, inside])
    assert [r.plan for r in ranked] == [inside, across, alone]
    times = [r.iteration_time_s for r in ranked]
    assert times == sorted(times)


def test_zero1_gradient_scatter_and_parameter_gather_agree_with_the_cost_model() -> None:
    """ZeRO-1 over a slow network: the gradients are reduce-scattered and the updates
    all-gathered after the step, in the simulation as in the prediction (one replica per
    machine: nothing else shares the cards, so the two agree to rounding)."""
    from dataclasses import replace

    devices = ["box.0:0", "box.1:0", "box.2:0", "box.3:0"]
    plan = make_plan(cluster(SLOW_NETWORK), flat_model(16), pp=1, micro_batches=8, dp=4,
                     devices=devices)
    sharded = simulate(replace(plan, zero=1))
    assert sharded.iteration_time_s == pytest.approx(sharded.predicted_time_s, rel=0.005)
    gather_s = sharded.optimizer_steps[0].end_s - sharded.optimizer_steps[0].start_s
    plain = simulate(plan)
    assert gather_s > 10 * (plain.optimizer_steps[0].end_s - plain.optimizer_steps[0].start_s)


@pytest.mark.parametrize("tied_sync", ["holders", "pipeline-ends"])
@pytest.mark.parametrize("overlap", [True, False])
def test_tied_embedding_phases_agree_with_the_cost_model(tied_sync: str, overlap: bool) -> None:
    """Two pipelines whose ends sit on two machines: the stages' gradient rings inside each
    machine, the tied embedding's sum across them, in the phases the cost model prices
    (with the stages' rings, over all holders; or after them, per pipeline)."""
    from dataclasses import replace

    from potluck.plans import Execution, TiedGradSync

    model = replace(flat_model(8), vocab_size=32000, tied_embeddings=True)
    plan = make_plan(cluster(SLOW_NETWORK), model, pp=2, micro_batches=4, dp=2,
                     devices=["box.0:0", "box.1:0", "box.0:1", "box.1:1"])
    execution = Execution(overlap_grad_reduce=overlap, tied_grad_sync=TiedGradSync(tied_sync))
    plan = replace(plan, training=replace(plan.training, execution=execution))
    result = simulate(plan)
    assert len(result.gradient_syncs) == (3 if tied_sync == "holders" else 4)
    assert result.iteration_time_s == pytest.approx(result.predicted_time_s, rel=0.03)
