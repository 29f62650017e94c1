"""What a run shows while it trains when its output is a log or a pipe: a line after the
first step, then one every PROGRESS_EVERY_S seconds, and one after the last."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from potluck.errors import ConfigError
from potluck.runtime.loop import metrics
from potluck.runtime.loop.metrics import PROGRESS_EVERY_S, ProgressLines, StepEstimate, estimate_line
from potluck.runtime.loop.trainer import StepMetrics


@dataclass
class Captured:
    lines: list[str] = field(default_factory=list)

    def print(self, text: str, **_: object) -> None:
        self.lines.append(text)


def _step(step: int) -> StepMetrics:
    return StepMetrics(step=step, loss=2.5, tokens=128, tokens_per_s=64.0, step_time_s=2.0,
                       predicted_step_time_s=None, peak_memory_gb=0.1, grad_norm=1.0, lr=3e-4)


def test_progress_lines_come_every_few_seconds_and_after_the_last_step(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(metrics.time, "monotonic", lambda: now[0])
    console = Captured()
    progress = ProgressLines(total_steps=10, done_steps=0, console=console)
    for step, at_s in enumerate([2, 4, 6, 2 + PROGRESS_EVERY_S, 13, 14, 15, 16, 17, 20]):
        now[0] = 100.0 + at_s
        progress.on_step(_step(step))
    assert [line.split(" | ")[0] for line in console.lines] == [
        "train: step 0 (1/10 done)", "train: step 3 (4/10 done)", "train: step 9 (10/10 done)"]
    assert console.lines[0].endswith("| 2 s elapsed, about 18 s left")  # 2 s a step, 9 to go
    assert console.lines[-1].endswith("| 20 s elapsed, about 0 s left")
    assert "loss 2.5000" in console.lines[1]


def test_a_resumed_run_counts_its_progress_from_where_it_resumed(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(metrics.time, "monotonic", lambda: now[0])
    console = Captured()
    progress = ProgressLines(total_steps=8, done_steps=6, console=console)
    now[0] = 5.0
    progress.on_step(_step(6))
    assert console.lines == [console.lines[0]]
    assert console.lines[0].startswith("train: step 6 (7/8 done)") and "about 5 s left" in console.lines[0]


@pytest.mark.parametrize(("seconds", "text"), [(4.25, "4.2 s"), (45, "45 s"), (456, "7.6 min"),
                                               (7560, "2.1 h")])
def test_the_estimate_reads_as_people_say_durations(seconds, text):
    line = estimate_line(1, StepEstimate(seconds, dilation=2.0), stand_in="tiny")
    assert f"1 emulated step of about {text} each" in line and f"about {text} in all" in line


@pytest.mark.parametrize("resumed_from", [0, 2])
def test_metrics_jsonl_is_never_written_through_a_link(tmp_path, resumed_from):
    """A run (or a resume, which first drops the rows from its step on) refuses a
    metrics.jsonl that is a link, leaving the linked file as it was."""
    victim = tmp_path / "victim.txt"
    victim.write_text('{"step": 5, "loss": 1.0}\n')
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(ConfigError, match="metrics.jsonl is a symbolic link"):
        metrics.MetricsLog(run, first_step=resumed_from)
    assert victim.read_text() == '{"step": 5, "loss": 1.0}\n'
