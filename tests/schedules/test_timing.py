"""Each schedule's pipeline time and micro-batches in flight, against the closed forms by hand.

For p stages, m micro-batches, forward f and backward b (Narayanan et al. SC'21;
Qi et al. 2024): GPipe and 1F1B take ``(m + p - 1)(f + b)`` on equal stages;
interleaving divides the bubble by the chunks per device v; zero bubble
shrinks it to ``(p - 1)(f + b - 2w)``.
"""

import pytest

from potluck.schedules import Schedule, StageWork, schedule_for

GPIPE = schedule_for(Schedule.GPIPE)
ONE_F_ONE_B = schedule_for(Schedule.ONE_F_ONE_B)
INTERLEAVED = schedule_for(Schedule.INTERLEAVED)
ZERO_BUBBLE = schedule_for(Schedule.ZERO_BUBBLE)


@pytest.mark.parametrize("schedule", [GPIPE, ONE_F_ONE_B])
@pytest.mark.parametrize(("p", "m"), [(4, 8), (2, 2), (8, 32)])
def test_equal_stages_take_m_plus_p_minus_1_slots(schedule, p, m):
    stages = [StageWork(1.0, 2.0)] * p
    result = schedule.pipeline_time(stages, m)
    assert result.total_s == pytest.approx((m + p - 1) * 3.0)
    bubble = (result.total_s - m * 3.0) / result.total_s
    assert bubble == pytest.approx((p - 1) / (m + p - 1))


def test_unequal_stages_are_paced_by_the_slowest():
    stages = [StageWork(1.0, 2.0), StageWork(2.0, 4.0), StageWork(1.0, 1.0)]
    result = ONE_F_ONE_B.pipeline_time(stages, 10)
    assert result.total_s == pytest.approx((3 + 6 + 2) + 9 * 6)
    assert result.bottleneck_stage == 1


def test_interleaving_divides_the_bubble_by_v():
    stages = [StageWork(1.0, 2.0)] * 4
    plain = ONE_F_ONE_B.pipeline_time(stages, 8).total_s - 8 * 3.0
    interleaved = INTERLEAVED.pipeline_time(stages, 8, virtual_stages=2).total_s - 8 * 3.0
    assert plain == pytest.approx(3 * 3.0)
    assert interleaved == pytest.approx(3 * 3.0 / 2)


def test_zero_bubble_fills_the_bubble_with_weight_gradients():
    stages = [StageWork(1.0, 2.0, weight_grad_s=1.0)] * 4
    one_f_one_b = ONE_F_ONE_B.pipeline_time(stages, 8).total_s
    zero_bubble = ZERO_BUBBLE.pipeline_time(stages, 8).total_s
    # ZB-H1: the bubble shrinks from (p-1)(f+b) = 9 to (p-1)(F+B-W) = (p-1)(f+b-2w) = 3
    assert one_f_one_b == pytest.approx(8 * 3.0 + 9.0)
    assert zero_bubble == pytest.approx(8 * 3.0 + 3.0)


def test_a_slow_link_paces_the_pipeline():
    stages = [StageWork(1.0, 1.0, send_s=5.0), StageWork(1.0, 1.0)]
    result = GPIPE.pipeline_time(stages, 4)
    assert result.period_s == 5.0
    # fill: the stages' own work beyond one period (none here) plus the transfer there and back
    assert result.total_s == pytest.approx(4 * 5.0 + 2 * 5.0)


def test_1f1b_waits_for_its_transfers_on_every_micro_batch():
    """torch's 1F1B posts sends and receives in batches and waits on them."""
    stages = [StageWork(1.0, 2.0, send_s=0.5)] * 3 + [StageWork(1.0, 2.0)]
    one_f_one_b = ONE_F_ONE_B.pipeline_time(stages, 8)
    gpipe = GPIPE.pipeline_time(stages, 8)
    assert one_f_one_b.period_s == pytest.approx(3.0 + 2 * 0.5)
    assert gpipe.period_s == pytest.approx(3.0)


def test_gpipe_blocks_on_its_transfers_only_when_they_do_not_overlap():
    stages = [StageWork(1.0, 2.0, send_s=0.5), StageWork(1.0, 2.0)]
    assert GPIPE.pipeline_time(stages, 8, overlap_p2p=False).period_s == pytest.approx(3.0 + 0.5)
    assert GPIPE.pipeline_time(stages, 8, overlap_p2p=True).period_s == pytest.approx(3.0)


def test_micro_batches_in_flight_per_schedule():
    assert ONE_F_ONE_B.in_flight(0, 4, 16) == 4
    assert ONE_F_ONE_B.in_flight(3, 4, 16) == 1
    assert GPIPE.in_flight(3, 4, 16) == 16
    # Korthikanti et al. 2022: (p - i)(1 + (p - 1)/(p v)) = 4 * (1 + 3/8)
    assert INTERLEAVED.in_flight(0, 4, 16, 2) == pytest.approx(4 * 1.375)
    assert ZERO_BUBBLE.in_flight(1, 4, 16, 2) == pytest.approx(3 * 1.375)
    assert INTERLEAVED.in_flight(0, 4, 16, 1) == 4
