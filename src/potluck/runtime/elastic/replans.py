"""``replans.jsonl``: one JSON object per replan of an elastic run, appended as it happens.

Each names the step the run continued from (its newest complete checkpoint), why it
replanned (``lost``: ranks died; ``left``: devices were taken away with ``potluck leave``;
``joined``: devices were offered and the plan with them is faster; ``changed``: both),
the devices lost (or taken away) and joined, the old and new layouts, devices and predicted
step times, and how many finished steps were lost (trained again after the restart).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from potluck.safe_files import open_append, writing
from potluck.yamlio import read_text

REPLANS_FILE = "replans.jsonl"


@dataclass(frozen=True)
class ReplanRecord:
    """One replan of an elastic run."""

    step: int  # the step the new plan continues from
    reason: str  # "lost", "left", "joined" or "changed"
    lost_devices: tuple[str, ...]
    joined_devices: tuple[str, ...]
    old_layout: str
    new_layout: str
    old_devices: tuple[str, ...]
    new_devices: tuple[str, ...]
    old_predicted_step_s: float
    new_predicted_step_s: float
    steps_lost: int  # finished steps after ``step`` that are trained again
    cause: str = ""  # what the launcher saw (a lost device's failure, one line)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def append_replan(run_dir: str | Path, record: ReplanRecord) -> None:
    """Add ``record`` to the run's ``replans.jsonl`` (a whole line, flushed)."""
    path = Path(run_dir) / REPLANS_FILE
    with open_append(path) as out, writing(path):
        out.write(json.dumps(record.to_json()) + "\n")
        out.flush()


def read_replans(run_dir: str | Path) -> list[dict[str, Any]]:
    """The run's replans, oldest first (none: an empty list)."""
    path = Path(run_dir) / REPLANS_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in read_text(path, REPLANS_FILE).splitlines() if line.strip()]
