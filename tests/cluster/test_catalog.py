"""The device catalog holds every GPU the issue names, each figure with a source."""

import pytest

from potluck.cluster.catalog import LinkKind, catalog

REQUIRED = [
    "cpu", "rtx3090", "rtx3090ti", "rtx4090", "rtx5090", "a100-40g-pcie", "a100-80g-pcie",
    "a100-80g-sxm", "h100-pcie", "h100-sxm", "v100-16g", "v100-32g", "t4", "a10", "l4", "l40s",
    "rtx-a6000", "mi250", "mi300x",
]


def test_every_required_device_is_in_the_catalog():
    assert set(REQUIRED) <= set(catalog())


@pytest.mark.parametrize("name", REQUIRED)
def test_each_entry_has_figures_and_sources(name):
    device = catalog()[name]
    assert device.tflops > 0 and device.memory_bytes > 0
    assert device.memory_bandwidth_bytes_per_s > 0
    assert 0 < device.matmul_efficiency <= 1
    assert device.price_per_hour_usd > 0 and device.purchase_price_usd > 0
    assert device.power_w > 0
    assert device.sources, f"{name} has no sources"


@pytest.mark.parametrize(
    ("name", "tflops", "memory_gb"),
    [("rtx3090", 71, 24), ("rtx4090", 165.2, 24), ("a100-80g-sxm", 312, 80),
     ("h100-sxm", 989, 80), ("t4", 65, 16), ("l40s", 362, 48), ("mi300x", 1307, 192)],
)
def test_figures_match_the_reference_sheet(name, tflops, memory_gb):
    device = catalog()[name]
    assert device.tflops == pytest.approx(tflops)
    assert device.memory_bytes == pytest.approx(memory_gb * 1e9)


def test_links_and_bf16():
    assert catalog()["rtx3090"].link is LinkKind.NVLINK_BRIDGE
    assert catalog()["rtx4090"].link is LinkKind.NONE
    assert catalog()["a100-80g-sxm"].link is LinkKind.NVLINK
    assert not catalog()["v100-32g"].bf16 and not catalog()["t4"].bf16
    assert catalog()["a100-80g-sxm"].bf16


def test_raw_compute_per_dollar_ranks_the_4090_above_the_a100():
    """The seed talk's RCC observation follows from the catalog prices."""
    def rcc(name: str) -> float:
        return catalog()[name].tflops / catalog()[name].price_per_hour_usd

    assert rcc("rtx4090") > rcc("a100-80g-sxm")
