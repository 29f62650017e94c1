"""Checkpoints of islands resumed under another layout or another split: two DiLoCo islands
(H=2) of one two-stage pipeline each on 4 CPU ranks, resumed as two islands of two
one-stage replicas each, as four islands, and without islands."""

from __future__ import annotations

import math
import shutil
from dataclasses import replace

import pytest
import torch
from island_workers import split
from runtime_helpers import TINY_LLAMA, make_plan, pipe

from potluck.errors import ConfigError
from potluck.plans import SyncMethod
from potluck.plans.islands import DILOCO_OUTER_LR, DILOCO_OUTER_MOMENTUM, Islands
from potluck.runtime import TrainOptions
from potluck.runtime.checkpoints.island_files import saves_at
from potluck.runtime.checkpoints.storage import (
    checkpoint_path,
    load_full_state_dict,
    read_trainer_state,
)
from potluck.runtime.launch.local import run_local
from potluck.runtime.training import train_rank

TWO_STAGES = [(1, (0, 2)), (1, (2, 4))]
ONE_STAGE = [(1, (0, 4))]
COMMON = {"lr": 3e-3, "progress": False, "timeout_s": 60}
# two islands of one two-stage pipeline (2 rows each), DiLoCo every 2 steps
PIPELINES = split(make_plan(TINY_LLAMA, [pipe(TWO_STAGES, 1, 2)] * 2), (0,), (1,),
                  inner_steps=2)
REPLICAS = make_plan(TINY_LLAMA, [pipe(ONE_STAGE, 1, 1)] * 4)


def _losses(plan, options):
    return [m.loss for m in train_rank(plan, options)]


def _run(plan, out_dir, steps, **options) -> list[float]:
    options = TrainOptions(steps=steps, out_dir=str(out_dir), **COMMON, **options)
    return run_local(_losses, plan.devices, (plan, options), timeout_s=120)[0]


def _state(out_dir, step: int, section: str) -> dict[str, torch.Tensor]:
    return load_full_state_dict(checkpoint_path(out_dir, step), section)


def _assert_close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=2e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize(("every", "islands", "saved_after"), [
    (3, Islands(), [3, 6]),  # no islands: as asked
    (3, replace(PIPELINES.islands, inner_steps=2), [4, 6]),  # 3 rounded up to the outer step 4
    (2, replace(PIPELINES.islands, inner_steps=4), [4, 8]),  # 2 is no outer step: one save at 4
    (3, replace(PIPELINES.islands, fragments=2), [3, 6]),  # never a consensus: as asked
])
def test_checkpoints_move_up_to_the_next_outer_step(every, islands, saved_after):
    assert [done for done in range(1, 9) if saves_at(done, every, islands)] == saved_after


def test_same_islands_laid_out_otherwise_continue_the_uninterrupted_run(tmp_path):
    """Saved after step 3 (between outer steps: the islands' weights and AdamW moments
    differ, the outer momentum is set), resumed with each island's pipeline of two stages
    as two one-stage replicas: the losses and each island's final weights are the
    uninterrupted run's."""
    whole = _run(PIPELINES, tmp_path / "whole", 4)
    out = tmp_path / "resumed"
    before = _run(PIPELINES, out, 3)
    assert read_trainer_state(checkpoint_path(out, 3))["islands"]["consensus"] is False
    other_layout = split(REPLICAS, (0, 1), (2, 3), inner_steps=2)
    after = _run(other_layout, out, 4, resume=True)
    for got, want in zip(before + after, whole, strict=True):
        assert math.isclose(got, want, rel_tol=1e-5)
    for section in ("model", "island1.model", "outer"):
        _assert_close(_state(out, 4, section), _state(tmp_path / "whole", 4, section))


def test_another_split_resumes_from_the_last_consensus_checkpoint(tmp_path):
    """Checkpoints after steps 2 (an outer step: consensus) and 3 (not): without islands
    the newest is refused in one line naming step 2; from step 2 a run without islands and
    one of four DiLoCo islands start from the consensus weights (their first loss is the
    uninterrupted run's), and the four islands carry the outer momentum."""
    out = tmp_path / "two"
    losses = _run(PIPELINES, out, 3, checkpoint_every=2)
    saved = read_trainer_state(checkpoint_path(out, 2))["islands"]
    assert saved["consensus"] is True and saved["outer_steps"] == 1
    with pytest.raises(ConfigError, match="resume from step_000002, the last consensus"):
        _run(REPLICAS, out, 4, resume=True)
    shutil.rmtree(checkpoint_path(out, 3))
    for name in ("one", "four"):
        shutil.copytree(out, tmp_path / name)
    one = _run(REPLICAS, tmp_path / "one", 3, resume=True)
    assert math.isclose(one[0], losses[2], rel_tol=1e-5)
    four = split(REPLICAS, (0,), (1,), (2,), (3,), inner_steps=2, sync=SyncMethod.DILOCO)
    after = _run(four, tmp_path / "four", 4, resume=True)
    assert math.isclose(after[0], losses[2], rel_tol=1e-5)
    _assert_outer_step_carried_momentum(tmp_path / "four")


def _assert_outer_step_carried_momentum(out) -> None:
    """The outer step after step 4 continued step 2's momentum m2: Nesterov SGD's
    ``m4 = mu m2 + g`` and ``w4 = w2 - lr (g + mu m4)``, so ``w4 = w2 - lr ((1 + mu) m4 -
    mu m2)``; a momentum started afresh (m2 taken as 0) gives another w4."""
    m2, w2 = _state(out, 2, "outer"), _state(out, 2, "model")
    m4, w4 = _state(out, 4, "outer"), _state(out, 4, "model")
    mu, lr = DILOCO_OUTER_MOMENTUM, DILOCO_OUTER_LR
    name = "model.layers.0.mlp.up_proj.weight"
    before, now = m2[f"momentum.{name}"], m4[f"momentum.{name}"]
    assert before.abs().max() > 0
    expected = w2[name] - lr * ((1 + mu) * now - mu * before)
    torch.testing.assert_close(w4[name], expected, atol=1e-6, rtol=1e-5)
    fresh = w2[name] - lr * (1 + mu) * now
    assert not torch.allclose(w4[name], fresh, atol=1e-6, rtol=1e-5)


def test_a_bounded_checkpoint_holds_the_weights_with_its_pushes_landed(tmp_path):
    """Bounded staleness 1: the push after step 2 is still in flight at the checkpoint;
    saving applies it first (on every island alike), so the checkpoint is a consensus state
    and a run without islands starts from the weights the islands continued with."""
    bounded = split(make_plan(TINY_LLAMA, [pipe(TWO_STAGES, 1, 2)] * 2), (0,), (1,),
                    inner_steps=2, sync=SyncMethod.BOUNDED, staleness=1)
    out = tmp_path / "bounded"
    losses = _run(bounded, out, 3, checkpoint_every=2, keep_checkpoints=0)
    assert read_trainer_state(checkpoint_path(out, 2))["islands"]["consensus"] is True
    shutil.rmtree(checkpoint_path(out, 3))
    resumed = _run(REPLICAS, out, 3, resume=True)
    assert math.isclose(resumed[0], losses[2], rel_tol=1e-5)


def test_another_layout_refuses_a_checkpoint_with_streaming_fragments_in_flight(tmp_path):
    """Saved after step 3 of H=2 with two fragments, one fragment's average is in flight in
    the saving ranks' own files only: the same islands laid out otherwise would drop it and
    change the run, so the resume is one line."""
    streaming = replace(PIPELINES, islands=replace(PIPELINES.islands, fragments=2))
    out = tmp_path / "streaming"
    _run(streaming, out, 3)
    other_layout = split(REPLICAS, (0, 1), (2, 3), inner_steps=2, fragments=2)
    with pytest.raises(ConfigError, match="streaming fragments in flight"):
        _run(other_layout, out, 4, resume=True)
