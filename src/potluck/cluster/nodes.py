"""What a cluster is built from: node groups of identical machines, the links declared
between groups, and the kinds of path a transfer between two devices takes.

These are plain values with no parsing (their types say which numbers must be positive,
for plan files, which carry them and are checked on load): :mod:`potluck.cluster.spec` reads them
from a cluster file, :mod:`potluck.cluster.calibration` replaces their figures
with measured ones, and :mod:`potluck.cluster.topology` answers which path
joins two devices.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from pydantic import NonNegativeFloat, PositiveFloat, PositiveInt

DEFAULT_INTER_BANDWIDTH_BYTES_PER_S = 10e9 / 8  # 10 Gb/s Ethernet
DEFAULT_INTRA_LATENCY_S = 5e-6
DEFAULT_INTER_LATENCY_S = 30e-6


class NvlinkTopology(str, Enum):
    """Which GPUs of a node share the native link."""

    NONE = "none"
    PAIRS = "pairs"  # bridges join GPUs (0,1), (2,3), ...
    ALL = "all"  # NVSwitch or a full mesh


class PathKind(str, Enum):
    """The path a transfer from one device to another takes (``Link.kind``); the values are
    the names cluster files, calibration sections and messages use."""

    LOCAL = "local"  # the same device
    NVLINK = "nvlink"  # a bridge or switch between two GPUs of a machine
    PCIE = "pcie"  # other GPUs of a machine
    NETWORK = "network"  # machines of the same node group, or groups without a declared link
    DECLARED = "declared"  # a link the cluster file declares between two node groups


@dataclass(frozen=True)
class NodeGroup:
    """``count`` identical machines with ``gpus_per_node`` GPUs of one type each."""

    name: str
    gpu: str
    gpus_per_node: PositiveInt
    count: PositiveInt = 1
    nvlink: NvlinkTopology = NvlinkTopology.NONE
    nvlink_bandwidth_bytes_per_s: PositiveFloat | None = None
    intra_bandwidth_bytes_per_s: PositiveFloat | None = None
    inter_bandwidth_bytes_per_s: PositiveFloat = DEFAULT_INTER_BANDWIDTH_BYTES_PER_S
    intra_latency_s: NonNegativeFloat = DEFAULT_INTRA_LATENCY_S
    inter_latency_s: NonNegativeFloat = DEFAULT_INTER_LATENCY_S
    price_per_hour_usd: NonNegativeFloat | None = None
    purchase_price_usd: NonNegativeFloat | None = None
    power_w: NonNegativeFloat | None = None

    @property
    def num_gpus(self) -> int:
        return self.gpus_per_node * self.count


@dataclass(frozen=True)
class LinkSpec:
    """A link between two node groups that differs from their own network."""

    between: tuple[str, str]
    bandwidth_bytes_per_s: PositiveFloat
    latency_s: NonNegativeFloat = DEFAULT_INTER_LATENCY_S
