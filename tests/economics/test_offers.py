"""Offers files: what a valid one means, and one clear line, with file and line, for a bad one."""

from __future__ import annotations

import pytest

from potluck.cluster.catalog import catalog
from potluck.cluster.spec import NvlinkTopology
from potluck.economics.offers import catalog_offers, gpu_counts, load_offers, parse_offers
from potluck.economics.prices import Pricing, cluster_usd_per_hour
from potluck.errors import ConfigError

GOOD = """\
offers:
  - name: pairs
    gpu: rtx3090
    gpus_per_node: 4
    nodes: 2
    nvlink: pairs
    network: 25Gb/s
    price_per_hour: 0.5
    source: "a seller, 2026-05"
  - gpu: rtx4090
    gpus_per_node: 8
"""


def test_an_offer_becomes_a_one_group_cluster_with_its_prices():
    pairs, plain = parse_offers(GOOD)
    group = pairs.group
    assert (group.gpu, group.gpus_per_node, group.count) == ("rtx3090", 4, 2)
    assert group.nvlink is NvlinkTopology.PAIRS
    assert group.inter_bandwidth_bytes_per_s == pytest.approx(25e9 / 8)
    assert pairs.num_gpus == 8
    assert cluster_usd_per_hour(pairs.spec, Pricing()) == pytest.approx(8 * 0.5)
    assert pairs.spec.device_type("rtx3090").sources["price_per_hour"] == "a seller, 2026-05"
    assert pairs.source == "a seller, 2026-05"
    assert plain.name == "8x rtx4090"
    assert plain.source.startswith("catalog: RunPod")  # its prices are the catalog's
    catalog_price = catalog()["rtx4090"].price_per_hour_usd
    assert cluster_usd_per_hour(plain.spec, Pricing()) == pytest.approx(8 * catalog_price)


def test_an_offer_with_its_own_price_does_not_borrow_the_catalog_spot_price():
    pairs, plain = parse_offers(GOOD)
    with pytest.raises(ConfigError, match="spot_price_per_hour"):
        cluster_usd_per_hour(pairs.spec, Pricing(spot=True))
    assert cluster_usd_per_hour(plain.spec, Pricing(spot=True)) == pytest.approx(
        8 * catalog()["rtx4090"].spot_price_per_hour_usd)


def test_an_offer_with_prices_and_no_source_points_at_its_line():
    (offer,) = parse_offers("offers:\n  - {gpu: rtx4090, gpus_per_node: 2, power_w: 300}\n", "mine.yaml")
    assert offer.source == "mine.yaml:2"


def test_count_is_a_synonym_of_nodes():
    (offer,) = parse_offers("offers:\n  - {gpu: h100-sxm, gpus_per_node: 8, count: 2}\n")
    assert offer.num_gpus == 16
    assert offer.group.nvlink is NvlinkTopology.ALL  # SXM parts share an NVSwitch by default


BAD = [
    ("offers: []\n", 1, "offers: must be a non-empty list"),
    ("nodes: 3\n", 1, "unknown key"),
    ("offers:\n  - gpu: rtx9090\n    gpus_per_node: 2\n", 2, "unknown GPU type 'rtx9090'"),
    ("offers:\n  - gpu: rtx4090\n", 2, "gpus_per_node: is required"),
    ("offers:\n  - gpu: rtx4090\n    gpus_per_node: 0\n", 3, "gpus_per_node: must be a whole number"),
    ("offers:\n  - gpu: rtx4090\n    gpus_per_node: 2\n    nvlink: pairs\n", 4, "rtx4090 has no NVLink"),
    ("offers:\n  - gpu: rtx3090\n    gpus_per_node: 3\n    nvlink: pairs\n", 4, "pairs needs an even"),
    ("offers:\n  - gpu: rtx3090\n    gpus_per_node: 2\n    nvlink: some\n", 4, "must be none, pairs or all"),
    ("offers:\n  - gpu: rtx4090\n    gpus_per_node: 2\n    price_per_hour: -1\n", 4, "non-negative"),
    ("offers:\n  - gpu: rtx4090\n    gpus_per_node: 2\n    price_per_hour: cheap\n", 4, "non-negative"),
    ("offers:\n  - gpu: rtx4090\n    gpus_per_node: 2\n    price_per_hour: .nan\n", 4, "not a finite number"),
    ("offers:\n  - gpu: rtx4090\n    gpus_per_node: 2\n    pric_per_hour: 1\n", 4,
     "did you mean 'price_per_hour'"),
    ("offers:\n  - gpu: rtx4090\n    gpus_per_node: 2\n    network: fast\n", 4, "as a bandwidth"),
    ("offers:\n  - gpu: rtx4090\n    gpus_per_node: 2\n    nodes: 2\n    count: 2\n", 5, "not both"),
    ("offers:\n  - {gpu: rtx4090, gpus_per_node: 2}\n  - {gpu: rtx4090, gpus_per_node: 2}\n", 3,
     "already the name of offers[0]"),
    ("offers:\n  - rtx4090\n", 2, "must be a mapping"),
    ("offers:\n  - gpu: [rtx4090\n", 3, "malformed YAML"),
]


@pytest.mark.parametrize("text, line, message", BAD)
def test_a_bad_offers_file_is_one_line_with_file_and_line(write, text, line, message):
    path = write("offers.yaml", text)
    with pytest.raises(ConfigError) as caught:
        load_offers(path)
    error = str(caught.value)
    assert "\n" not in error
    assert error.startswith(f"{path}:{line}: ")
    assert message in error


def test_a_missing_offers_file_says_so(tmp_path):
    with pytest.raises(ConfigError, match="offers file .* not found"):
        load_offers(tmp_path / "nope.yaml")


def test_catalog_candidates_cover_every_gpu_with_its_native_interconnect():
    offers = catalog_offers(max_gpus=8)
    names = {o.group.gpu for o in offers}
    assert names == {name for name, t in catalog().items() if not t.is_cpu}
    assert all(o.num_gpus <= 8 for o in offers)
    by_name = {o.name: o for o in offers}
    assert by_name["8x rtx3090 nvlink-pairs"].group.nvlink is NvlinkTopology.PAIRS
    assert by_name["8x rtx4090"].group.nvlink is NvlinkTopology.NONE
    assert by_name["8x a100-80g-sxm nvlink"].group.nvlink is NvlinkTopology.ALL


def test_beyond_eight_gpus_catalog_candidates_are_several_machines():
    offers = catalog_offers(max_gpus=32, gpus=("h100-sxm",))
    assert [o.num_gpus for o in offers] == [1, 2, 4, 8, 16, 32]
    assert all(o.group.gpus_per_node <= 8 for o in offers)
    assert offers[-1].group.count == 4


def test_gpu_counts_are_powers_of_two_and_the_maximum_when_it_fits_whole_machines():
    assert gpu_counts(8) == [1, 2, 4, 8]
    assert gpu_counts(6) == [1, 2, 4, 6]
    assert gpu_counts(24) == [1, 2, 4, 8, 16, 24]
    assert gpu_counts(12) == [1, 2, 4, 8]
