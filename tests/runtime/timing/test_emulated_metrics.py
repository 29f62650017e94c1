"""An emulated run's metrics carry its dilation and its step time on the emulated devices."""

from __future__ import annotations

import json

import pytest
from runtime_helpers import TINY_LLAMA, make_plan, pipe

from potluck.cluster.spec import parse_cluster
from potluck.runtime.launch.local import run_local
from potluck.runtime.loop.metrics import metrics_row, summarize
from potluck.runtime.loop.trainer import StepMetrics
from potluck.runtime.options import TrainOptions
from potluck.runtime.timing.emulate import predict
from potluck.runtime.training import train_rank

FAST_AND_SLOW = parse_cluster(
    "nodes:\n"
    "  - {name: fast, gpu: a100-80g-sxm, gpus_per_node: 1}\n"
    "  - {name: slow, gpu: rtx3090, gpus_per_node: 1}\n",
    "fast-and-slow.yaml",
)


def _metrics(step_s: float, dilation: float | None = None) -> StepMetrics:
    return StepMetrics(step=0, loss=1.0, tokens=10, tokens_per_s=10 / step_s, step_time_s=step_s,
                       predicted_step_time_s=None, peak_memory_gb=0.1, grad_norm=1.0, lr=1e-3,
                       dilation=dilation,
                       device_step_time_s=step_s / dilation if dilation else None)


def test_rows_of_an_emulated_run_have_its_dilation_and_device_step_time(tmp_path) -> None:
    plan = make_plan(TINY_LLAMA, [pipe([(1, (0, 3)), (1, (3, 4))], 1, 4)],
                     cluster=FAST_AND_SLOW, device_ids=["fast.0:0", "slow.0:0"])
    dilation = 0.3 / predict(plan).iteration_time_s  # a 0.3 s emulated step
    options = TrainOptions(steps=2, emulate=True, dilation=dilation, progress=False,
                           timeout_s=60, out_dir=str(tmp_path))
    run_local(train_rank, plan.devices, (plan, options), timeout_s=120)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert row["dilation"] == pytest.approx(dilation)
        assert row["device_step_time_s"] == pytest.approx(row["step_time_s"] / dilation, rel=1e-12)


def test_rows_of_a_real_run_have_no_emulation_fields() -> None:
    row = metrics_row(_metrics(0.5))
    assert "dilation" not in row and "device_step_time_s" not in row


def test_the_summary_of_an_emulated_run_gives_its_step_on_the_emulated_devices() -> None:
    # dilation 20: a 4 s step on this CPU is 0.2 s on the devices it emulates
    line = summarize([_metrics(4.0, 20.0), _metrics(4.0, 20.0)])
    assert "step 4 s, 0.2 s on the emulated devices (dilation 20)" in line
