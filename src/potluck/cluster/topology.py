"""The concrete devices of a cluster and the link between any two of them.

:class:`Cluster` expands a :class:`ClusterSpec` into devices with stable ids
(``<group>.<node index>:<gpu index>``, e.g. ``box3090.1:2``) and answers
``link(a, b)``: NVLink for bridged pairs or NVSwitch nodes, PCIe between other
GPUs of a host, the network (or a declared link) between hosts.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property

from potluck.cluster.catalog import DeviceType
from potluck.cluster.nodes import LinkSpec, NodeGroup, NvlinkTopology, PathKind
from potluck.cluster.spec import ClusterSpec
from potluck.errors import ConfigError


@dataclass(frozen=True)
class Device:
    """One GPU (or CPU rank) of the cluster."""

    id: str
    group: str
    node_index: int
    local_index: int
    type: DeviceType
    node: str = ""  # the id of the machine this device sits in, ``<group>.<node index>``

    def __post_init__(self) -> None:
        if not self.node:
            object.__setattr__(self, "node", f"{self.group}.{self.node_index}")


@dataclass(frozen=True)
class Link:
    """A point-to-point path: usable one-direction bandwidth and latency."""

    bandwidth_bytes_per_s: float
    latency_s: float
    kind: PathKind


LOCAL = Link(float("inf"), 0.0, PathKind.LOCAL)


def spans_vendors(devices: Iterable[Device]) -> bool:
    """Whether ``devices`` are of several vendors (NVIDIA, AMD, CPUs): no backend joins them,
    so a pipeline over them passes its tensors through host memory over gloo
    (:func:`potluck.plans.vendors.vendors_problem`)."""
    return len({d.type.vendor for d in devices}) > 1


def device_id(group: str, node_index: int, local_index: int) -> str:
    return f"{group}.{node_index}:{local_index}"


class Cluster:
    """Devices and links of a :class:`ClusterSpec`; cheap to build, safe to share."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.groups = {group.name: group for group in spec.nodes}
        self._link_cache: dict[tuple, Link] = {}

    @cached_property
    def devices(self) -> tuple[Device, ...]:
        devices = []
        for group in self.spec.nodes:
            device_type = self.spec.device_type(group.gpu)
            for node_index in range(group.count):
                for local in range(group.gpus_per_node):
                    devices.append(
                        Device(device_id(group.name, node_index, local), group.name,
                               node_index, local, device_type)
                    )
        return tuple(devices)

    @cached_property
    def by_id(self) -> dict[str, Device]:
        return {device.id: device for device in self.devices}

    def host_memory_bytes(self, node: str) -> float:
        """Host memory of machine ``node`` (``<group>.<index>``), shared by its GPUs' ranks."""
        group = self.groups[node.rsplit(".", 1)[0]]
        return group.host_memory(self.spec.device_type(group.gpu).memory_bytes)

    def host_memory_bandwidth_bytes_per_s(self, node: str) -> float:
        """DRAM bandwidth of machine ``node``, shared by its ranks' host-side work."""
        return self.groups[node.rsplit(".", 1)[0]].host_memory_bandwidth

    def host_bandwidth_bytes_per_s(self, device: Device) -> float:
        """``device``'s one-direction bandwidth to its machine's host memory."""
        return self.groups[device.group].host_bandwidth(device.type.pcie_bandwidth_bytes_per_s)

    def device(self, device_id_: str) -> Device:
        try:
            return self.by_id[device_id_]
        except KeyError:
            raise ConfigError(
                f"device {device_id_!r} is not in cluster {self.spec.name!r} "
                f"(ids look like {self.devices[0].id})"
            ) from None

    def link(self, a: Device, b: Device) -> Link:
        """The path a transfer from ``a`` to ``b`` takes."""
        if a.id == b.id:
            return LOCAL
        same_node = a.group == b.group and a.node_index == b.node_index
        bridged = same_node and _bridged(self.groups[a.group], a.local_index, b.local_index)
        key = (a.group, b.group, same_node, bridged)
        link = self._link_cache.get(key)
        if link is None:
            link = self._compute_link(a, b, same_node, bridged)
            self._link_cache[key] = link
        return link

    def _compute_link(self, a: Device, b: Device, same_node: bool, bridged: bool) -> Link:
        group_a, group_b = self.groups[a.group], self.groups[b.group]
        if same_node:
            return _intra_link(group_a, a.type, bridged)
        declared = self._declared_link(a.group, b.group)
        if declared is not None:
            return Link(declared.bandwidth_bytes_per_s, declared.latency_s, PathKind.DECLARED)
        bandwidth = min(group_a.inter_bandwidth_bytes_per_s, group_b.inter_bandwidth_bytes_per_s)
        latency = max(group_a.inter_latency_s, group_b.inter_latency_s)
        return Link(bandwidth, latency, PathKind.NETWORK)

    def _declared_link(self, group_a: str, group_b: str) -> LinkSpec | None:
        for link in self.spec.links:
            if set(link.between) == {group_a, group_b}:
                return link
        return None

    def nic_bandwidth_bytes_per_s(self, device: Device) -> float:
        """The network bandwidth of the machine ``device`` sits in."""
        return self.groups[device.group].inter_bandwidth_bytes_per_s

    def node_devices(self, group: str, node_index: int) -> tuple[Device, ...]:
        return tuple(d for d in self.devices if d.group == group and d.node_index == node_index)


def _bridged(group: NodeGroup, local_a: int, local_b: int) -> bool:
    if group.nvlink is NvlinkTopology.ALL:
        return True
    if group.nvlink is NvlinkTopology.PAIRS:
        return local_a // 2 == local_b // 2
    return False


def _intra_link(group: NodeGroup, device_type: DeviceType, bridged: bool) -> Link:
    latency = group.intra_latency_s
    if bridged:
        bandwidth = group.nvlink_bandwidth_bytes_per_s or device_type.link_bandwidth_bytes_per_s
        if group.nvlink is NvlinkTopology.ALL and group.intra_bandwidth_bytes_per_s:
            bandwidth = group.intra_bandwidth_bytes_per_s
        return Link(bandwidth, latency, PathKind.NVLINK)
    bandwidth = group.intra_bandwidth_bytes_per_s or device_type.pcie_bandwidth_bytes_per_s
    return Link(bandwidth, latency, PathKind.PCIE)
