"""Memory over time: activations held from each forward to the backward that frees them."""

from __future__ import annotations

import pytest
from simkit import synthetic_pipeline

from potluck.schedules import schedule_for
from potluck.sim.memory import stage_memory
from potluck.sim.simulator import run_pipelines


def _peaks(schedule: str, p: int, m: int, v: int = 1) -> list[float]:
    work, network = synthetic_pipeline(p, m, v, weight_grad_s=0.5 if schedule == "zb" else 0.0,
                                       activation_bytes=1.0)
    pipeline_schedule = schedule_for(schedule)
    runs, _ = run_pipelines([work], pipeline_schedule, v, network)
    traces = [stage_memory(runs[0].ops, i, stage, pipeline_schedule.frees_activations_after)
              for i, stage in enumerate(work.stages)]
    for trace in traces:
        assert trace.bytes[0] == 0.0 and trace.bytes[-1] == pytest.approx(0.0)
        assert list(trace.times_s) == sorted(trace.times_s)
    return [trace.peak_bytes for trace in traces]


def test_1f1b_stage_i_holds_p_minus_i_micro_batches() -> None:
    assert _peaks("1f1b", 4, 8) == [4, 3, 2, 1]


def test_gpipe_holds_every_micro_batch() -> None:
    assert _peaks("gpipe", 4, 8) == [8, 8, 8, 8]


def test_fewer_micro_batches_than_stages_cap_what_is_held() -> None:
    assert _peaks("gpipe", 4, 2) == [2, 2, 2, 2]  # 1F1B needs m >= p; GPipe runs any m


def test_interleaving_holds_more_chunks_in_flight_than_1f1b() -> None:
    """Each chunk holds 1/v of a stage's activations; interleaved 1F1B keeps more than
    p - i stages' worth in flight (Korthikanti et al. 2022, Sec. 4.2.3) on the first stage."""
    peaks = _peaks("interleaved", 4, 8, v=2)
    assert peaks[0] > 4 and peaks == sorted(peaks, reverse=True)
