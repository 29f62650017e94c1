"""Achieved matmul throughput (potluck.planner.gemm): tiles and waves over the SMs, the
roofline."""

import pytest

from potluck.planner import gemm


def test_small_gemms_are_memory_bound():
    big = gemm.gemm_time_s(4096, 4096, 4096, 300e12, 2e12, 2)
    thin = gemm.gemm_time_s(1, 4096, 4096, 300e12, 2e12, 2)
    assert big == pytest.approx(2 * 4096**3 / 300e12)
    assert thin == pytest.approx(2 * (4096 + 4096 * 4096 + 4096) / (2e12 * 0.8))


def test_a_partial_last_wave_idles_the_other_processors():
    # 128 x 128 output tiles, one per streaming multiprocessor per wave
    assert gemm.wave_efficiency(1024, 1024, 64) == 1.0  # 8 x 8 tiles: one full wave of 64
    assert gemm.wave_efficiency(1152, 1024, 64) == pytest.approx(72 / 128)  # 9 x 8: two waves
    assert gemm.wave_efficiency(1152, 1024, 0) == 1.0  # SM count unknown: not modelled
    # compute-bound (2.4 GFLOP against 6.8 MB), so the idle processors show in its time
    assert gemm.gemm_time_s(1152, 1024, 1024, 50e12, 1e12, 2, 64) == pytest.approx(
        2 * 1152 * 1024 * 1024 / (50e12 * 72 / 128))


def test_large_gemms_run_256_by_128_tiles_in_the_orientation_that_wastes_less():
    """NVIDIA's GEMM guide: A100's 108 SMs run one 256 x 128 tile each. A 2048 x 7680 output
    (Megatron's 530B QKV at tp=8, one sequence) is 8 x 60 = 480 such tiles, 5 waves for 4.44
    waves of work; turned 128 x 256 it is 16 x 30 = 480 too: 480 / 540."""
    assert gemm.wave_efficiency(2048, 7680, 108) == pytest.approx(480 / 540)
    # 1792 x 1792: 7 x 14 = 98 tiles of 256 x 128, fewer than 108 SMs: 128 x 128 tiles,
    # 14 x 14 = 196 in two waves of 108
    assert gemm.wave_efficiency(1792, 1792, 108) == pytest.approx(196 / 216)
    # partial edge tiles waste their unused part: 2100 rows are 9 tiles of 256 (2304 rows) by
    # 60 of 128, 540 tiles in exactly 5 waves: 2100 / 2304 of the work is useful
    assert gemm.wave_efficiency(2100, 7680, 108) == pytest.approx(2100 / 2304)
