"""Planning for the devices that are left: the cluster cut down to them, and the plan
moved back onto the whole cluster under the devices' own ids."""

import pytest

from potluck.cluster.nodes import NvlinkTopology
from potluck.cluster.spec import load_cluster, parse_cluster
from potluck.cluster.topology import Cluster
from potluck.errors import ConfigError
from potluck.examples import example_path
from potluck.model.loading import load_model
from potluck.planner.evaluate import predict
from potluck.planner.search import search
from potluck.plans import TrainingShape
from potluck.runtime.elastic.pool import plan_for_devices, present_cluster

LINKED = """
nodes:
  - {name: a, gpu: rtx3090, gpus_per_node: 4, count: 3, nvlink: pairs}
  - {name: b, gpu: rtx4090, gpus_per_node: 2}
links:
  - {between: [a, b], bandwidth: 1Gb/s}
"""


def _groups(cut):
    return {g.name: (g.count, g.gpus_per_node, g.nvlink) for g in cut.spec.nodes}


def test_a_machine_that_lost_gpus_is_planned_as_the_smaller_machine_it_is():
    spec = parse_cluster(LINKED)
    every = [d.id for d in Cluster(spec).devices]
    cut = present_cluster(spec, [d for d in every if d not in ("a.1:2", "a.2:1")])
    assert _groups(cut) == {
        "a": (1, 4, NvlinkTopology.PAIRS),  # machines 0 (whole)
        "a-1": (1, 3, NvlinkTopology.PAIRS),  # 0,1 | 3: the bridged pair (0,1) is still one
        "a-2": (1, 3, NvlinkTopology.NONE),  # 0 | 2,3 renumbered 0,1,2: (0,2) is no pair
        "b": (1, 2, NvlinkTopology.NONE),
    }
    assert cut.original_id["a-1.0:2"] == "a.1:3" and cut.original_id["a-2.0:1"] == "a.2:2"
    assert cut.original_id["a.0:3"] == "a.0:3"
    assert sorted(tuple(sorted(link.between)) for link in cut.spec.links) == [
        ("a", "b"), ("a-1", "b"), ("a-2", "b")]


def test_whole_machines_of_a_group_stay_one_group_and_keep_their_ids():
    spec = parse_cluster(LINKED)
    cut = present_cluster(spec, [d.id for d in Cluster(spec).devices if not d.id.startswith("a.1")])
    assert _groups(cut)["a"] == (2, 4, NvlinkTopology.PAIRS)
    assert cut.original_id["a.1:0"] == "a.2:0"  # the group's second machine left is machine 2


def test_the_new_plan_runs_the_devices_left_under_their_ids_with_its_own_prediction():
    spec = load_cluster(example_path("mixed.yaml"))
    plan = search(spec, load_model("gpt3-1.3b"), TrainingShape(32, 2048)).best
    lost = plan.devices[0]
    new = plan_for_devices(plan, set(plan.devices) - {lost})
    assert lost not in new.devices and lost in new.unused_devices
    assert new.cluster == plan.cluster
    assert set(new.devices) | set(new.unused_devices) == {d.id for d in Cluster(spec).devices}
    assert new.prediction == predict(new)


def test_an_unknown_device_is_one_line():
    with pytest.raises(ConfigError, match="device 'z.0:0' is not in cluster"):
        present_cluster(parse_cluster(LINKED), ["z.0:0"])
