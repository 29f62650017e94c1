"""Cluster layer: device catalog, cluster files and their calibration, devices and links."""

from potluck.cluster.catalog import DeviceType, LinkKind, catalog, lookup
from potluck.cluster.nodes import LinkSpec, NodeGroup, NvlinkTopology, PathKind
from potluck.cluster.spec import ClusterSpec, load_cluster, parse_cluster
from potluck.cluster.topology import Cluster, Device, Link

__all__ = [
    "Cluster", "ClusterSpec", "Device", "DeviceType", "Link", "LinkKind", "LinkSpec",
    "NodeGroup", "NvlinkTopology", "PathKind", "catalog", "load_cluster", "lookup", "parse_cluster",
]
