"""Who may train into a run directory: one that holds another run is refused before any rank
starts unless the run continues it (``--resume``, beyond the steps it has done) or replaces
it (``--overwrite``); a link among a run's files is refused before the run starts.

The launch itself is replaced by a stand-in that records it: these are the checks that
come first."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from runtime_helpers import TINY_LLAMA, make_plan, pipe

from potluck.errors import ConfigError
from potluck.runtime import training
from potluck.runtime.checkpoints.storage import save_checkpoint
from potluck.runtime.options import TrainOptions

PLAN = make_plan(TINY_LLAMA, [pipe([(1, (0, 4))], 2, 1)])


@pytest.fixture
def launches(monkeypatch) -> list[TrainOptions]:
    """The options of each launch ``training.train`` would have made."""
    started: list[TrainOptions] = []

    def run_local(fn, devices, args, **_):
        started.append(args[1])
        return [[]]

    monkeypatch.setattr(training, "run_local", run_local)
    return started


def _old_run(out: Path, steps: int = 40) -> None:
    """What a finished run of ``steps`` steps leaves (checkpoints 35 and 40, unverifiable)."""
    out.mkdir()
    (out / "plan.json").write_text("{}\n")
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "loss": 1.0}) + "\n"
                                               for i in range(steps)))
    for step in (steps - 5, steps):
        (out / "checkpoints" / f"step_{step:06d}").mkdir(parents=True)
    (out / "notes.txt").write_text("mine\n")


def _train(out: Path, **options: object) -> None:
    training.train(PLAN, TrainOptions(out_dir=str(out), data=None, progress=False, **options))


def test_training_into_a_directory_holding_another_run_is_refused(tmp_path, launches):
    out = tmp_path / "old"
    _old_run(out)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(ConfigError, match=r"holds another run \(metrics.jsonl, checkpoints/ up to "
                                          r"step 40\); "
                                          r"continue it with --resume, replace it with "
                                          r"--overwrite") as refused:
        _train(out, steps=3)
    assert str(out) in str(refused.value)
    assert launches == []
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    new = tmp_path / "new"  # potluck plan -o DIR/plan.json, then train --plan it --out DIR
    new.mkdir()
    (new / "plan.json").write_text("{}\n")
    _train(new, steps=3)
    assert len(launches) == 1, "a plan alone is not a run"


def test_overwrite_deletes_the_old_runs_files_before_the_run_starts(tmp_path, launches):
    out = tmp_path / "old"
    _old_run(out)
    (out / "trace.json").write_text("{}")
    _train(out, steps=3, overwrite=True)
    assert len(launches) == 1
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]  # the user's file stays


def test_resume_and_overwrite_together_are_refused(tmp_path, launches):
    with pytest.raises(ConfigError, match="give one of them"):
        _train(tmp_path / "run", steps=3, resume=True, overwrite=True)
    assert launches == []


@pytest.mark.parametrize("steps", [2, 4])
def test_resume_to_no_more_steps_than_done_is_refused(tmp_path, launches, steps):
    """It used to train nothing, say "-2 emulated steps" and exit 0."""
    save_checkpoint(tmp_path, 4, {"model": {"w": torch.zeros(2)}}, {"step": 4})
    with pytest.raises(ConfigError, match=rf"--steps {steps} is not beyond the 4 steps the run "
                                          r"has done .*--steps 5 or more"):
        _train(tmp_path, steps=steps, resume=True)
    assert launches == []


@pytest.mark.parametrize("name", ["metrics.jsonl", "checkpoints", "trace.json", "plan.json"])
def test_a_link_among_a_runs_files_is_refused_before_it_starts(tmp_path, launches, name):
    """A run would write through it (trace.json at the end of a traced run) or prune through
    it (checkpoints): refused before any rank starts, the link's target untouched."""
    out = tmp_path / "run"
    out.mkdir()
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep.txt").write_text("mine\n")
    (out / name).symlink_to(target if name == "checkpoints" else target / "keep.txt")
    for flags in ({}, {"overwrite": True}):
        with pytest.raises(ConfigError, match=f"{name} is a symbolic link"):
            _train(out, steps=3, **flags)
    assert launches == []
    assert (target / "keep.txt").read_text() == "mine\n"
