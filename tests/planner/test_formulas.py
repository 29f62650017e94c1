"""Closed forms: collectives, roofline, pipeline schedules, memory in flight."""

import pytest

from potluck.planner import formulas
from potluck.planner.formulas import StageWork, pipeline_time


def test_ring_allreduce_matches_the_textbook_form():
    # 2 (g-1)/g * n / W + 2 (g-1) alpha
    assert formulas.ring_allreduce_time_s(1e9, 4, 10e9, 0.0) == pytest.approx(0.15)
    assert formulas.ring_allreduce_time_s(1e9, 4, 10e9, 1e-3) == pytest.approx(0.156)
    assert formulas.ring_allreduce_time_s(1e9, 1, 10e9, 1e-3) == 0.0


def test_roofline_takes_the_slower_of_compute_and_memory():
    # 1 TFLOP on 100 TFLOP/s = 10 ms; 1 GB at 1 TB/s (80% usable) = 1.25 ms
    assert formulas.roofline_time_s(1e12, 1e9, 100e12, 1e12) == pytest.approx(0.01)
    assert formulas.roofline_time_s(1e9, 1e9, 100e12, 1e12) == pytest.approx(1.25e-3)


def test_small_gemms_are_memory_bound():
    big = formulas.gemm_time_s(4096, 4096, 4096, 300e12, 2e12, 2)
    thin = formulas.gemm_time_s(1, 4096, 4096, 300e12, 2e12, 2)
    assert big == pytest.approx(2 * 4096**3 / 300e12)
    assert thin == pytest.approx(2 * (4096 + 4096 * 4096 + 4096) / (2e12 * 0.8))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("p", "m"), [(4, 8), (2, 1), (8, 32)])
def test_equal_stages_take_m_plus_p_minus_1_slots(schedule, p, m):
    stages = [StageWork(1.0, 2.0)] * p
    result = pipeline_time(stages, m, schedule)
    assert result.total_s == pytest.approx((m + p - 1) * 3.0)
    bubble = (result.total_s - m * 3.0) / result.total_s
    assert bubble == pytest.approx((p - 1) / (m + p - 1))


def test_unequal_stages_are_paced_by_the_slowest():
    stages = [StageWork(1.0, 2.0), StageWork(2.0, 4.0), StageWork(1.0, 1.0)]
    result = pipeline_time(stages, 10, "1f1b")
    assert result.total_s == pytest.approx((3 + 6 + 2) + 9 * 6)
    assert result.bottleneck_stage == 1


def test_interleaving_divides_the_bubble_by_v():
    stages = [StageWork(1.0, 2.0)] * 4
    plain = pipeline_time(stages, 8, "1f1b").total_s - 8 * 3.0
    interleaved = pipeline_time(stages, 8, "interleaved", virtual_stages=2).total_s - 8 * 3.0
    assert interleaved == pytest.approx(plain / 2)


def test_zero_bubble_fills_the_bubble_with_weight_gradients():
    stages = [StageWork(1.0, 2.0, weight_grad_s=1.0)] * 4
    one_f_one_b = pipeline_time(stages, 8, "1f1b").total_s
    zero_bubble = pipeline_time(stages, 8, "zb").total_s
    # ZB-H1: the bubble shrinks from (p-1)(f+b) to (p-1)(F+B-W) = (p-1)(f+b-2w)
    assert one_f_one_b - zero_bubble == pytest.approx(3 * 2 * 1.0)


def test_a_slow_link_paces_the_pipeline():
    stages = [StageWork(1.0, 1.0, send_s=5.0), StageWork(1.0, 1.0)]
    result = pipeline_time(stages, 4, "gpipe")
    assert result.period_s == 5.0
    # fill: the stages' own work beyond one period (none here) plus the transfer there and back
    assert result.total_s == pytest.approx(4 * 5.0 + 2 * 5.0)


def test_micro_batches_in_flight_per_schedule():
    assert formulas.in_flight_micro_batches("1f1b", 0, 4, 16) == 4
    assert formulas.in_flight_micro_batches("1f1b", 3, 4, 16) == 1
    assert formulas.in_flight_micro_batches("1f1b", 0, 4, 2) == 2
    assert formulas.in_flight_micro_batches("gpipe", 3, 4, 16) == 16
    assert formulas.in_flight_micro_batches("interleaved", 0, 4, 16, 2) == pytest.approx(4 * 1.375)


def test_model_states_with_and_without_zero1():
    assert formulas.model_state_bytes(1e9, 8, zero1=False) == 16e9
    assert formulas.model_state_bytes(1e9, 8, zero1=True) == pytest.approx((4 + 12 / 8) * 1e9)


def test_1f1b_waits_for_its_transfers_on_every_micro_batch():
    """torch's 1F1B posts sends and receives in batches and waits on them."""
    stages = [StageWork(1.0, 2.0, send_s=0.5)] * 3 + [StageWork(1.0, 2.0)]
    one_f_one_b = pipeline_time(stages, 8, "1f1b")
    gpipe = pipeline_time(stages, 8, "gpipe")
    assert one_f_one_b.period_s == pytest.approx(3.0 + 2 * 0.5)
    assert gpipe.period_s == pytest.approx(3.0)
