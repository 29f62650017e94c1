"""The plan a scheduled job runs is the one ``potluck plan`` picks on its allocation: the
policies compare allocations by the first memory level's plans, but the allocation a job
is given is searched through every level (issue 29: the two disagreed on a lab)."""

from __future__ import annotations

import pytest

from potluck.cluster import parse_cluster
from potluck.model import load_model
from potluck.multijob import JobShape, ThroughputTable
from potluck.multijob.allocations import whole_cluster
from potluck.planner.options import SearchOptions
from potluck.planner.search import search
from potluck.plans import TrainingShape

BOX = parse_cluster("nodes:\n  - {name: r, gpu: rtx3090, gpus_per_node: 4, nvlink: pairs}\n",
                    "box.yaml")


def test_a_job_runs_the_plan_potluck_plan_picks_on_its_allocation():
    """4 RTX 3090s, llama2-7b: the first level's plan is slower than the sharded one."""
    shape = JobShape(load_model("llama2-7b"), TrainingShape(32, 2048))
    table = ThroughputTable(BOX)
    allocation = whole_cluster(BOX)
    first = table.planned(shape, allocation)
    running = table.running(shape, allocation)
    best = search(BOX, shape.model, shape.training, SearchOptions(top_k=1)).best
    assert first.plan is not None and running.plan is not None
    assert running.plan.prediction.iteration_time_s == pytest.approx(
        best.prediction.iteration_time_s)
    assert running.tokens_per_s > first.tokens_per_s  # the case this test is about
    assert table.plan(shape, allocation) is running.plan
