"""What a user sees of a run: metrics.jsonl, a progress bar, optional TensorBoard.

Each is a trainer callback (``on_step``, ``close``) that runs on rank 0 only.
``metrics.jsonl`` gets one JSON object per step with at least ``step``,
``loss``, ``tokens_per_s``, ``step_time_s``, ``predicted_step_time_s`` and
``peak_memory_gb``. The progress bar shows loss, tokens/s, step time and
predicted against measured step time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from potluck.errors import ConfigError
from potluck.runtime.loop.trainer import StepMetrics


class MetricsLog:
    """Appends one JSON line per step to ``DIR/metrics.jsonl``."""

    def __init__(self, out_dir: str | Path) -> None:
        self.path = Path(out_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a")

    def on_step(self, metrics: StepMetrics) -> None:
        self._file.write(json.dumps(metrics.as_dict()) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


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
