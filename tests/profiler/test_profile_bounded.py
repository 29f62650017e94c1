"""potluck profile says how long it takes, shows its progress and never waits unbounded."""

from __future__ import annotations

import io
import multiprocessing

import pytest
from rich.console import Console

from potluck.errors import PotluckError
from potluck.model.loading import load_model
from potluck.profiler import ProfileOptions, profile
from potluck.profiler.report import plan_line, progress_reporter
from potluck.profiler.run import (
    DEADLINE_FACTOR,
    DEADLINE_SLACK_S,
    StatusWatch,
    deadline_s,
    default_dtypes,
    estimate_s,
    status_writer,
)

MODEL = load_model("tiny-llama")


def test_cpu_ranks_time_fp32_only_the_dtype_they_train_in() -> None:
    assert default_dtypes(on_gpu=False) == ("fp32",)
    assert default_dtypes(on_gpu=True) == ("bf16", "fp16", "fp32")


def test_a_default_cpu_profile_is_stopped_within_a_minute() -> None:
    options = ProfileOptions(MODEL, ranks=2, dtypes=("fp32",))
    assert deadline_s(options) == pytest.approx(DEADLINE_FACTOR * estimate_s(options)
                                                + DEADLINE_SLACK_S)
    assert deadline_s(options) <= 60.0
    assert deadline_s(ProfileOptions(MODEL, timeout_s=7.0)) == 7.0


def test_the_plan_line_says_what_is_measured_and_how_long_it_takes() -> None:
    line = plan_line(ProfileOptions(MODEL, ranks=2, dtypes=("fp32",), timeout_s=30.0))
    assert "2 ranks" in line and "fp32" in line and "stopped after 30 s" in line
    assert "\n" not in line


def test_rank_statuses_reach_the_progress_callback_and_name_what_hangs(tmp_path) -> None:
    seen: list[tuple[float, str]] = []
    watch = StatusWatch(tmp_path, 2, lambda fraction, what: seen.append((fraction, what)))
    status_writer(str(tmp_path), 0)(0.25, "matmul fp32")
    status_writer(str(tmp_path), 1)(0.6, "point-to-point links")
    watch.poll()
    watch.poll()  # reported once per new phase
    assert seen == [(0.25, "matmul fp32")]
    assert watch.describe() == ("rank 0 was still in 'matmul fp32', "
                                "rank 1 was still in 'point-to-point links'")


def test_progress_is_plain_lines_when_not_on_a_terminal() -> None:
    out = io.StringIO()
    with progress_reporter(Console(file=out, force_terminal=False, width=200)) as report:
        report(0.05, "matmul fp32")
        report(1.0, "done")
    lines = out.getvalue().splitlines()
    assert [line.split(" (")[0] for line in lines] == ["profile:   5% matmul fp32",
                                                       "profile: 100% done"]


@pytest.mark.slow  # spawns two processes, stopped after a second
def test_a_profile_past_its_deadline_stops_its_ranks_and_says_where_they_were() -> None:
    options = ProfileOptions(MODEL, ranks=2, budget_s=0.02, dtypes=("fp32",), timeout_s=1.0)
    with pytest.raises(PotluckError, match=r"profiling stopped after 1 s: rank 0 was still in"):
        profile(options)
    assert multiprocessing.active_children() == []
