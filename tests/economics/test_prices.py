"""What a GPU-hour costs: catalog prices, cluster-file overrides, the buy-mode formula."""

from __future__ import annotations

import pytest

from potluck.cluster.catalog import catalog
from potluck.cluster.spec import parse_cluster
from potluck.economics.prices import (
    HOURS_PER_YEAR,
    PriceMode,
    Pricing,
    cluster_usd_per_hour,
    devices_usd_per_hour,
    gpu_usd_per_hour,
)
from potluck.errors import ConfigError

BUY = PriceMode.BUY


def test_rent_on_demand_and_spot_come_from_the_catalog():
    rtx3090 = catalog()["rtx3090"]
    assert gpu_usd_per_hour(rtx3090, Pricing()) == rtx3090.price_per_hour_usd
    assert gpu_usd_per_hour(rtx3090, Pricing(spot=True)) == rtx3090.spot_price_per_hour_usd
    assert rtx3090.spot_price_per_hour_usd < rtx3090.price_per_hour_usd


def test_a_cluster_is_the_sum_of_its_gpus():
    spec = parse_cluster("""
nodes:
  - {name: a, gpu: rtx4090, gpus_per_node: 4, count: 2}
  - {name: b, gpu: a100-80g-sxm, gpus_per_node: 2}
""")
    expected = 8 * catalog()["rtx4090"].price_per_hour_usd + 2 * catalog()["a100-80g-sxm"].price_per_hour_usd
    assert cluster_usd_per_hour(spec, Pricing()) == pytest.approx(expected)


def test_a_node_group_price_overrides_the_catalog_in_both_rent_modes():
    spec = parse_cluster("nodes:\n  - {name: a, gpu: rtx4090, gpus_per_node: 2, price_per_hour: 1.25}\n")
    for pricing in (Pricing(), Pricing(spot=True)):
        assert cluster_usd_per_hour(spec, pricing) == pytest.approx(2.5)


def test_only_the_listed_devices_are_charged():
    spec = parse_cluster("nodes:\n  - {name: a, gpu: rtx4090, gpus_per_node: 4, price_per_hour: 2.0}\n")
    assert devices_usd_per_hour(spec, ("a.0:0", "a.0:3"), Pricing()) == pytest.approx(4.0)


def test_buying_spreads_the_purchase_over_the_training_hours_and_adds_electricity():
    # 8760 USD over one year of round-the-clock training is 1 USD/h; 1 kW at 0.2 USD/kWh is 0.2 USD/h.
    spec = parse_cluster(
        "nodes:\n  - {name: a, gpu: rtx3090, gpus_per_node: 1, purchase_price: 8760, power_w: 1000}\n")
    full_time = Pricing(BUY, lifetime_years=1, utilization=1.0, electricity_usd_per_kwh=0.2, pue=1.0)
    assert cluster_usd_per_hour(spec, full_time) == pytest.approx(1.2)
    half_time = Pricing(BUY, lifetime_years=1, utilization=0.5, electricity_usd_per_kwh=0.2, pue=1.0)
    assert cluster_usd_per_hour(spec, half_time) == pytest.approx(2.2)
    with_overhead = Pricing(BUY, lifetime_years=1, utilization=1.0, electricity_usd_per_kwh=0.2, pue=1.5)
    assert cluster_usd_per_hour(spec, with_overhead) == pytest.approx(1.3)


def test_buy_mode_uses_the_catalog_purchase_price_and_power_by_default():
    card = catalog()["rtx4090"]
    pricing = Pricing(BUY)
    expected = (card.purchase_price_usd / (pricing.lifetime_years * HOURS_PER_YEAR * pricing.utilization)
                + card.power_w / 1000 * pricing.pue * pricing.electricity_usd_per_kwh)
    assert gpu_usd_per_hour(card, pricing) == pytest.approx(expected)


@pytest.mark.parametrize("kwargs, flag", [
    ({"utilization": 0.0}, "--utilization"),
    ({"utilization": 1.5}, "--utilization"),
    ({"lifetime_years": 0.0}, "--lifetime-years"),
    ({"pue": 0.9}, "--pue"),
    ({"electricity_usd_per_kwh": -0.1}, "--electricity-usd-per-kwh"),
    ({"mode": BUY, "spot": True}, "--spot"),
])
def test_impossible_pricing_is_rejected_naming_the_flag(kwargs, flag):
    with pytest.raises(ConfigError, match=flag):
        Pricing(**kwargs)


def test_a_device_without_a_price_is_a_clear_error():
    spec = parse_cluster("""
devices:
  homebrew: {tflops: 100, memory: 24GB}
nodes:
  - {name: a, gpu: homebrew, gpus_per_node: 1}
""")
    with pytest.raises(ConfigError, match="'homebrew' has no price_per_hour"):
        cluster_usd_per_hour(spec, Pricing())
    with pytest.raises(ConfigError, match="'homebrew' has no purchase_price"):
        cluster_usd_per_hour(spec, Pricing(BUY))
