"""The layout: which rank runs what, and which ranks sum which gradients."""

from __future__ import annotations

import pytest
from runtime_helpers import TINY_GPT2, TINY_LLAMA, make_plan, pipe

from potluck.errors import ConfigError
from potluck.placement import EMBED, HEAD, TIED, block_unit
from potluck.runtime.layout import Layout


def hetero_plan():
    # pipeline 0: two stages, uneven (1 + 3 blocks); pipeline 1: one stage with TP 2.
    return make_plan(TINY_LLAMA, [pipe([(1, (0, 1)), (1, (1, 4))], 2, 2),
                                  pipe([(2, (0, 4))], 1, 3)])


def test_roles_follow_plan_order():
    layout = Layout.for_local_ranks(hetero_plan(), rank=3)
    roles = layout.roles
    assert [(r.pipeline, r.stage, r.tp_rank) for r in roles] == [(0, 0, 0), (0, 1, 0),
                                                                  (1, 0, 0), (1, 0, 1)]
    assert roles[1].layer_ranges == ((1, 4),)
    assert layout.role.tp == 2 and layout.role.holds_embedding and layout.role.holds_head


def test_uneven_batch_shares_give_each_replica_its_rows():
    plan = hetero_plan()
    assert Layout.for_local_ranks(plan, 0).batch_rows == (0, 4)
    assert Layout.for_local_ranks(plan, 3).batch_rows == (4, 3)


def test_same_tp_everywhere_gives_aligned_groups():
    plan = make_plan(TINY_LLAMA, [pipe([(2, (0, 2)), (2, (2, 4))], 1, 2),
                                  pipe([(2, (0, 3)), (2, (3, 4))], 1, 2)])
    layout = Layout.for_local_ranks(plan, rank=5)  # pipeline 1, stage 0, tp rank 1
    group = layout.sync_group(block_unit(2))
    assert group.aligned
    assert group.ranks == (3, 5)  # pipeline 0 stage 1 tp rank 1, pipeline 1 stage 0 tp rank 1


def test_different_tp_gives_full_layout_groups_per_layer():
    layout = Layout.for_local_ranks(hetero_plan(), rank=0)
    assert layout.sync_group(EMBED).ranks == (0, 2, 3)
    assert not layout.sync_group(EMBED).aligned
    assert layout.sync_group(block_unit(0)).ranks == (0, 2, 3)
    assert layout.sync_group(block_unit(3)).ranks == (1, 2, 3)
    assert layout.sync_group(HEAD).ranks == (1, 2, 3)


def test_tied_embedding_unit_spans_first_and_last_stages():
    plan = make_plan(TINY_GPT2, [pipe([(1, (0, 2)), (1, (2, 4))], 1, 2),
                                 pipe([(1, (0, 1)), (1, (1, 4))], 1, 2)])
    layout = Layout.for_local_ranks(plan, rank=0)
    assert TIED in layout.units()
    assert layout.sync_group(TIED).ranks == (0, 1, 2, 3)
    assert layout.sync_group(TIED).aligned


def test_world_size_must_match_plan():
    plan = hetero_plan()
    with pytest.raises(ConfigError, match="uses 4 devices .* 3 ranks"):
        Layout(plan, 0, plan.devices[:3])


def test_stages_with_different_tp_run_on_their_leaders():
    plan = make_plan(TINY_LLAMA, [pipe([(2, (0, 2)), (1, (2, 3)), (2, (3, 4))], 1, 3)])
    leader, follower = Layout.for_local_ranks(plan, 0), Layout.for_local_ranks(plan, 4)
    assert leader.mixed_tp(0) and leader.num_lanes(0) == 1
    assert leader.lane_ranks(0, 0) == (0, 2, 3)
    assert leader.is_announcing_leader and not leader.is_follower
    assert follower.is_follower and not follower.is_announcing_leader


def test_tp_index_is_rank_order_within_a_stage_and_lanes_follow_stage_order():
    """Ranks numbered as torchrun numbers them need not follow the plan's device order; a
    TP index is the position in the stage's process group (ascending ranks, the TP mesh's
    order), and a lane lists its ranks stage by stage."""
    plan = make_plan(TINY_LLAMA, [pipe([(2, (0, 2)), (2, (2, 4))], 1, 2),
                                  pipe([(2, (0, 4))], 1, 2)],
                     device_ids=["cpu.0:0", "cpu.0:5", "cpu.0:3", "cpu.0:1", "cpu.0:2", "cpu.0:4"])
    by_rank = tuple(f"cpu.0:{i}" for i in range(6))
    layout = Layout(plan, 5, by_rank)
    assert layout.stage_ranks(0, 0) == (0, 5) and layout.stage_ranks(0, 1) == (1, 3)
    assert [(r.pipeline, r.stage, r.tp_rank) for r in layout.roles] == [
        (0, 0, 0), (0, 1, 0), (1, 0, 0), (0, 1, 1), (1, 0, 1), (0, 0, 1)]
    assert layout.lane_ranks(0, 0) == (0, 1) and layout.lane_ranks(0, 1) == (5, 3)
    assert layout.sync_group(block_unit(0)).ranks == (5, 4)  # tp index 1 of both holders
