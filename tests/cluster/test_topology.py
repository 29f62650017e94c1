"""Devices and the link between any two of them."""

import pytest

from potluck.cluster import Cluster, PathKind, parse_cluster

LAB = """
nodes:
  - {name: box3090, gpu: rtx3090, gpus_per_node: 4, count: 2, nvlink: pairs, inter_bandwidth: 10Gb/s}
  - {name: a100, gpu: a100-80g-sxm, gpus_per_node: 2, inter_bandwidth: 100Gb/s}
  - {name: far, gpu: rtx4090, gpus_per_node: 1, inter_bandwidth: 10Gb/s}
links:
  - {between: [box3090, far], bandwidth: 1Gb/s, latency: 20ms}
"""


@pytest.fixture
def cluster():
    return Cluster(parse_cluster(LAB))


def test_device_ids_name_group_machine_and_gpu(cluster):
    ids = [d.id for d in cluster.devices]
    assert ids[:5] == ["box3090.0:0", "box3090.0:1", "box3090.0:2", "box3090.0:3", "box3090.1:0"]
    assert len(ids) == 11
    assert cluster.device("a100.0:1").type.name == "a100-80g-sxm"


def test_bridged_pairs_use_nvlink_and_other_pairs_pcie(cluster):
    d = cluster.by_id
    bridged = cluster.link(d["box3090.0:0"], d["box3090.0:1"])
    across_pairs = cluster.link(d["box3090.0:1"], d["box3090.0:2"])
    assert bridged.kind is PathKind.NVLINK and bridged.bandwidth_bytes_per_s == 53e9
    assert across_pairs.kind is PathKind.PCIE
    assert across_pairs.bandwidth_bytes_per_s < bridged.bandwidth_bytes_per_s


def test_nvswitch_nodes_join_every_pair(cluster):
    link = cluster.link(cluster.by_id["a100.0:0"], cluster.by_id["a100.0:1"])
    assert link.kind == "nvlink" and link.bandwidth_bytes_per_s == 230e9


def test_between_machines_the_slower_network_card_limits(cluster):
    link = cluster.link(cluster.by_id["box3090.0:0"], cluster.by_id["a100.0:0"])
    assert link.kind == "network" and link.bandwidth_bytes_per_s == 1.25e9


def test_declared_links_override_the_network(cluster):
    link = cluster.link(cluster.by_id["box3090.1:3"], cluster.by_id["far.0:0"])
    assert link.kind == "declared"
    assert link.bandwidth_bytes_per_s == 125e6 and link.latency_s == pytest.approx(0.02)


def test_path_kinds_keep_the_names_files_and_messages_use(cluster):
    assert [kind.value for kind in PathKind] == ["local", "nvlink", "pcie", "network", "declared"]
    same = cluster.by_id["far.0:0"]
    assert cluster.link(same, same).kind == "local"  # a str enum: equal to its name
