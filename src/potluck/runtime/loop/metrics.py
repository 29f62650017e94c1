"""What a user sees of a run: metrics.jsonl, a progress bar, optional TensorBoard, a summary.

Each is a trainer callback (``on_step``, ``close``) that runs on rank 0 only
(:func:`run_callbacks` picks them from the run's options).
``metrics.jsonl`` gets one JSON object per step, each step once (a run that
resumes from step N first drops the lines of step N on, which the run it
continues had written after its checkpoint), with at least ``step``,
``loss``, ``tokens_per_s``, ``step_time_s``, ``predicted_step_time_s`` and
``peak_memory_gb``; an emulated run's rows also ``dilation`` (every op was
padded to ``dilation x`` its time on the plan's device) and
``device_step_time_s`` (``step_time_s / dilation``: the step on the emulated
devices, what two emulated runs are compared by, since each calibrates its
own dilation). The progress bar shows loss, tokens/s, step time and
predicted against measured step time. :func:`summarize` is the line printed
after a run.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from potluck.errors import ConfigError
from potluck.runtime.loop.trainer import Callback, StepMetrics
from potluck.runtime.options import TrainOptions

log = logging.getLogger(__name__)

EMULATION_FIELDS = ("dilation", "device_step_time_s")
METRICS_FILE = "metrics.jsonl"


def metrics_row(metrics: StepMetrics) -> dict[str, Any]:
    """One line of metrics.jsonl (the emulation's fields only for an emulated run)."""
    row = metrics.as_dict()
    for key in EMULATION_FIELDS:
        if row[key] is None:
            del row[key]
    return row


class MetricsLog:
    """Appends one JSON line per step to ``DIR/metrics.jsonl``, from ``first_step`` on:
    lines of that step and later already there are dropped first (a resumed run)."""

    def __init__(self, out_dir: str | Path, first_step: int = 0) -> None:
        self.path = Path(out_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        keep_steps_before(self.path, first_step)
        self._file = self.path.open("a")

    def on_step(self, metrics: StepMetrics) -> None:
        self._file.write(json.dumps(metrics_row(metrics)) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def keep_steps_before(path: Path, first_step: int) -> None:
    """Rewrite ``path`` (atomically: a temporary file, then a rename) with only the lines
    of steps before ``first_step``; a torn or foreign line is dropped too."""
    if not path.is_file():
        return
    lines = path.read_text(errors="replace").splitlines()
    kept = [line for line in lines if (step := _step_of(line)) is not None and step < first_step]
    if len(kept) == len(lines):
        return
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text("".join(line + "\n" for line in kept))
    os.replace(temporary, path)
    log.info("%s: dropped %d lines from step %d on", path, len(lines) - len(kept), first_step)


def _step_of(line: str) -> int | None:
    try:
        row = json.loads(line)
    except ValueError:
        return None
    step = row.get("step") if isinstance(row, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


class TensorBoardLog:
    """Scalars per step under ``DIR/tensorboard`` (needs the ``tensorboard`` extra)."""

    def __init__(self, out_dir: str | Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError("--tensorboard needs the tensorboard package: "
                              "pip install 'potluck[tensorboard]'") from None
        self._writer = SummaryWriter(str(Path(out_dir) / "tensorboard"))

    def on_step(self, metrics: StepMetrics) -> None:
        for key, value in metrics.as_dict().items():
            if key != "step" and isinstance(value, int | float):
                self._writer.add_scalar(f"train/{key}", value, metrics.step)

    def close(self) -> None:
        self._writer.close()


def _describe(metrics: StepMetrics) -> str:
    predicted = metrics.predicted_step_time_s
    versus = f" (predicted {predicted:.3g}s)" if predicted else ""
    return (f"loss {metrics.loss:.4f} | {metrics.tokens_per_s:,.0f} tok/s | "
            f"step {metrics.step_time_s:.3g}s{versus}")


class ProgressBar:
    """A rich progress bar over the run's steps."""

    def __init__(self, total_steps: int, done_steps: int = 0, console: Any = None) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self._progress = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                                  TextColumn("{task.description}"), console=console,
                                  transient=False)
        self._task = self._progress.add_task("starting", total=total_steps,
                                             completed=done_steps)
        self._progress.start()

    def on_step(self, metrics: StepMetrics) -> None:
        self._progress.update(self._task, advance=1, description=_describe(metrics))

    def close(self) -> None:
        self._progress.stop()


def run_callbacks(options: TrainOptions, rank: int, done_steps: int) -> list[Callback]:
    """Rank 0's callbacks for a run (none on other ranks): metrics.jsonl and TensorBoard
    under ``out_dir``, the progress bar from ``done_steps`` on."""
    if rank != 0:
        return []
    callbacks: list[Callback] = []
    if options.out_dir:
        callbacks.append(MetricsLog(options.out_dir, first_step=done_steps))
        if options.tensorboard:
            callbacks.append(TensorBoardLog(options.out_dir))
    if options.progress:
        callbacks.append(ProgressBar(options.steps, done_steps))
    return callbacks


def summarize(history: list[StepMetrics]) -> str:
    """One line about a finished run: loss, throughput, measured against predicted step time
    (an emulated run's on its emulated devices: the measured step over the dilation)."""
    if not history:
        return "no steps run"
    timed = history[len(history) // 2:] or history  # skip warm-up
    step_s = sum(m.step_time_s for m in timed) / len(timed)
    tokens_per_s = sum(m.tokens_per_s for m in timed) / len(timed)
    line = (f"{len(history)} steps: loss {history[0].loss:.4f} -> {history[-1].loss:.4f}, "
            f"{tokens_per_s:,.0f} tokens/s, step {step_s:.3g} s")
    devices = [m for m in timed if m.device_step_time_s and m.dilation]
    if devices:
        device_s = sum(m.device_step_time_s or 0.0 for m in devices) / len(devices)
        dilation = sum(m.dilation or 0.0 for m in devices) / len(devices)
        line += f", {device_s:.3g} s on the emulated devices (dilation {dilation:.3g})"
    predicted = [m.predicted_step_time_s for m in timed if m.predicted_step_time_s]
    if predicted:
        mean_predicted = sum(predicted) / len(predicted)
        shown = mean_predicted / dilation if devices else mean_predicted
        line += f" (predicted {shown:.3g} s, measured/predicted {step_s / mean_predicted:.2f})"
    return line
