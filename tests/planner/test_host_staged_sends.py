"""A pipeline whose stages span vendors stages every stage-to-stage transfer through host
memory: the cost model's send and the simulator's flow both add the sender's copy to its host
and the receiver's copy from its host, each over that device's host link (a CPU copies
nothing), and a pipeline of one vendor pays none of it."""

from __future__ import annotations

import pytest

from potluck.cluster import Cluster, parse_cluster
from potluck.model.spec import PRESETS
from potluck.planner.cost import CostModel
from potluck.planner.evaluate import stage_send_s
from potluck.planner.network import NicSharing, host_staging_s
from potluck.plans import Pipeline, Plan, Stage, TrainingShape
from potluck.sim.network import Network
from potluck.sim.program import boundary_flows
from potluck.sim.workload import plan_workloads

CLUSTER = parse_cluster("""
nodes:
  - {name: nv, gpu: rtx4090, gpus_per_node: 2, host_bandwidth: 8GB/s}
  - {name: amd, gpu: mi250, gpus_per_node: 1, host_bandwidth: 20GB/s}
  - {name: box, gpu: cpu, gpus_per_node: 1}
""", "three-vendors.yaml")
MODEL = PRESETS["tiny-llama"]


def _pipeline(*devices: str) -> Plan:
    per_stage = MODEL.num_layers // len(devices)
    stages = tuple(Stage((d,), ((i * per_stage, (i + 1) * per_stage),))
                   for i, d in enumerate(devices))
    return Plan(CLUSTER, MODEL, TrainingShape(4, 128), (Pipeline(stages, 1, 4),))


@pytest.mark.parametrize("receiver, copies", [
    ("amd.0:0", ("nv.0:0", "amd.0:0")),  # two GPUs: a copy down and a copy up
    ("box.0:0", ("nv.0:0",)),  # the CPU box receives in host memory already
])
def test_a_send_across_vendors_pays_each_gpus_copy_over_its_host_link(receiver, copies):
    plan = _pipeline("nv.0:0", receiver)
    cost, cluster = CostModel.for_plan(plan), Cluster(CLUSTER)
    a, b = cluster.device("nv.0:0"), cluster.device(receiver)
    num_bytes = cost.send_bytes(a.type, 1)
    expected = sum(num_bytes / cluster.host_bandwidth_bytes_per_s(cluster.device(d))
                   for d in copies)
    assert host_staging_s(cluster, a, b, num_bytes) == pytest.approx(expected)
    sharing = NicSharing.of_pipelines([[(a,), (b,)]])
    over_the_link = cost.send_s((a,), (b,), 1, sharing)
    assert stage_send_s(plan, 0, 0, 1) == pytest.approx(over_the_link + expected)


def test_a_pipeline_of_one_vendor_sends_over_the_link_alone():
    plan = _pipeline("nv.0:0", "nv.0:1")
    cost, cluster = CostModel.for_plan(plan), Cluster(CLUSTER)
    a, b = cluster.device("nv.0:0"), cluster.device("nv.0:1")
    assert stage_send_s(plan, 0, 0, 1) == pytest.approx(cost.send_s((a,), (b,), 1))


def test_the_simulator_starts_a_host_staged_transfer_late_by_the_same_copies():
    plan, one_vendor = _pipeline("nv.0:0", "amd.0:0"), _pipeline("nv.0:0", "nv.0:1")
    cost, cluster = CostModel.for_plan(plan), Cluster(CLUSTER)
    (work,) = plan_workloads(plan, cost)
    flow = boundary_flows(work, 1, Network(cluster))[(0, 1)]
    a, b = cluster.device("nv.0:0"), cluster.device("amd.0:0")
    link = cluster.link(a, b)
    assert flow.latency_s == pytest.approx(
        link.latency_s + host_staging_s(cluster, a, b, flow.lane_bytes))
    (plain,) = plan_workloads(one_vendor, CostModel.for_plan(one_vendor))
    plain_flow = boundary_flows(plain, 1, Network(cluster))[(0, 1)]
    assert plain_flow.latency_s == cluster.link(a, cluster.device("nv.0:1")).latency_s
