"""The planner's exposed exchange of streaming DiLoCo counts the whole inner steps that the
runtime overlaps a fragment with (it applies the fragment ``H // F`` steps after sending it)."""

from __future__ import annotations

import pytest

from potluck.planner.islands.exchange import exposed_per_step_s
from potluck.plans import Island, Islands, SyncMethod

TWO = (Island(pipelines=(0,)), Island(pipelines=(1,)))


def test_a_fragment_overlaps_the_whole_steps_until_it_is_applied():
    """H=10, F=4: each fragment is applied 2 steps after it is sent (not 2.5): a fragment of
    2.4 steps' time leaves 0.4 steps exposed, four times every 10 steps."""
    islands = Islands(islands=TWO, sync=SyncMethod.DILOCO, inner_steps=10, fragments=4)
    assert islands.overlap_steps == 2
    assert exposed_per_step_s(islands, 4 * 2.4, 1.0) == pytest.approx(4 * 0.4 / 10)
    blocking = Islands(islands=TWO, sync=SyncMethod.DILOCO, inner_steps=10)
    assert blocking.overlap_steps == 0
    assert exposed_per_step_s(blocking, 3.0, 1.0) == pytest.approx(0.3)
