"""Searches remembered by cluster shape: once per shape, each asker's plans on its own
cluster, exactly as a search of its own would make them."""

from __future__ import annotations

import pytest

from potluck.api import training_shape
from potluck.cluster.spec import parse_cluster
from potluck.errors import InfeasibleError
from potluck.model.loading import load_model
from potluck.multijob.allocations import Allocation, subcluster
from potluck.planner.options import SearchOptions
from potluck.planner.requests.memo import PlanMemo
from potluck.planner.search import search

RACKS = """
name: two-racks
nodes:
  - {name: rack-a, gpu: rtx3090, gpus_per_node: 2, nvlink: pairs}
  - {name: rack-b, gpu: rtx3090, gpus_per_node: 2, nvlink: pairs}
  - {name: odd, gpu: rtx4090, gpus_per_node: 2}
"""
OPTIONS = SearchOptions(top_k=2)


@pytest.fixture
def racks():
    return parse_cluster(RACKS)


@pytest.fixture
def job():
    model = load_model("gpt3-125m")
    return model, training_shape(model, 16, 1024)


def on(spec, group):
    return subcluster(spec, Allocation(((group, 1),)))


def test_groups_built_alike_are_searched_once_and_planned_on_their_own_devices(racks, job):
    memo = PlanMemo()
    memo.search(on(racks, "rack-a"), *job, OPTIONS)
    got = memo.search(on(racks, "rack-b"), *job, OPTIONS)
    assert (memo.searches, memo.reused) == (1, 1)
    assert got.plans == search(on(racks, "rack-b"), *job, OPTIONS).plans
    assert all(device.startswith("rack-b.0:") for device in got.best.devices)


def test_another_shape_is_searched_again(racks, job):
    memo = PlanMemo()
    memo.search(on(racks, "rack-a"), *job, OPTIONS)
    memo.search(on(racks, "odd"), *job, OPTIONS)
    memo.search(on(racks, "rack-a"), *job, SearchOptions(top_k=1))
    assert memo.searches == 3


def test_a_shape_that_fits_nowhere_raises_its_explanation_each_time(racks):
    memo, model = PlanMemo(), load_model("llama2-70b")
    shape = training_shape(model)
    messages = []
    for group in ("rack-a", "rack-b"):
        with pytest.raises(InfeasibleError) as info:
            memo.search(on(racks, group), model, shape, OPTIONS)
        messages.append(str(info.value))
    assert memo.searches == 1 and messages[0] == messages[1] and "add at least" in messages[0]
