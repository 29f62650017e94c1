"""The null clock: what every holder of a clock runs its ops through when nothing times them."""

from __future__ import annotations

from potluck.ops import OpKind
from potluck.runtime.timing.clock import Clock, NullClock
from potluck.runtime.timing.emulate import EmulationClock, OpTargets


def test_the_null_clock_runs_the_op_and_returns_its_result():
    calls = []
    assert NullClock().run(OpKind.FORWARD, 0, lambda: calls.append(1) or 7) == 7
    assert calls == [1]


def test_the_null_clock_stretches_nothing_and_leaves_sends_untagged():
    ops = [object(), object()]
    clock = NullClock()
    assert clock.dilation == 1.0
    assert clock.tag_p2p(ops, OpKind.SEND_FORWARD, 0, 0) is ops


def test_the_emulation_clock_is_a_clock_that_tags_nothing():
    clock: Clock = EmulationClock({0: OpTargets(0.0, 0.0)}, 0.0, 0.0)
    ops = [object()]
    assert clock.tag_p2p(ops, OpKind.RECV_BACKWARD, 0, 3) is ops
    assert clock.dilation == 0.0  # not calibrated yet
