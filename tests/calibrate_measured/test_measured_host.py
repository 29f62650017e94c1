"""The host's time per block (``Execution.block_host_s``, a floor under a block's GPU
time) as a fitted input: recovered from host-bound runs, left alone on GPU-bound ones."""

from __future__ import annotations

import pytest
from measuredkit import (
    HOST_BOUND_BLOCK_S,
    HOST_BOUND_LAYOUTS,
    MODEL,
    TRUE_EFFICIENCY,
    TRUE_NETWORK_FACTOR,
    true_times,
    write_claimed,
    write_runs,
)

from potluck.calibrate.measured.calibrate import calibrate_measured
from potluck.calibrate.measured.params import Kind
from potluck.calibrate.measured.stats import mape
from potluck.cluster.spec import load_cluster


def fitted(outcome) -> dict[Kind, float]:
    return {p.kind: v for p, v in outcome.fit.values.items() if p.kind is not Kind.LINK}


def test_host_bound_runs_give_the_host_time_per_block(tmp_path) -> None:
    """Small micro-batches run at the host's 2 ms per block, large ones at the GPUs' pace:
    the fit finds the host time, the efficiency of the GPU-bound runs and the network, not
    a per-micro-batch overhead that would mimic the host-bound runs."""
    times = true_times(HOST_BOUND_LAYOUTS, overhead_s=0.0, block_host_s=HOST_BOUND_BLOCK_S)
    out = tmp_path / "calibrated.yaml"
    outcome = calibrate_measured(write_runs(tmp_path / "runs.csv", times, HOST_BOUND_LAYOUTS),
                                 MODEL, write_claimed(tmp_path / "lab.yaml"), out)
    values = fitted(outcome)
    assert set(values) == {Kind.BLOCK_HOST, Kind.EFFICIENCY}
    assert values[Kind.BLOCK_HOST] == pytest.approx(HOST_BOUND_BLOCK_S, rel=0.02)
    assert values[Kind.EFFICIENCY] == pytest.approx(TRUE_EFFICIENCY, rel=0.02)
    network = [v for p, v in outcome.fit.values.items() if p.name == "network bandwidth factor"]
    assert network == [pytest.approx(TRUE_NETWORK_FACTOR, rel=0.02)]
    assert mape(outcome.after_s, outcome.measured_s) < 0.005
    assert load_cluster(out).execution.block_host_s == pytest.approx(
        HOST_BOUND_BLOCK_S, rel=0.02)


def test_gpu_bound_runs_keep_the_host_time(tmp_path) -> None:
    """Every block longer on the GPUs than the host's 192 us: the floor never binds, no
    value of it explains the runs, and it is neither fitted nor written."""
    out = tmp_path / "calibrated.yaml"
    outcome = calibrate_measured(write_runs(tmp_path / "runs.csv", true_times()), MODEL,
                                 write_claimed(tmp_path / "lab.yaml"), out)
    assert Kind.BLOCK_HOST not in fitted(outcome)
    assert Kind.MICRO_BATCH_OVERHEAD in fitted(outcome)
    assert "block_host_s" not in out.read_text()
