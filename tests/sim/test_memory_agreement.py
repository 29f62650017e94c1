"""Simulator against the cost model for issue 13's techniques: swapping, ZeRO-2/3 and
optimizer offload. The simulator draws the swaps and ZeRO-3 gathers of every pass,
reduce-scatters after every backward and steps offloaded optimizers on the host; its
iteration time and per-device peak memory agree with the cost model's."""

from __future__ import annotations

from dataclasses import replace

import pytest
from simkit import INSTANT_LINKS, cluster, flat_model, make_plan

from potluck.planner.evaluate import predict
from potluck.plans import Plan
from potluck.plans.memory import Offload, StageMemory, Swap
from potluck.sim import simulate
from potluck.sim.result import StateTransferKind


def _with_memory(plan: Plan, memory: StageMemory, zero: int = 0) -> Plan:
    pipelines = tuple(replace(p, stages=tuple(replace(s, memory=memory) for s in p.stages))
                      for p in plan.pipelines)
    return replace(plan, pipelines=pipelines, zero=zero)


CASES = {
    "host swap": (StageMemory(swap=Swap.HOST), 0),
    "half swapped": (StageMemory(swap=Swap.HOST, swap_fraction=0.5), 0),
    "zero 2": (StageMemory(), 2),
    "zero 3": (StageMemory(), 3),
    "offload": (StageMemory(offload=Offload.OPTIMIZER), 1),
}


@pytest.mark.parametrize("case", CASES)
def test_iteration_time_and_peak_memory_agree_with_the_cost_model(case: str) -> None:
    memory, zero = CASES[case]
    plan = _with_memory(make_plan(cluster(), flat_model(16), pp=4, micro_batches=8, dp=2),
                        memory, zero)
    result = simulate(plan)
    assert result.iteration_time_s == pytest.approx(result.predicted_time_s, rel=0.03)
    predicted = {m.device: m.total_bytes for m in predict(plan).memory}
    for device in result.devices:
        assert device.peak_memory_bytes == pytest.approx(predicted[device.device], rel=0.01)


def test_every_swapped_pass_is_drawn_out_and_back_on_its_lane() -> None:
    plan = _with_memory(make_plan(cluster(), flat_model(16), pp=4, micro_batches=8),
                        StageMemory(swap=Swap.HOST))
    transfers = simulate(plan).state_transfers
    for stage, devices in enumerate(s.devices for s in plan.pipelines[0].stages):
        mine = [t for t in transfers if t.stage == stage]
        outs = [t for t in mine if t.kind is StateTransferKind.SWAP_OUT]
        ins = [t for t in mine if t.kind is StateTransferKind.SWAP_IN]
        assert len(outs) == len(ins) == 8
        assert {t.lane for t in mine} == {f"{devices[0]}->host"}


def test_zero3_gathers_in_every_forward_and_backward() -> None:
    plan = _with_memory(make_plan(cluster(), flat_model(16), pp=2, micro_batches=4, dp=2),
                        StageMemory(), zero=3)
    gathers = [t for t in simulate(plan).state_transfers
               if t.kind is StateTransferKind.PARAM_ALLGATHER]
    assert len(gathers) == 2 * 2 * 2 * 4  # pipelines x stages x passes x micro-batches


SLOW_HOST = INSTANT_LINKS.replace("inter_bandwidth: 1000000GB/s",
                                  "inter_bandwidth: 1000000GB/s\n    host_bandwidth: 2GB/s\n"
                                  "    host_memory_bandwidth: 10GB/s")


@pytest.mark.parametrize("case", ["host swap", "offload"])
def test_exposed_swaps_and_host_steps_agree_with_the_cost_model(case: str) -> None:
    memory, zero = CASES[case]
    plan = _with_memory(make_plan(cluster(SLOW_HOST), flat_model(16), pp=4, micro_batches=8,
                                  dp=2), memory, zero)
    fast = _with_memory(make_plan(cluster(), flat_model(16), pp=4, micro_batches=8, dp=2),
                        memory, zero)
    result = simulate(plan)
    assert result.predicted_time_s > 1.1 * predict(fast).iteration_time_s  # the host shows
    assert result.iteration_time_s == pytest.approx(result.predicted_time_s, rel=0.03)
