"""A tensor-parallel shard is cut on the host, and its place in the full tensor takes an
index of one dimension, never one of the parameter's size.

On a real GPU ``distribute_tensor`` of a host tensor first copies all of it to the
device (a 128k x 8k fp32 embedding: 4.2 GB per TP rank at start-up), and a full-size
int64 index of such a parameter is 8.4 GB, made inside a backward hook. Both tests run
on two gloo ranks with the placements potluck's TP uses (uneven vocabulary rows, GPT-2's
fused QKV, column shards, replicated norms); see ``shard_workers``.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import shard_workers as workers
from dist_harness import run_ranks
from runtime_helpers import TINY_LLAMA, make_plan, pipe, reference_losses, reference_model, run_plan


def _rows(out: Path) -> list[list[dict]]:
    return [json.loads((out / f"rank_{rank}.json").read_text()) for rank in range(2)]


def test_materialize_moves_only_each_ranks_shard_to_the_device(tmp_path: Path):
    run_ranks(workers.materialize_on_fake_gpu, 2, tmp_path, timeout_s=60)
    for rows in _rows(tmp_path):
        for row in rows:
            assert row["moved"], f"{row['name']}: nothing reached the device"
            assert max(row["moved"]) <= row["local"], (
                f"{row['name']}: {max(row['moved'])} elements moved to the device for a "
                f"shard of {row['local']}")


def test_a_full_layout_bucket_makes_no_parameter_sized_index(tmp_path: Path):
    run_ranks(workers.full_layout_round_trip, 2, tmp_path, timeout_s=60)
    for rows in _rows(tmp_path):
        for row in rows:
            made = [(dtype, size) for dtype, size in row["made"]]
            indices = [size for dtype, size in made if dtype == "torch.int64"]
            assert max(indices, default=0) <= row["largest_dim"], (
                f"{row['name']}: an int64 index of {max(indices)} elements")
            flat = [size for _, size in made if size == row["full"]]
            others = [size for _, size in made if size != row["full"]]
            assert len(flat) == 1, f"{row['name']}: {len(flat)} full-size tensors, not one"
            assert max(others, default=0) <= row["local"]


def test_a_model_with_real_weights_keeps_them_under_tensor_parallelism():
    """Its weights are parked on the host before TP shards the model (seed 1's weights,
    not the seed-0 initial values the run would otherwise draw)."""
    plan = make_plan(TINY_LLAMA, [pipe([(2, (0, 4))], 2, 1)])
    factory = partial(reference_model, TINY_LLAMA, 1)
    expected = reference_losses(TINY_LLAMA, 2, steps=2, model=reference_model(TINY_LLAMA, 1))
    assert run_plan(plan, steps=2, model_factory=factory) == pytest.approx(expected, abs=2e-5)
