"""A save killed at any point never leaves a checkpoint that looks valid."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import HuggingFaceStorageWriter

from potluck.errors import ConfigError
from potluck.runtime.checkpoints.storage import (
    latest_checkpoint,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
)

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


def test_a_full_disk_during_a_save_is_one_line_naming_the_checkpoint(tmp_path, monkeypatch):
    """It was "CheckpointException ranks: dict_keys([1])" and DCP's traceback."""
    def disk_full(self, plan, planner):
        raise OSError(errno.ENOSPC, "No space left on device", str(self.path))

    monkeypatch.setattr(HuggingFaceStorageWriter, "write_data", disk_full)
    with pytest.raises(ConfigError) as refused:
        save_checkpoint(tmp_path, 3, {"model": {"w": torch.ones(4)}}, {"step": 3})
    partial = tmp_path / "checkpoints" / "step_000003.partial"
    assert str(refused.value) == (f"cannot write the checkpoint {partial}: the disk is full: free "
                                  "space there or write elsewhere (No space left on device)")
    assert latest_checkpoint(tmp_path) is None


def test_a_file_planted_where_a_save_writes_is_replaced(tmp_path):
    root = tmp_path / "checkpoints"
    root.mkdir()
    (root / "step_000002.partial").write_text("not a folder")
    save_checkpoint(tmp_path, 2, {"w": torch.ones(2)}, {"step": 2})
    assert latest_checkpoint(tmp_path) == root / "step_000002"


@pytest.mark.parametrize("link", ["checkpoints", "checkpoints/step_000001"])
def test_a_linked_checkpoint_folder_is_refused_and_never_deleted_through(tmp_path, link):
    """Pruning through a planted link deleted (or, as a traceback, tried to delete) another
    run's checkpoint; a save through a linked checkpoints/ wrote into another directory."""
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "step_000001").mkdir(parents=True)
    for folder in (elsewhere, elsewhere / "step_000001"):
        (folder / "COMPLETE").write_text("{}")
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    if link == "checkpoints":
        (run / "checkpoints").rmdir()
    (run / link).symlink_to(elsewhere if link == "checkpoints" else elsewhere / "step_000001")
    calls = [lambda: latest_checkpoint(run), lambda: prune_checkpoints(run, 1)]
    if link == "checkpoints":
        calls.append(lambda: save_checkpoint(run, 2, {"w": torch.ones(2)}, {"step": 2}))
    for call in calls:
        with pytest.raises(ConfigError, match=f"{run / link} is a symbolic link"):
            call()
    assert sorted(str(p.relative_to(elsewhere)) for p in elsewhere.rglob("*")) == [
        "COMPLETE", "step_000001", "step_000001/COMPLETE"]
