"""Cluster files: the minimal form from the issue, NVLink pairs, and errors that point at lines."""

import pytest

from potluck.cluster import Cluster, NvlinkTopology, load_cluster, parse_cluster
from potluck.errors import ConfigError

ISSUE_EXAMPLE = """\
nodes:
  - name: box3090
    gpu: rtx3090            # catalog name or a custom type from `devices:`
    gpus_per_node: 4
    count: 2                # identical nodes in this group (default 1)
    intra_bandwidth: 25GB/s # GPU<->GPU inside a node (default from the catalog)
    inter_bandwidth: 10Gb/s # this node's network bandwidth
  - name: boxa100
    gpu: a100-80g-sxm
    gpus_per_node: 8
    inter_bandwidth: 100Gb/s
devices:                    # optional custom device types
  my-gpu: {tflops: 100, memory: 24GB, price_per_hour: 0.5}
links:                      # optional slower/faster links between node groups
  - between: [box3090, boxa100]
    bandwidth: 1Gb/s
    latency: 20ms
"""


def test_the_minimal_form_from_the_issue_is_accepted():
    spec = parse_cluster(ISSUE_EXAMPLE)
    box3090, boxa100 = spec.nodes
    assert (box3090.gpu, box3090.gpus_per_node, box3090.count) == ("rtx3090", 4, 2)
    assert box3090.intra_bandwidth_bytes_per_s == 25e9
    assert box3090.inter_bandwidth_bytes_per_s == 1.25e9
    assert boxa100.count == 1 and boxa100.inter_bandwidth_bytes_per_s == 12.5e9
    assert boxa100.nvlink is NvlinkTopology.ALL  # SXM boards are NVSwitch-joined by default
    assert spec.links[0].bandwidth_bytes_per_s == 125e6
    assert spec.links[0].latency_s == pytest.approx(0.02)
    assert spec.num_gpus == 16


def test_read_from_a_file(tmp_path):
    path = tmp_path / "lab.yaml"
    path.write_text(ISSUE_EXAMPLE)
    spec = load_cluster(path)
    assert spec.name == "lab"
    assert len(Cluster(spec).devices) == 16


def test_custom_device_types_are_usable_and_carried_in_the_spec():
    spec = parse_cluster("""
nodes:
  - {name: lab, gpu: my-gpu, gpus_per_node: 2}
devices:
  my-gpu: {tflops: 100, memory: 24GB, price_per_hour: 0.5}
""")
    device_type = spec.device_type("my-gpu")
    assert device_type.tflops == 100 and device_type.memory_bytes == 24e9
    assert device_type.price_per_hour_usd == 0.5


def test_a_catalog_entry_can_be_overridden_by_name():
    spec = parse_cluster("""
nodes: [{name: a, gpu: rtx4090, gpus_per_node: 1}]
devices:
  rtx4090: {price_per_hour: 0.25}
""")
    device_type = spec.device_type("rtx4090")
    assert device_type.price_per_hour_usd == 0.25
    assert device_type.tflops == pytest.approx(165.2)


def test_nvlink_pairs_are_expressible():
    spec = parse_cluster("nodes: [{name: b, gpu: rtx3090, gpus_per_node: 4, nvlink: pairs}]")
    assert spec.nodes[0].nvlink is NvlinkTopology.PAIRS


def _error(text: str) -> str:
    with pytest.raises(ConfigError) as info:
        parse_cluster(text, "lab.yaml")
    return str(info.value)


def test_malformed_yaml_names_the_line():
    message = _error("nodes:\n  - name: a\n    gpu: [rtx3090\n")
    assert message.startswith("lab.yaml:") and "malformed YAML" in message


def test_unknown_gpu_suggests_close_names_and_points_at_its_line():
    message = _error("nodes:\n  - name: a\n    gpu: rtx3099\n    gpus_per_node: 2\n")
    assert message.startswith("lab.yaml:3:")
    assert "rtx3090" in message and "unknown GPU type" in message


def test_unknown_key_is_rejected_with_a_suggestion():
    message = _error("nodes:\n  - name: a\n    gpu: t4\n    gpus_per_nod: 2\n")
    assert message.startswith("lab.yaml:4:") and "gpus_per_node" in message


def test_bad_bandwidth_points_at_its_line():
    message = _error("nodes:\n  - name: a\n    gpu: t4\n    gpus_per_node: 1\n"
                     "    inter_bandwidth: fast\n")
    assert message.startswith("lab.yaml:5:") and "bandwidth" in message


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("nodes: []", "non-empty"),
        ("nodes:\n  - {name: a, gpu: t4}\n", "gpus_per_node: is required"),
        ("nodes:\n  - {name: a, gpu: t4, gpus_per_node: 0}\n", "at least 1"),
        ("nodes:\n  - {name: a, gpu: t4, gpus_per_node: 2, nvlink: pairs}\n", "no NVLink"),
        ("nodes:\n  - {name: a, gpu: t4, gpus_per_node: 1}\n  - {name: a, gpu: l4, gpus_per_node: 1}\n",
         "named 'a'"),
        ("nodes:\n  - {name: a, gpu: t4, gpus_per_node: 1}\nlinks:\n  - {between: [a, b], bandwidth: 1}\n",
         "no node group named 'b'"),
        ("nodes:\n  - {name: a, gpu: mine, gpus_per_node: 1}\ndevices:\n  mine: {tflops: 10}\n",
         "missing memory"),
        ("nodes:\n  - {name: box.1, gpu: t4, gpus_per_node: 1}\n", "cannot contain '.'"),
        ("nodes:\n  - {name: 'a:b', gpu: t4, gpus_per_node: 1}\n", "cannot contain ':'"),
        ("nodes:\n  - {name: my box, gpu: t4, gpus_per_node: 1}\n", "cannot contain a space"),
        ("nodes:\n  - {name: 'x;touch owned;', gpu: t4, gpus_per_node: 1}\n", "cannot contain a space, ';'"),
        ("nodes:\n  - {name: a, gpu: mine, gpus_per_node: 1}\ndevices:\n  'mine$(id)': {tflops: 10}\n",
         "device type name 'mine$(id)' cannot contain '$', '(', ')'"),
        ("nodes:\n  - {name: a, gpu: t4, gpus_per_node: 8, count: 4096}\n", "at most 16,384"),
        ("nodes:\n  - {name: a, gpu: t4, gpus_per_node: 1, count: 1e400}\n", "at least 1"),
        ("nodes:\n  - {name: a, gpu: t4, gpus_per_node: 1, inter_bandwidth: 1e400}\n", "not a finite"),
    ],
)
def test_invalid_clusters_are_explained_in_one_line(text, fragment):
    message = _error(text)
    assert fragment in message and "\n" not in message


def test_missing_cluster_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_cluster(tmp_path / "nope.yaml")
