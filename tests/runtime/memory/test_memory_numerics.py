"""Recomputation per stage and activation swapping leave training exactly as it was.

Each case runs a tiny LLaMA plan on CPU ranks for 20 steps with one stage's memory
set, and compares rank 0's loss curve with one process's (the tolerance of the issue:
2e-3; swapping moves the very bytes autograd saved, recomputation reruns the same ops).
"""

from __future__ import annotations

import pytest
from memory_helpers import run_with_memory, with_memory
from runtime_helpers import TINY_LLAMA, make_plan, pipe, reference_losses, run_plan

from potluck.model.counts import Recompute
from potluck.plans.memory import StageMemory, Swap

STEPS = 20
TOLERANCE = 2e-3
PP2 = [pipe([(1, (0, 2)), (1, (2, 4))], 2, 4)]
HETERO = [pipe([(1, (0, 1)), (1, (1, 4))], 2, 2), pipe([(2, (0, 4))], 1, 3)]
PEER = "cpu.0:1"

CASES = {
    "recompute full x1 on stage 0, selective on stage 1": (PP2, {
        (0, 0): StageMemory(Recompute.FULL, recompute_blocks=1),
        (0, 1): StageMemory(Recompute.SELECTIVE)}),
    "host swap of stage 0": (PP2, {(0, 0): StageMemory(swap=Swap.HOST)}),
    "peer swap of stage 0 to the last stage's device": (PP2, {
        (0, 0): StageMemory(swap=Swap.PEER, swap_peer=PEER)}),
    "hybrid swap of half the blocks with full recomputation": (PP2, {
        (0, 0): StageMemory(Recompute.FULL, swap=Swap.HYBRID, swap_fraction=0.5, swap_peer=PEER,
                            host_share=0.3)}),
    "heterogeneous: swapping pp=2 beside a recomputing, swapping tp=2 replica": (HETERO, {
        (0, 0): StageMemory(swap=Swap.HOST),
        (1, 0): StageMemory(Recompute.SELECTIVE, swap=Swap.HOST, swap_fraction=0.5)}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_stage_memory_trains_like_one_process(case):
    pipelines, memory = CASES[case]
    plan = with_memory(make_plan(TINY_LLAMA, pipelines), memory)
    expected = reference_losses(TINY_LLAMA, plan.training.global_batch, steps=STEPS)
    assert run_plan(plan, steps=STEPS) == pytest.approx(expected, abs=TOLERANCE)


def test_swapping_moves_the_bytes_it_says():
    """The swapping rank's host bytes (its stash) appear and its device bytes drop; peer
    swap puts them on the peer instead (what ``potluck compare`` adds to the peer)."""
    plan = make_plan(TINY_LLAMA, PP2)
    _, [*_, kept] = run_with_memory(plan, steps=2)
    _, [*_, host] = run_with_memory(with_memory(plan, {(0, 0): StageMemory(swap=Swap.HOST)}), 2)
    _, [*_, peer] = run_with_memory(
        with_memory(plan, {(0, 0): StageMemory(swap=Swap.PEER, swap_peer=PEER)}), 2)
    assert kept[0]["host_bytes"] == 0 and host[0]["host_bytes"] > 0
    assert host[0]["device_bytes"] < kept[0]["device_bytes"]
    assert peer[0]["held_on"] == {PEER: pytest.approx(host[0]["host_bytes"])}
    assert peer[0]["host_bytes"] == 0 and peer[1] == kept[1]


def test_resume_with_swap_continues_the_same_loss_curve(tmp_path):
    plan = with_memory(make_plan(TINY_LLAMA, PP2), {
        (0, 0): StageMemory(swap=Swap.HOST), (0, 1): StageMemory(Recompute.FULL)})
    common = {"out_dir": str(tmp_path)}
    before = run_plan(plan, steps=2, checkpoint_every=2, **common)
    after = run_plan(plan, steps=4, resume=True, **common)
    expected = reference_losses(TINY_LLAMA, plan.training.global_batch, steps=4)
    assert before + after == pytest.approx(expected, abs=2e-5)
