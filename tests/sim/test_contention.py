"""Transfers that cross the same link share it max-min fairly."""

from __future__ import annotations

import pytest
from simkit import SLOW_NETWORK, cluster, flat_model, make_plan

from potluck.sim import engine, simulate
from potluck.sim.network import Flow, max_min_rates

NIC = ("nic_tx", "a")
GB = 1e9


def _flow(lane_bytes: float = GB, cap: float = 10 * GB, *resources) -> Flow:
    return Flow(lane_bytes, 0.0, cap, tuple((r, 1) for r in resources or (NIC,)))


def test_flows_on_one_link_split_it_evenly() -> None:
    rates = max_min_rates({1: _flow(), 2: _flow(), 3: _flow()}, {NIC: 3 * GB})
    assert rates == pytest.approx({1: GB, 2: GB, 3: GB})


def test_a_flow_held_back_elsewhere_leaves_its_share_to_the_others() -> None:
    """Max-min, not an even split: the flow capped at 0.5 GB/s by its own link gets that,
    the other takes the rest of the 3 GB/s card."""
    rates = max_min_rates({1: _flow(cap=0.5 * GB), 2: _flow()}, {NIC: 3 * GB})
    assert rates == pytest.approx({1: 0.5 * GB, 2: 2.5 * GB})


def test_lanes_of_one_flow_count_once_each() -> None:
    eight_lanes = Flow(GB, 0.0, 10 * GB, ((NIC, 8),))
    assert max_min_rates({1: eight_lanes}, {NIC: 8 * GB}) == pytest.approx({1: GB})


def _transfer_times(release_s: list[float], capacity: float = GB) -> list[float]:
    program = engine.Program()
    for release in release_s:
        program.add_transfer(_flow(), [], release_s=release)
    return engine.run(program, {NIC: capacity}).end_s


def test_two_transfers_at_once_take_twice_as_long() -> None:
    assert _transfer_times([0.0]) == pytest.approx([1.0])
    assert _transfer_times([0.0, 0.0]) == pytest.approx([2.0, 2.0])


def test_a_transfer_joining_halfway_slows_the_first_from_then_on() -> None:
    """A moves alone for 0.5 s (half its bytes), then both share: A ends at 0.5 + 1.0,
    B has moved half by then and finishes alone 0.5 s later."""
    assert _transfer_times([0.0, 0.5]) == pytest.approx([1.5, 2.0])


def test_pipelines_sharing_a_network_card_slow_each_other() -> None:
    """Two replicas whose stage boundaries cross the same two machines share their cards;
    on separate machines they are twins and the simulator runs one of them."""
    spec, model = cluster(SLOW_NETWORK), flat_model(4)
    shared = make_plan(spec, model, pp=2, micro_batches=8, dp=2,
                       devices=["box.0:0", "box.1:0", "box.0:1", "box.1:1"])
    apart = make_plan(spec, model, pp=2, micro_batches=8, dp=2,
                      devices=["box.0:0", "box.1:0", "box.2:0", "box.3:0"])
    together, alone = simulate(shared), simulate(apart)
    assert together.simulated_pipelines == 2
    assert alone.simulated_pipelines == 1
    assert together.pipeline_time_s > 1.2 * alone.pipeline_time_s
    send = [op.end_s - op.start_s for op in together.pipelines[0].ops if op.kind == "send_forward"]
    lone = [op.end_s - op.start_s for op in alone.pipelines[0].ops if op.kind == "send_forward"]
    assert max(send) == pytest.approx(2 * lone[0], rel=0.01)
