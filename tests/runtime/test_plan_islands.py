"""Islands in a plan: the rules a split must keep, its file form, and when fragments go."""

from dataclasses import replace

import pytest
from runtime_helpers import TINY_LLAMA, make_plan, pipe

from potluck.errors import ConfigError
from potluck.plans import (
    Compression,
    Island,
    Islands,
    SyncMethod,
    check_plan,
    plan_from_dict,
    plan_to_dict,
)

ONE_STAGE = [(1, (0, 4))]


def _four_replicas():
    return make_plan(TINY_LLAMA, [pipe(ONE_STAGE, 1, 2)] * 4)


def _split(plan, *members, **kwargs):
    kwargs.setdefault("sync", SyncMethod.DILOCO)
    kwargs.setdefault("inner_steps", 4)
    islands = Islands(islands=tuple(Island(pipelines=m) for m in members), **kwargs)
    return replace(plan, islands=islands)


def test_a_split_plan_round_trips_and_says_its_islands():
    plan = _split(_four_replicas(), (0, 1), (2, 3), compression=Compression.INT8, fragments=2)
    check_plan(plan)
    assert plan_from_dict(plan_to_dict(plan)) == plan
    assert "islands=2 diloco H=4" in plan.layout()
    assert plan.island_pipelines(3) == (2, 3)
    assert plan.island_pipelines(0) == (0, 1)


def test_a_plan_without_islands_exchanges_with_every_pipeline():
    plan = _four_replicas()
    assert plan.island_pipelines(2) == (0, 1, 2, 3)
    assert not plan.islands.split and plan.islands.count == 1


@pytest.mark.parametrize("members, kwargs, fragment", [
    (((0, 1), (2,)), {}, "exactly once"),
    (((0, 1), (1, 2, 3)), {}, "exactly once"),
    (((0, 1, 2, 3),), {}, "two islands or more"),
    (((0, 1), (2, 3)), {"sync": SyncMethod.SYNC}, "remove them"),
    (((0, 1), (2, 3)), {"fragments": 5}, "at least as many inner steps"),
    (((0, 1), (2, 3)), {"staleness": 2}, "bounded only"),
])
def test_a_split_that_cannot_run_is_one_line(members, kwargs, fragment):
    plan = _split(_four_replicas(), *members, **kwargs)
    with pytest.raises(ConfigError, match=fragment):
        check_plan(plan)


def test_zero3_stays_inside_one_island():
    plan = replace(_split(_four_replicas(), (0, 1), (2, 3)), zero=3)
    with pytest.raises(ConfigError, match="zero 3 does not run across islands"):
        check_plan(plan)


def test_a_rare_sync_without_islands_is_refused():
    plan = replace(_four_replicas(), islands=Islands(sync=SyncMethod.BOUNDED))
    with pytest.raises(ConfigError, match="needs islands"):
        check_plan(plan)


def test_fragments_are_exchanged_at_staggered_steps_each_every_h():
    islands = Islands(islands=(Island((0,)), Island((1,))), sync=SyncMethod.DILOCO,
                      inner_steps=4, fragments=2)
    steps = {f: [s for s in range(1, 13) if islands.exchanges_at(s, f)] for f in (0, 1)}
    assert steps == {0: [4, 8, 12], 1: [2, 6, 10]}
    assert [islands.fragment_of(u, 6) for u in range(6)] == [0, 0, 0, 1, 1, 1]


def test_int8_carries_its_block_scale_on_the_wire():
    assert 1.0 < Compression.INT8.bytes_per_value < 1.01
    assert Compression.BF16.bytes_per_value == 2.0
