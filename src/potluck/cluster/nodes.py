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
# A machine's host memory when its cluster file does not say: twice its GPUs' memory (the
# common sizing of GPU servers: a DGX A100 has 2 TB for 640 GB of GPU memory, a DGX H100
# 2 TB for 640 GB), never under 32 GB. Set ``host_memory`` per node group to plan with
# the real figure.
DEFAULT_HOST_MEMORY_PER_GPU_MEMORY = 2.0
MIN_DEFAULT_HOST_MEMORY_BYTES = 32e9
# A machine's DRAM bandwidth (the optimizer step of an offloaded optimizer runs in it) when
# its cluster file does not say: dual-channel DDR4-3200, 2 channels x 8 bytes x 3200 MT/s
# = 51.2 GB/s peak (JEDEC JESD79-4 DDR4 speed bins), the desktop boards 3060-4090 sit in.
# Set ``host_memory_bandwidth`` per node group for servers (8-channel DDR4-3200: 204.8 GB/s).
DEFAULT_HOST_MEMORY_BANDWIDTH_BYTES_PER_S = 2 * 8 * 3200e6


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
    host_memory_bytes: PositiveFloat | None = None  # per machine (None: the default rule)
    host_bandwidth_bytes_per_s: PositiveFloat | None = None  # each GPU to host (None: its PCIe)
    host_memory_bandwidth_bytes_per_s: PositiveFloat | None = None  # per machine (None: DDR4)

    @property
    def num_gpus(self) -> int:
        return self.gpus_per_node * self.count

    def host_memory(self, gpu_memory_bytes: float) -> float:
        """Host memory of one machine of the group, in bytes: the cluster file's figure, else
        twice the machine's GPU memory (at least 32 GB)."""
        if self.host_memory_bytes is not None:
            return self.host_memory_bytes
        total = DEFAULT_HOST_MEMORY_PER_GPU_MEMORY * gpu_memory_bytes * self.gpus_per_node
        return max(MIN_DEFAULT_HOST_MEMORY_BYTES, total)

    def host_bandwidth(self, pcie_bandwidth_bytes_per_s: float) -> float:
        """One GPU's bandwidth to host memory, one direction: the cluster file's figure, else
        its catalog PCIe figure."""
        return self.host_bandwidth_bytes_per_s or pcie_bandwidth_bytes_per_s

    @property
    def host_memory_bandwidth(self) -> float:
        """One machine's DRAM bandwidth, shared by its ranks' host work: the cluster file's
        figure, else :data:`DEFAULT_HOST_MEMORY_BANDWIDTH_BYTES_PER_S`."""
        return self.host_memory_bandwidth_bytes_per_s or DEFAULT_HOST_MEMORY_BANDWIDTH_BYTES_PER_S


@dataclass(frozen=True)
class LinkSpec:
    """A link between two node groups that differs from their own network."""

    between: tuple[str, str]
    bandwidth_bytes_per_s: PositiveFloat
    latency_s: NonNegativeFloat = DEFAULT_INTER_LATENCY_S
