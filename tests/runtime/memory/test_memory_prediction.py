"""The planner's predicted peak memory per rank is within 10% of what the rank holds.

Tiny models on two CPU ranks (pp=2, 1F1B, four micro-batches of two 64-token
sequences, so activations are most of what a rank holds): the cost model's
:class:`~potluck.plans.DeviceMemory` of each device against the rank's
:class:`~potluck.runtime.memory.ledger.MemoryLedger` peak (parameters, gradients, Adam's
states, live saved activations). With swapping, the contract of issue 13 says what
moves: until the cost model predicts it itself (``host_bytes`` on
:class:`~potluck.plans.DeviceMemory`), the swapped blocks' bytes of every in-flight
micro-batch but the one in its backward pass leave the device for host memory.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from memory_helpers import run_with_memory, with_memory
from runtime_helpers import TINY_GPT2, TINY_LLAMA, make_plan, pipe

from potluck.cluster.topology import Cluster
from potluck.model import counts
from potluck.model.counts import Recompute
from potluck.planner.compute import ComputeModel
from potluck.planner.evaluate import predict
from potluck.plans import DeviceMemory, Plan
from potluck.plans.memory import Offload, StageMemory, Swap
from potluck.schedules import schedule_for

TOLERANCE = 0.10
SEQ_LEN = 64


def _plan(spec, recompute: Recompute = Recompute.NONE) -> Plan:
    return make_plan(spec, [pipe([(1, (0, 2)), (1, (2, 4))], 2, 4)], seq_len=SEQ_LEN,
                     recompute=recompute)


def _swapped_bytes(plan: Plan, stage: int) -> float:
    """Bytes per micro-batch the stage's swapped blocks save (the cost model's count)."""
    memory = plan.stage_memory(0, stage)
    blocks = sum(end - start for start, end in plan.pipelines[0].stages[stage].layer_ranges)
    device = Cluster(plan.cluster).device(plan.pipelines[0].stages[stage].devices[0])
    compute = ComputeModel(plan.model, plan.training.seq_len, plan.training.dtype,
                           plan.training.execution)
    per_block = counts.block_activation_bytes(
        plan.model, plan.pipelines[0].micro_batch_size, plan.training.seq_len, 1,
        memory.recompute, flash_attention=plan.training.execution.flash_attention)
    return memory.swapped_blocks(blocks) * per_block * compute.element_scale(device.type)


def _expected(plan: Plan, unswapped: DeviceMemory, stage: int) -> tuple[float, float]:
    """(device, host) bytes of a stage under the contract's swapping."""
    host = getattr(unswapped, "host_bytes", None)
    if host is not None and host > 0:
        return unswapped.total_bytes, host
    pipeline = plan.pipelines[0]
    in_flight = schedule_for(plan.schedule).in_flight(stage, pipeline.pp,
                                                      pipeline.num_micro_batches, 1)
    moved = _swapped_bytes(plan, stage)
    return unswapped.total_bytes - (in_flight - 1) * moved, in_flight * moved


CASES = {
    "llama, everything kept": (TINY_LLAMA, Recompute.NONE),
    "gpt2, everything kept": (TINY_GPT2, Recompute.NONE),
    "llama, selective recomputation": (TINY_LLAMA, Recompute.SELECTIVE),
    "gpt2, full recomputation": (TINY_GPT2, Recompute.FULL),
}


@pytest.mark.parametrize(("spec", "recompute"), list(CASES.values()), ids=list(CASES))
def test_predicted_peak_is_within_10_percent_of_measured_per_rank(spec, recompute):
    plan = _plan(spec, recompute)
    _, history = run_with_memory(plan, steps=2)
    for predicted, measured in zip(predict(plan).memory, history[-1], strict=True):
        assert predicted.device == measured["device"]
        assert measured["device_bytes"] == pytest.approx(predicted.total_bytes, rel=TOLERANCE)


def test_host_swap_moves_the_predicted_bytes_off_the_device():
    plan = _plan(TINY_LLAMA)
    swapping = with_memory(plan, {(0, 0): StageMemory(swap=Swap.HOST)})
    prediction = predict(swapping).memory
    _, history = run_with_memory(swapping, steps=2)
    first, last = history[-1]
    device, host = _expected(swapping, prediction[0], 0)
    assert first["device_bytes"] == pytest.approx(device, rel=TOLERANCE)
    assert first["host_bytes"] == pytest.approx(host, rel=TOLERANCE)
    assert last["device_bytes"] == pytest.approx(prediction[1].total_bytes, rel=TOLERANCE)
    assert last["host_bytes"] == 0


def test_the_swap_test_would_catch_a_stash_left_on_the_device():
    """Without swapping, the first rank holds more than the swap prediction allows."""
    plan = _plan(TINY_LLAMA)
    swapping = with_memory(plan, {(0, 0): StageMemory(swap=Swap.HOST)})
    device, _ = _expected(swapping, predict(swapping).memory[0], 0)
    _, history = run_with_memory(replace(plan), steps=2)
    assert history[-1][0]["device_bytes"] > device * (1 + TOLERANCE)


STATE_CASES = {
    "zero 0": (0, Offload.NONE),
    "zero 0 with the optimizer offloaded": (0, Offload.OPTIMIZER),
    "zero 1": (1, Offload.NONE),
    "zero 1 with the optimizer offloaded": (1, Offload.OPTIMIZER),
    "zero 2": (2, Offload.NONE),
    "zero 2 with the optimizer offloaded": (2, Offload.OPTIMIZER),
    "zero 3": (3, Offload.NONE),
    "zero 3 with the optimizer offloaded": (3, Offload.OPTIMIZER),
}


@pytest.mark.parametrize(("zero", "offload"), list(STATE_CASES.values()), ids=list(STATE_CASES))
def test_sharded_and_offloaded_states_are_predicted_within_10_percent(zero, offload):
    """Two replicas of a tiny llama: the device bytes (and host bytes, with offload) each
    rank holds against the cost model's, states sharded or offloaded as the plan says."""
    plan = make_plan(TINY_LLAMA, [pipe([(1, (0, 4))], 2, 2)] * 2, seq_len=SEQ_LEN)
    plan = replace(with_memory(plan, {(k, 0): StageMemory(offload=offload) for k in range(2)}),
                   zero=zero)
    _, history = run_with_memory(plan, steps=2)
    for predicted, measured in zip(predict(plan).memory, history[-1], strict=True):
        assert measured["device_bytes"] == pytest.approx(predicted.total_bytes, rel=TOLERANCE)
        assert measured["host_bytes"] == pytest.approx(predicted.host_bytes, rel=TOLERANCE,
                                                       abs=1.0)
