"""Closed forms: collectives, roofline, model states (schedules: tests/schedules; GEMMs:
test_gemm.py)."""

import pytest

from potluck.planner import formulas
from potluck.planner.formulas import StateSharding


def test_ring_allreduce_matches_the_textbook_form():
    # 2 (g-1)/g * n / W + 2 (g-1) alpha
    assert formulas.ring_allreduce_time_s(1e9, 4, 10e9, 0.0) == pytest.approx(0.15)
    assert formulas.ring_allreduce_time_s(1e9, 4, 10e9, 1e-3) == pytest.approx(0.156)
    assert formulas.ring_allreduce_time_s(1e9, 1, 10e9, 1e-3) == 0.0


def test_a_ring_collective_is_bytes_over_every_hop_and_latencies_in_a_row():
    # 4 ranks, 1 GB: an all-reduce moves 2 * 3/4 GB over every hop and pays 2 * 3 latencies;
    # a reduce-scatter or all-gather half of that; nothing to move is no collective
    assert formulas.ring_terms(1e9, 4) == pytest.approx((1.5e9, 6.0))
    assert formulas.ring_terms(1e9, 4, formulas.HALF_RING_PASSES) == pytest.approx((0.75e9, 3.0))
    assert formulas.ring_terms(0.0, 4) == (0.0, 0.0)
    assert formulas.ring_terms(1e9, 1) == (0.0, 0.0)
    # 0.75 GB at 10 GB/s and 3 latencies of 1 ms
    assert formulas.ring_allgather_time_s(1e9, 4, 10e9, 1e-3) == pytest.approx(0.078)


def test_roofline_takes_the_slower_of_compute_and_memory():
    # 1 TFLOP on 100 TFLOP/s = 10 ms; 1 GB at 1 TB/s (80% usable) = 1.25 ms
    assert formulas.roofline_time_s(1e12, 1e9, 100e12, 1e12) == pytest.approx(0.01)
    assert formulas.roofline_time_s(1e9, 1e9, 100e12, 1e12) == pytest.approx(1.25e-3)


def test_model_states_with_and_without_zero1():
    assert formulas.model_state_bytes(1e9) == 16e9
    assert formulas.model_state_bytes(1e9, sharding=StateSharding.zero1(8, False)) == 16e9
    zero1 = StateSharding.zero1(8, True)
    assert formulas.model_state_bytes(1e9, sharding=zero1) == pytest.approx((4 + 12 / 8) * 1e9)
    assert StateSharding.zero1(1, True).optimizer_shards == 1


def test_megatron_gradient_accumulation_reads_and_writes_ten_bytes_per_parameter():
    """Megatron-LM's hook adds each micro-batch's 16-bit gradient into the FP32 main_grad:
    1e9 parameters x 10 bytes over 80% of 2 TB/s is 6.25 ms."""
    assert formulas.grad_accumulation_time_s(1e9, 10.0, 2e12) == pytest.approx(6.25e-3)
