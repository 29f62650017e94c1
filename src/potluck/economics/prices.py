"""What a GPU-hour costs: rented (on-demand or spot) or bought (amortized, plus electricity).

Rent: the catalog's USD per GPU-hour, on-demand or spot. A node group's
``price_per_hour`` in the cluster file overrides both: it is the price that
user pays for those GPUs.

Buy: the purchase price spread over the hours the card trains during its
life, plus the electricity it draws::

    usd_per_hour = purchase_usd / (lifetime_years * 8760 h * utilization)
                 + power_w / 1000 * pue * electricity_usd_per_kwh

``utilization`` is the share of its lifetime the card spends training (idle
hours still depreciate it); ``pue`` scales board power up for the host,
power-supply losses and cooling. The defaults below are stated assumptions,
each overridable (``--lifetime-years``, ``--utilization``,
``--electricity-usd-per-kwh``, ``--pue``). A node group's ``purchase_price``
and ``power_w`` override the catalog's. The host machine itself (CPU, board,
chassis) is not in the catalog's per-card purchase price; add its share to
``purchase_price`` in an offers or cluster file when it matters.

Only the GPUs a plan uses are charged: a device left out is not rented (or,
when owned, is free to do other work).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import Enum

from potluck.cluster.catalog import DeviceType
from potluck.cluster.spec import ClusterSpec, NodeGroup
from potluck.cluster.topology import Cluster
from potluck.errors import ConfigError
from potluck.plans import Plan
from potluck.units import fraction, non_negative_number, positive_number

log = logging.getLogger(__name__)

HOURS_PER_YEAR = 8760.0
DEFAULT_LIFETIME_YEARS = 3.0  # the usual depreciation period of servers
DEFAULT_UTILIZATION = 0.5  # the hardware trains half of its life
DEFAULT_ELECTRICITY_USD_PER_KWH = 0.15  # about the 2025 US average retail rate
DEFAULT_PUE = 1.3  # host, power supply and cooling on top of board power


class PriceMode(str, Enum):
    RENT = "rent"
    BUY = "buy"


@dataclass(frozen=True)
class Pricing:
    """How to turn GPUs into dollars per hour."""

    mode: PriceMode = PriceMode.RENT
    spot: bool = False
    lifetime_years: float = DEFAULT_LIFETIME_YEARS
    utilization: float = DEFAULT_UTILIZATION
    electricity_usd_per_kwh: float = DEFAULT_ELECTRICITY_USD_PER_KWH
    pue: float = DEFAULT_PUE

    def __post_init__(self) -> None:
        positive_number(self.lifetime_years, "--lifetime-years")
        fraction(self.utilization, "--utilization")
        non_negative_number(self.electricity_usd_per_kwh, "--electricity-usd-per-kwh")
        if not 1 <= positive_number(self.pue, "--pue"):
            raise ConfigError(f"--pue must be at least 1, not {self.pue}")
        if self.spot and self.mode is PriceMode.BUY:
            raise ConfigError("--spot applies to rented GPUs; drop it or use --mode rent")

    def describe(self) -> str:
        """One line saying what the prices mean, for reports and plot titles."""
        if self.mode is PriceMode.RENT:
            return "rented, spot prices" if self.spot else "rented, on-demand prices"
        return (
            f"bought: {self.lifetime_years:g} years at {self.utilization:.0%} use, "
            f"${self.electricity_usd_per_kwh:g}/kWh, PUE {self.pue:g}"
        )


def gpu_usd_per_hour(device_type: DeviceType, pricing: Pricing, group: NodeGroup | None = None) -> float:
    """USD per hour of one GPU of ``device_type`` (in ``group``, whose overrides win)."""
    if pricing.mode is PriceMode.RENT:
        return _rent_usd_per_hour(device_type, pricing, group)
    return _buy_usd_per_hour(device_type, pricing, group)


def _rent_usd_per_hour(device_type: DeviceType, pricing: Pricing, group: NodeGroup | None) -> float:
    if group is not None and group.price_per_hour_usd is not None:
        return group.price_per_hour_usd
    price = device_type.spot_price_per_hour_usd if pricing.spot else device_type.price_per_hour_usd
    if price <= 0:
        kind = "spot_price_per_hour" if pricing.spot else "price_per_hour"
        raise ConfigError(
            f"device type {device_type.name!r} has no {kind}; give one in the cluster or offers file"
        )
    return price


def _buy_usd_per_hour(device_type: DeviceType, pricing: Pricing, group: NodeGroup | None) -> float:
    purchase_usd = _override(group, "purchase_price_usd", device_type.purchase_price_usd)
    power_w = _override(group, "power_w", device_type.power_w)
    if purchase_usd <= 0:
        raise ConfigError(
            f"device type {device_type.name!r} has no purchase_price; give one in the cluster "
            "or offers file, or use --mode rent"
        )
    if power_w <= 0:
        log.warning("device type %s has no power_w: its electricity counts as free", device_type.name)
    training_hours = pricing.lifetime_years * HOURS_PER_YEAR * pricing.utilization
    electricity_usd_per_hour = power_w / 1000.0 * pricing.pue * pricing.electricity_usd_per_kwh
    return purchase_usd / training_hours + electricity_usd_per_hour


def _override(group: NodeGroup | None, attr: str, default: float) -> float:
    value = getattr(group, attr) if group is not None else None
    return default if value is None else value


def group_gpu_usd_per_hour(spec: ClusterSpec, group: NodeGroup, pricing: Pricing) -> float:
    """USD per hour of one GPU of a node group of ``spec``."""
    return gpu_usd_per_hour(spec.device_type(group.gpu), pricing, group)


def devices_usd_per_hour(spec: ClusterSpec, device_ids: tuple[str, ...], pricing: Pricing) -> float:
    """USD per hour of the listed devices of ``spec``."""
    cluster = Cluster(spec)
    per_group = {g.name: group_gpu_usd_per_hour(spec, g, pricing) for g in spec.nodes}
    return sum(per_group[cluster.device(d).group] for d in device_ids)


def cluster_usd_per_hour(spec: ClusterSpec, pricing: Pricing) -> float:
    """USD per hour of every GPU of ``spec``."""
    return sum(group_gpu_usd_per_hour(spec, g, pricing) * g.num_gpus for g in spec.nodes)


def plan_usd_per_hour(plan: Plan, pricing: Pricing) -> float:
    """USD per hour of the GPUs ``plan`` uses (devices it leaves out cost nothing)."""
    return devices_usd_per_hour(plan.cluster, plan.devices, pricing)
