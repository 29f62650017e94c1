"""Where a run's checkpoints live and what they are called (no torch: the launcher reads
these names before any rank starts).

``DIR/checkpoints/step_000100/`` is the checkpoint after 100 steps; a save in progress
writes ``step_000100.partial`` and renames it when complete
(:mod:`~potluck.runtime.checkpoints.storage`).
"""

from __future__ import annotations

import re
from pathlib import Path

from potluck.errors import ConfigError

CHECKPOINTS_DIR = "checkpoints"
PARTIAL_SUFFIX = ".partial"
STEP_NAME = re.compile(r"^step_(\d+)$")


def checkpoint_path(out_dir: str | Path, step: int) -> Path:
    return Path(out_dir) / CHECKPOINTS_DIR / f"step_{step:06d}"


def checkpoint_step(path: str | Path) -> int:
    match = STEP_NAME.match(Path(path).name)
    if not match:
        raise ConfigError(f"{path}: not a checkpoint directory (expected step_NNNNNN)")
    return int(match.group(1))


def is_step_name(name: str) -> bool:
    """Whether ``name`` is a checkpoint's, finished (``step_N``) or not (``step_N.partial``)."""
    return STEP_NAME.match(name.removesuffix(PARTIAL_SUFFIX)) is not None


def newest_step_dir(out_dir: str | Path) -> int | None:
    """The highest step among the ``step_N`` folders under ``out_dir`` (none: None), finished
    or not, verified or not: what a run directory claims to hold."""
    root = Path(out_dir) / CHECKPOINTS_DIR
    if not root.is_dir() or root.is_symlink():
        return None
    steps = [checkpoint_step(p) for p in root.iterdir() if STEP_NAME.match(p.name)]
    return max(steps, default=None)
