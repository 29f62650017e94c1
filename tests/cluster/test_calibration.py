"""The calibration section of a cluster file changes the cost model's inputs, never its shape."""

from __future__ import annotations

import pytest

from potluck.cluster.spec import parse_cluster
from potluck.cluster.topology import Cluster
from potluck.errors import ConfigError
from potluck.model.counts import Recompute
from potluck.model.loading import load_model
from potluck.planner.cost import CostModel

BASE = """
nodes:
  - name: box3090
    gpu: rtx3090
    gpus_per_node: 4
    count: 2
    nvlink: pairs
  - name: a100
    gpu: a100-80g-sxm
    gpus_per_node: 2
"""

CALIBRATED = BASE + """
calibration:
  source: potluck profile (test)
  devices:
    rtx3090:
      matmul_efficiency: 0.5
      memory_bandwidth_factor: 0.5
      measured: {tflops_bf16: 35.5}
  links:
    - kind: pcie
      groups: [box3090]
      bandwidth: 3GB/s
      latency: 50us
    - kind: nvlink
      bandwidth: 40GB/s
    - kind: network
      bandwidth: 5Gb/s
      latency: 1ms
    - between: [box3090, a100]
      bandwidth: 1Gb/s
      latency: 20ms
"""


def _links(text: str) -> dict[str, object]:
    cluster = Cluster(parse_cluster(text))
    d = {device.id: device for device in cluster.devices}
    return {
        "pcie": cluster.link(d["box3090.0:0"], d["box3090.0:2"]),
        "bridge": cluster.link(d["box3090.0:0"], d["box3090.0:1"]),
        "network": cluster.link(d["box3090.0:0"], d["box3090.1:0"]),
        "between": cluster.link(d["box3090.0:0"], d["a100.0:0"]),
        "switch": cluster.link(d["a100.0:0"], d["a100.0:1"]),
    }


def test_device_figures_are_replaced_and_scaled() -> None:
    before = parse_cluster(BASE).device_type("rtx3090")
    after = parse_cluster(CALIBRATED).device_type("rtx3090")
    assert after.matmul_efficiency == 0.5
    assert after.memory_bandwidth_bytes_per_s == pytest.approx(0.5 * before.memory_bandwidth_bytes_per_s)
    assert after.sources["matmul_efficiency"] == "potluck profile (test)"
    assert parse_cluster(CALIBRATED).device_type("a100-80g-sxm") == \
        parse_cluster(BASE).device_type("a100-80g-sxm")


def test_links_take_the_measured_bandwidth_and_latency() -> None:
    links = _links(CALIBRATED)
    figures = {name: (link.bandwidth_bytes_per_s, link.latency_s) for name, link in links.items()}
    assert figures["pcie"] == pytest.approx((3e9, 50e-6))
    assert figures["bridge"][0] == pytest.approx(40e9)
    assert figures["network"] == pytest.approx((5e9 / 8, 1e-3))
    assert figures["between"] == pytest.approx((1e9 / 8, 0.02))
    assert figures["switch"][0] == pytest.approx(40e9)  # NVSwitch: every pair is NVLink


def test_calibration_changes_predictions_through_inputs_only() -> None:
    """Halving both the 3090's matmul efficiency and memory bandwidth doubles every roofline
    term of a block, so its time doubles exactly: same formulas, different inputs."""
    model = load_model("llama2-7b")
    half = parse_cluster(BASE).device_type("rtx3090").matmul_efficiency / 2  # the catalog's / 2
    times = []
    for text in (BASE, CALIBRATED.replace("matmul_efficiency: 0.5", f"matmul_efficiency: {half}")):
        spec = parse_cluster(text)
        cost = CostModel(Cluster(spec), model, 4096)
        times.append(cost.block_times(spec.device_type("rtx3090"), 1, 2, Recompute.NONE))
    assert times[1].forward_s == pytest.approx(2 * times[0].forward_s)
    assert times[1].backward_s == pytest.approx(2 * times[0].backward_s)


def test_a_calibrated_cluster_round_trips_through_a_plan_file() -> None:
    from potluck.plans import Pipeline, Plan, Stage, TrainingShape, plan_from_dict, plan_to_dict

    spec = parse_cluster(CALIBRATED)
    plan = Plan(spec, load_model("tiny-llama"), TrainingShape(2, 64),
                (Pipeline((Stage(("box3090.0:0",), ((0, 4),)),), 1, 2),))
    again = plan_from_dict(plan_to_dict(plan))
    assert again.cluster == spec and again.cluster.calibration.source == "potluck profile (test)"


@pytest.mark.parametrize(("section", "message"), [
    ("  devices:\n    rtx4090: {matmul_efficiency: 0.5}\n", "no device type 'rtx4090'"),
    ("  devices:\n    rtx3090: {matmul_efficiency: -1}\n", "positive number"),
    ("  links:\n    - kind: infiniband\n      bandwidth: 1GB/s\n", "pcie, nvlink, network"),
    ("  links:\n    - between: [box3090, nowhere]\n      bandwidth: 1GB/s\n", "no node group"),
    ("  speed: fast\n", "unknown key"),
])
def test_mistakes_are_one_line_with_the_file_line(section: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        parse_cluster(BASE + "calibration:\n" + section, "c.yaml")
    assert str(err.value).startswith("c.yaml:") and "\n" not in str(err.value)
