"""An elastic run of islands on four CPU ranks: a rank killed mid-run takes its whole island
out; the other island keeps its layout, takes over the lost island's rows and resumes from
the newest checkpoint, a consensus state of the islands."""

import json
import shutil

import pytest
from island_workers import split
from runtime_helpers import TINY_LLAMA, make_plan, pipe

from potluck.errors import ConfigError
from potluck.plans import load_plan
from potluck.runtime.elastic.drills import check_elastic
from potluck.runtime.elastic.pool import without_lost_islands
from potluck.runtime.elastic.replans import read_replans
from potluck.runtime.options import TrainOptions
from potluck.runtime.training import train

REPLICAS = make_plan(TINY_LLAMA, [pipe([(1, (0, 4))], 1, 1)] * 4)
ISLANDS = split(REPLICAS, (0, 1), (2, 3), inner_steps=2)  # DiLoCo every 2 steps
STEPS = 6


def _options(run, **fields):
    return TrainOptions(out_dir=str(run), checkpoint_every=2, progress=False, lr=3e-3,
                        **fields)


def _losses(run):
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows}, [row["step"] for row in rows]


def test_an_island_that_lost_a_device_leaves_whole_and_the_others_take_its_rows():
    three = split(make_plan(TINY_LLAMA, [pipe([(1, (0, 4))], 1, 2)] * 3), (0,), (1,), (2,),
                  inner_steps=2)
    smaller = without_lost_islands(three, set(three.devices) - {"cpu.0:1"})
    assert [s.devices for p in smaller.pipelines for s in p.stages] == [("cpu.0:0",),
                                                                       ("cpu.0:2",)]
    assert [p.batch_share for p in smaller.pipelines] == [3, 3]  # the global batch stays 6
    assert [i.pipelines for i in smaller.islands.islands] == [(0,), (1,)]
    assert smaller.notes[-1] == "elastic: island(s) 1 lost a device and left; the others " \
        "took over their rows"
    alone = without_lost_islands(ISLANDS, set(ISLANDS.devices) - {"cpu.0:2"})
    assert not alone.islands.split and [p.batch_share for p in alone.pipelines] == [2, 2]


def test_a_killed_rank_takes_its_island_out_and_the_run_resumes_from_a_consensus(tmp_path):
    run = tmp_path / "killed"
    train(ISLANDS, _options(run, steps=STEPS, elastic=True, inject_failure="3@3",
                            keep_checkpoints=0))
    (replan,) = read_replans(run)
    assert replan["reason"] == "lost" and replan["step"] == 2
    assert replan["new_devices"] == ["cpu.0:0", "cpu.0:1"]  # island 0, whole
    losses, steps = _losses(run)
    assert steps == list(range(STEPS))
    after = load_plan(run / "plan.json")
    assert not after.islands.split and after.training.global_batch == 4

    plain = tmp_path / "plain"
    shutil.copytree(run / "checkpoints" / "step_000002", plain / "checkpoints" / "step_000002")
    train(after, _options(plain, steps=STEPS, resume=True))
    resumed, _ = _losses(plain)
    for step in range(2, STEPS):
        assert resumed[step] == pytest.approx(losses[step], rel=1e-5), step


def test_an_elastic_run_of_fragments_is_refused_in_one_line(tmp_path):
    fragments = split(REPLICAS, (0, 1), (2, 3), inner_steps=2, fragments=2)
    with pytest.raises(ConfigError, match="2 fragments never make"):
        check_elastic(fragments, _options(tmp_path, elastic=True))
