"""Closed forms: collectives, roofline, GEMMs, model states (schedules: tests/schedules)."""

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


def test_small_gemms_are_memory_bound():
    big = formulas.gemm_time_s(4096, 4096, 4096, 300e12, 2e12, 2)
    thin = formulas.gemm_time_s(1, 4096, 4096, 300e12, 2e12, 2)
    assert big == pytest.approx(2 * 4096**3 / 300e12)
    assert thin == pytest.approx(2 * (4096 + 4096 * 4096 + 4096) / (2e12 * 0.8))


def test_a_partial_last_wave_idles_the_other_processors():
    # 128 x 128 output tiles, one per streaming multiprocessor per wave
    assert formulas.wave_efficiency(1024, 1024, 64) == 1.0  # 8 x 8 tiles: one full wave of 64
    assert formulas.wave_efficiency(1152, 1024, 64) == pytest.approx(72 / 128)  # 9 x 8: two waves
    assert formulas.wave_efficiency(1152, 1024, 0) == 1.0  # SM count unknown: not modelled
    # compute-bound (2.4 GFLOP against 6.8 MB), so the idle processors show in its time
    assert formulas.gemm_time_s(1152, 1024, 1024, 50e12, 1e12, 2, 64) == pytest.approx(
        2 * 1152 * 1024 * 1024 / (50e12 * 72 / 128))


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


def test_large_gemms_run_256_by_128_tiles_in_the_orientation_that_wastes_less():
    """NVIDIA's GEMM guide: A100's 108 SMs run one 256 x 128 tile each. A 2048 x 7680 output
    (Megatron's 530B QKV at tp=8, one sequence) is 8 x 60 = 480 such tiles, 5 waves for 4.44
    waves of work; turned 128 x 256 it is 16 x 30 = 480 too: 480 / 540."""
    assert formulas.wave_efficiency(2048, 7680, 108) == pytest.approx(480 / 540)
    # 1792 x 1792: 7 x 14 = 98 tiles of 256 x 128, fewer than 108 SMs: 128 x 128 tiles,
    # 14 x 14 = 196 in two waves of 108
    assert formulas.wave_efficiency(1792, 1792, 108) == pytest.approx(196 / 216)
    # partial edge tiles waste their unused part: 2100 rows are 9 tiles of 256 (2304 rows) by
    # 60 of 128, 540 tiles in exactly 5 waves: 2100 / 2304 of the work is useful
    assert formulas.wave_efficiency(2100, 7680, 108) == pytest.approx(2100 / 2304)
