"""Devices that join a plan of islands become an island of their own: the islands there keep
their layouts, the rows of the global batch follow the islands' throughput, and the run goes
on from a consensus checkpoint under the new split."""

import json
import logging
import shutil
from dataclasses import replace

import pytest
from island_workers import split
from runtime_helpers import TINY_LLAMA, make_plan, pipe

from potluck import api
from potluck.cluster.spec import parse_cluster
from potluck.planner.evaluate import predict
from potluck.planner.search import search
from potluck.plans import Transport, check_plan, load_plan
from potluck.plans.vendors import vendors_problem
from potluck.runtime.elastic.joins import register
from potluck.runtime.elastic.pool import on_whole_cluster, plan_for_devices, present_cluster
from potluck.runtime.elastic.replans import read_replans
from potluck.runtime.options import TrainOptions
from potluck.runtime.training import train

POOL = parse_cluster("""
nodes:
  - {name: desk, gpu: rtx3090, gpus_per_node: 1, count: 2, inter_bandwidth: 1Gb/s}
  - {name: big, gpu: a100-80g-pcie, gpus_per_node: 2}
  - {name: small, gpu: rtx2080, gpus_per_node: 1}
  - {name: amd, gpu: mi250, gpus_per_node: 2}
links:
  - {between: [desk, big], bandwidth: 1Gb/s}
  - {between: [desk, small], bandwidth: 1Gb/s}
  - {between: [desk, amd], bandwidth: 1Gb/s}
""", "pool.yaml")
DESKS = ("desk.0:0", "desk.1:0")
BIG = ("big.0:0", "big.0:1")


def _desk_islands(model="gpt3-125m"):
    """The planner's two DiLoCo islands of the two desktops, on the whole pool's cluster."""
    cut = present_cluster(POOL, DESKS)
    best = api.plan(cut.spec, model, options=api.search_options(sync="diloco"),
                    global_batch=32, seq_len=1024).best
    return on_whole_cluster(best, POOL, cut.original_id)


def _island_rows(plan):
    return [sum(plan.pipelines[k].batch_share for k in plan.islands.members(i, plan.dp))
            for i in range(plan.islands.count)]


def _island_stages(plan, island):
    return [p.stages for k, p in enumerate(plan.pipelines)
            if k in plan.islands.members(island, plan.dp)]


def test_devices_that_join_islands_become_an_island_of_their_own():
    plan = _desk_islands()
    assert plan.islands.count == 2
    new = plan_for_devices(plan, (*DESKS, *BIG))

    assert new.islands.count == 3
    for island in (0, 1):  # the desktops' islands as they were laid out
        assert _island_stages(new, island) == _island_stages(plan, island)
    joined = {d for k in new.islands.members(2, new.dp) for d in new.pipelines[k].devices}
    assert joined == set(BIG) and set(new.unused_devices) == {"small.0:0", "amd.0:0",
                                                             "amd.0:1"}
    rows = _island_rows(new)
    assert sum(rows) == 32 and rows[0] == rows[1] and rows[2] > 4 * rows[0]  # two A100s
    assert replace(new.islands, islands=()) == replace(plan.islands, islands=())  # H, ...
    assert new.notes[-1] == (f"elastic: big.0:0, big.0:1 joined as island 2, {rows[2]} rows "
                             "of each batch of 32")
    check_plan(new)
    assert new.prediction == predict(new)
    assert new.prediction.iteration_time_s < plan.prediction.iteration_time_s


def test_an_island_that_lost_a_device_leaves_while_the_joined_ones_make_an_island():
    plan = _desk_islands()
    new = plan_for_devices(plan, ("desk.0:0", *BIG))  # desk.1 went, the A100s came

    assert new.islands.count == 2 and "desk.1:0" in new.unused_devices
    assert _island_stages(new, 0) == _island_stages(plan, 0)
    assert {d for k in new.islands.members(1, new.dp) for d in new.pipelines[k].devices} \
        == set(BIG)
    assert sum(_island_rows(new)) == 32


def test_an_island_of_another_vendor_meets_the_others_through_host_memory():
    plan = _desk_islands()
    new = plan_for_devices(plan, (*DESKS, "amd.0:0", "amd.0:1"))

    assert new.islands.count == 3
    assert [i.transport for i in new.islands.islands] == [Transport.HOST] * 3
    assert vendors_problem(new) is None


def test_joined_devices_too_small_for_the_model_are_planned_with_the_whole_pool(caplog):
    plan = _desk_islands("gpt3-1.3b")
    present = (*DESKS, "small.0:0")
    with caplog.at_level(logging.WARNING, logger="potluck.runtime.elastic.pool"):
        new = plan_for_devices(plan, present)

    cut = present_cluster(POOL, present)
    whole = on_whole_cluster(search(cut.spec, plan.model, plan.training).best, POOL,
                             cut.original_id)
    assert new == whole
    (line,) = caplog.messages
    assert "make no island of their own" in line and "gpt3-1.3b" in line
    assert "planning the whole pool of 3 devices" in line


def test_an_island_that_would_get_fewer_rows_than_pipelines_falls_back_to_the_whole_pool(
        caplog):
    one_row_each = split(make_plan(TINY_LLAMA, [pipe([(1, (0, 4))], 1, 1)] * 4), (0, 1),
                         (2, 3), inner_steps=2)
    present = [f"cpu.0:{i}" for i in range(6)]
    with caplog.at_level(logging.WARNING, logger="potluck.runtime.elastic.pool"):
        new = plan_for_devices(one_row_each, present)

    assert not new.islands.split and new.training.global_batch == 4
    (line,) = caplog.messages
    assert "would get 1 of the 4 rows of each batch for its 2 pipelines" in line


def test_a_device_that_joins_an_islands_run_trains_on_as_a_third_island(tmp_path):
    """Two DiLoCo islands of two CPU ranks each train 4 steps; two more ranks join before
    the run goes on, as a third island, from the consensus checkpoint of step 4."""
    plan = split(make_plan(TINY_LLAMA, [pipe([(1, (0, 4))], 1, 3)] * 4), (0, 1), (2, 3),
                 inner_steps=2)
    run = tmp_path / "run"
    options = TrainOptions(out_dir=str(run), checkpoint_every=2, progress=False, lr=3e-3)
    train(plan, replace(options, steps=4))
    register(run, plan, ["cpu.0:4", "cpu.0:5"])
    train(plan, replace(options, steps=6, elastic=True, resume=True))

    (replan,) = read_replans(run)
    assert replan["reason"] == "joined" and replan["step"] == 4 and replan["steps_lost"] == 0
    after = load_plan(run / "plan.json")
    assert after.islands.count == 3 and after.islands.split
    assert [p.stages for p in after.pipelines[:4]] == [p.stages for p in plan.pipelines]
    assert set(after.devices) == {f"cpu.0:{i}" for i in range(6)}
    assert sum(_island_rows(after)) == 12
    losses = _losses(run)
    assert sorted(losses) == list(range(6))

    plain = tmp_path / "plain"  # the same split from the same consensus checkpoint
    shutil.copytree(run / "checkpoints" / "step_000004", plain / "checkpoints" / "step_000004")
    train(after, replace(options, out_dir=str(plain), steps=6, resume=True))
    resumed = _losses(plain)
    for step in (4, 5):
        assert resumed[step] == pytest.approx(losses[step], rel=1e-5), step


def _losses(run):
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows}
