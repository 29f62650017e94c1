"""What a user sees of a run: metrics.jsonl, its progress, optional TensorBoard, a summary.

Each is a trainer callback (``on_step``, ``close``) that runs on rank 0 only
(:func:`run_callbacks` picks them from the run's options).
``metrics.jsonl`` gets one JSON object per step, each step once (a run that
resumes from step N first drops the lines of step N on, which the run it
continues had written after its checkpoint), with at least ``step``,
``loss``, ``tokens_per_s``, ``step_time_s``, ``predicted_step_time_s`` and
``peak_memory_gb`` (the largest over the ranks; on GPUs each step's own allocator peak,
:mod:`~potluck.runtime.loop.peak_memory`) and ``memory``, each rank's peak device and
host bytes and the bytes its swap stashes took on peers, on GPUs also its allocator's
reserve, the device's memory in use by every process and its reserve on swap peers
(:func:`~potluck.runtime.loop.trainer.rank_memory_rows`, what ``potluck compare`` reads);
an emulated run's rows also
``dilation`` (every op was padded to ``dilation x`` its time on the plan's device) and
``device_step_time_s`` (``step_time_s / dilation``: the step on the emulated
devices, what two emulated runs are compared by, since each calibrates its
own dilation). Progress goes to stderr: on a terminal a bar with loss, tokens/s,
step time (predicted against measured), time elapsed and left; otherwise (a log, a
pipe) :class:`ProgressLines`, a line every few seconds. Steps are numbered from 0
everywhere (``metrics.jsonl``, progress, ``--inject-failure``, checkpoints' ``step_N``
hold the state after N steps); progress also counts the steps done (``step 9 (10/10
done)``). An emulated run first says
how long it will take (:func:`estimate_line`). :func:`summarize` is the line printed
after a run.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from potluck.errors import ConfigError
from potluck.runtime.loop.trainer import Callback, StepMetrics
from potluck.runtime.options import TrainOptions
from potluck.safe_files import open_append, real_dir, write_text, writing
from potluck.yamlio import MAX_LOG_BYTES, read_bounded

log = logging.getLogger(__name__)

EMULATION_FIELDS = ("dilation", "device_step_time_s")
ISLAND_FIELDS = ("outer_step", "bytes_exchanged_across_islands", "staleness")
METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


def metrics_row(metrics: StepMetrics) -> dict[str, Any]:
    """One line of metrics.jsonl (the emulation's fields only for an emulated run, the
    islands' only for a plan whose islands synchronize rarely)."""
    row = metrics.as_dict()
    for key in (*EMULATION_FIELDS, *ISLAND_FIELDS):
        if row[key] is None:
            del row[key]
    return row


class MetricsLog:
    """Appends one JSON line per step to ``DIR/metrics.jsonl``, from ``first_step`` on:
    lines of that step and later already there are dropped first (a resumed run)."""

    def __init__(self, out_dir: str | Path, first_step: int = 0) -> None:
        self.path = Path(out_dir) / METRICS_FILE
        keep_steps_before(self.path, first_step)
        self._file = open_append(self.path)

    def on_step(self, metrics: StepMetrics) -> None:
        with writing(self.path):
            self._file.write(json.dumps(metrics_row(metrics)) + "\n")
            self._file.flush()

    def close(self) -> None:
        self._file.close()


def keep_steps_before(path: Path, first_step: int) -> None:
    """Rewrite ``path`` (atomically: a temporary file, then a rename) with only the lines
    of steps before ``first_step``; a torn or foreign line is dropped too."""
    if not path.is_file():
        return
    lines = _text(path).splitlines()
    kept = [line for line in lines if (step := _step_of(line)) is not None and step < first_step]
    if len(kept) == len(lines):
        return
    write_text(path, "".join(line + "\n" for line in kept))
    log.info("%s: dropped %d lines from step %d on", path, len(lines) - len(kept), first_step)


def logged_steps(out_dir: str | Path) -> dict[int, StepMetrics]:
    """The steps of ``DIR/metrics.jsonl`` by step (a torn or foreign line is skipped)."""
    path = Path(out_dir) / METRICS_FILE
    names = {f.name for f in fields(StepMetrics)}
    logged: dict[int, StepMetrics] = {}
    if not path.is_file():
        return logged
    for line in _text(path).splitlines():
        try:
            row = json.loads(line)
            metrics = StepMetrics(**{k: v for k, v in row.items() if k in names})
        except (ValueError, TypeError):
            continue
        logged[metrics.step] = metrics
    return logged


def _text(path: Path) -> str:
    """The metrics file's text, a torn (not UTF-8) line's bytes replaced."""
    return read_bounded(path, METRICS_FILE, MAX_LOG_BYTES).decode(errors="replace")


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
        self._writer = SummaryWriter(str(real_dir(Path(out_dir) / TENSORBOARD_DIR, out_dir)))

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


PROGRESS_EVERY_S = 10.0  # a progress line at most this often when stderr is not a terminal
SLOW_EMULATED_STEP_S = 30.0  # emulated steps this long get the --stand-in hint


@dataclass(frozen=True)
class StepEstimate:
    """How long one step of a run should take on this machine, before it runs: an emulated
    step is its predicted time on the plan's devices stretched by the dilation."""

    step_s: float
    dilation: float


def estimate_line(steps: int, estimate: StepEstimate, stand_in: str | None) -> str:
    """``train: 22 emulated steps of about 19 s each (...): about 7 min in all (an estimate)``."""
    dilation = estimate.dilation
    stretch = f"{dilation:.3g}" if dilation < 100 else f"{dilation:.0f}"
    line = (f"train: {steps} emulated step{'' if steps == 1 else 's'} of about "
            f"{_wall(estimate.step_s)} each (every op {stretch}x its predicted time on the "
            f"plan's devices, so the CPU ranks keep their pace): about "
            f"{_wall(steps * estimate.step_s)} in all (an estimate)")
    if stand_in is None and estimate.step_s > SLOW_EMULATED_STEP_S:
        line += ("; --stand-in tiny computes a tiny model with the same blocks and layout, "
                 "and runs far faster")
    return line


def calibration_reporter(options: TrainOptions, rank: int
                         ) -> Callable[[int, int, float], None] | None:
    """Rank 0's line on stderr after each unpadded step that sets an emulation's dilation."""
    if rank != 0 or not options.progress:
        return None
    from rich.console import Console

    console = Console(stderr=True)

    def report(done: int, of: int, step_s: float) -> None:
        console.print(f"emulation: unpadded step {done}/{of} took {_wall(step_s)} "
                      "(sets the dilation)", highlight=False, markup=False, soft_wrap=True)

    return report


def _wall(seconds: float) -> str:
    """Wall time as people say it: 45 s, 7.6 min, 2.1 h."""
    if seconds < 90:
        return f"{seconds:.2g} s" if seconds < 10 else f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.2g} min"
    return f"{seconds / 3600:.2g} h"


class ProgressBar:
    """A rich progress bar over the run's steps, with the time left (on a terminal)."""

    def __init__(self, total_steps: int, done_steps: int = 0, console: Any = None) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                                  TimeElapsedColumn(), TimeRemainingColumn(),
                                  TextColumn("{task.description}"), console=console,
                                  transient=False)
        self._task = self._progress.add_task("starting", total=total_steps,
                                             completed=done_steps)
        self._progress.start()

    def on_step(self, metrics: StepMetrics) -> None:
        self._progress.update(self._task, advance=1,
                              description=f"step {metrics.step} | {_describe(metrics)}")

    def close(self) -> None:
        self._progress.stop()


class ProgressLines:
    """One plain line per :data:`PROGRESS_EVERY_S` seconds, after the first and after the
    last step (for a log or a pipe): the step (numbered from 0, as in ``metrics.jsonl`` and
    ``--inject-failure``), how many of the run's steps are done, loss, time elapsed and
    left."""

    def __init__(self, total_steps: int, done_steps: int, console: Any) -> None:
        self.total_steps = total_steps
        self.first_step = done_steps
        self.console = console
        self.started_s = time.monotonic()
        self.printed_s: float | None = None

    def on_step(self, metrics: StepMetrics) -> None:
        done = metrics.step + 1
        now_s = time.monotonic()
        due = self.printed_s is None or now_s - self.printed_s >= PROGRESS_EVERY_S
        if not due and done < self.total_steps:
            return
        self.printed_s = now_s
        elapsed_s = now_s - self.started_s
        left_s = elapsed_s / max(1, done - self.first_step) * (self.total_steps - done)
        self.console.print(f"train: step {metrics.step} ({done}/{self.total_steps} done) | "
                           f"{_describe(metrics)} | "
                           f"{_wall(elapsed_s)} elapsed, about {_wall(left_s)} left",
                           highlight=False, markup=False, soft_wrap=True)

    def close(self) -> None:
        return None


def run_callbacks(options: TrainOptions, rank: int, done_steps: int,
                  estimate: StepEstimate | None = None) -> list[Callback]:
    """Rank 0's callbacks for a run (none on other ranks): metrics.jsonl and TensorBoard
    under ``out_dir``; the progress on stderr from ``done_steps`` on (a bar on a terminal,
    else :class:`ProgressLines`), after the run's ``estimate`` when it has one."""
    if rank != 0:
        return []
    callbacks: list[Callback] = []
    if options.out_dir:
        callbacks.append(MetricsLog(options.out_dir, first_step=done_steps))
        if options.tensorboard:
            callbacks.append(TensorBoardLog(options.out_dir))
    if options.progress:
        from rich.console import Console

        console = Console(stderr=True)
        if estimate is not None:
            console.print(estimate_line(options.steps - done_steps, estimate, options.stand_in),
                          highlight=False, markup=False, soft_wrap=True)
        callbacks.append(ProgressBar(options.steps, done_steps, console) if console.is_terminal
                         else ProgressLines(options.steps, done_steps, console))
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
