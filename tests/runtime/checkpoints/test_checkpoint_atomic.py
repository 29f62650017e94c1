"""A save killed at any point never leaves a checkpoint that looks valid."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from potluck.runtime.checkpoints.storage import latest_checkpoint, load_checkpoint, save_checkpoint

HERE = Path(__file__).parent
SRC = HERE.parents[2] / "src"


@pytest.mark.parametrize("where", ["writing", "marker"])
def test_killed_save_leaves_the_previous_checkpoint_as_latest(tmp_path: Path, where: str):
    env = dict(os.environ, PYTHONPATH=str(SRC))
    result = subprocess.run([sys.executable, str(HERE / "killed_save.py"), str(tmp_path), where],
                            env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert (tmp_path / "checkpoints" / "step_000002.partial").is_dir()
    latest = latest_checkpoint(tmp_path)
    assert latest is not None and latest.name == "step_000001"
    state = {"model": {"w": torch.zeros(1000)}}
    assert load_checkpoint(latest, state) == {"step": 1}
    assert torch.equal(state["model"]["w"], torch.arange(1000.0))

    save_checkpoint(tmp_path, 2, {"model": {"w": torch.ones(1000)}}, {"step": 2})
    assert latest_checkpoint(tmp_path).name == "step_000002"
    assert not (tmp_path / "checkpoints" / "step_000002.partial").exists()
