"""Cluster files: node groups, their GPUs and the links between them, read into a ClusterSpec.

A cluster file (YAML) lists node groups (identical machines), optional custom
device types and optional links between groups::

    nodes:
      - name: box3090
        gpu: rtx3090
        gpus_per_node: 4
        count: 2
        nvlink: pairs            # 3090s joined in pairs by NVLink bridges
        inter_bandwidth: 10Gb/s
    links:
      - between: [box3090, boxa100]
        bandwidth: 1Gb/s
        latency: 20ms

:func:`load_cluster` validates it (errors name the file and line) and returns
a frozen, JSON-serializable :class:`ClusterSpec` that carries every device type
it uses, so a plan made from it is self-contained. The parts it is made of
(:class:`~potluck.cluster.nodes.NodeGroup`, :class:`~potluck.cluster.nodes.LinkSpec`)
live in :mod:`potluck.cluster.nodes`; a ``calibration:`` section is read and
applied by :mod:`potluck.cluster.calibration`; an ``execution:`` section (the framework
that will train, :mod:`potluck.cluster.execution`) is read into ``ClusterSpec.execution``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field
from pydantic.json_schema import SkipJsonSchema

from potluck.cluster.calibration import (
    Calibration,
    calibrate_device,
    calibrate_group,
    calibrated_links,
    parse_calibration,
)
from potluck.cluster.catalog import DeviceType, LinkKind, lookup, make_device_type
from potluck.cluster.execution import Execution, parse_execution
from potluck.cluster.nodes import (
    DEFAULT_INTER_BANDWIDTH_BYTES_PER_S,
    DEFAULT_INTER_LATENCY_S,
    DEFAULT_INTRA_LATENCY_S,
    LinkSpec,
    NodeGroup,
    NvlinkTopology,
)
from potluck.errors import ConfigError
from potluck.units import (
    non_negative_number,
    parse_bandwidth_bytes_per_s,
    parse_duration_s,
    parse_size_bytes,
)
from potluck.yamlio import Fields, LineList, load_yaml, non_empty_str, parse_yaml, positive_int


@dataclass(frozen=True)
class ClusterSpec:
    """The whole cluster as the user described it, with device types resolved."""

    nodes: tuple[NodeGroup, ...]
    device_types: tuple[DeviceType, ...]
    links: tuple[LinkSpec, ...] = ()
    name: str = "cluster"
    calibration: Calibration | None = None  # what was measured, already applied to the above
    # The file's ``execution:`` section. Plans carry the traits they were made with in
    # ``training.execution`` (the flag may override this), so it is not written into plans.
    execution: Annotated[SkipJsonSchema[Execution | None], Field(exclude=True)] = field(
        default=None, compare=False)

    def device_type(self, name: str) -> DeviceType:
        for device_type in self.device_types:
            if device_type.name == name:
                return device_type
        raise ConfigError(f"cluster {self.name!r} has no device type {name!r}")

    @property
    def num_gpus(self) -> int:
        return sum(group.num_gpus for group in self.nodes)


_NODE_KEYS = (
    "name", "gpu", "gpus_per_node", "count", "nvlink", "nvlink_bandwidth", "intra_bandwidth",
    "inter_bandwidth", "intra_latency", "inter_latency", "price_per_hour", "purchase_price",
    "power_w", "host_memory", "host_bandwidth", "host_memory_bandwidth",
)
_TOP_KEYS = ("name", "nodes", "devices", "links", "calibration", "execution")


def load_cluster(path: str | Path) -> ClusterSpec:
    """Read and validate a cluster YAML file."""
    path = Path(path)
    data = load_yaml(path, "cluster file")
    return cluster_from_data(data, str(path), default_name=path.stem)


def parse_cluster(text: str, label: str = "cluster.yaml") -> ClusterSpec:
    """Validate a cluster given as YAML text (used by tests and the demo)."""
    return cluster_from_data(parse_yaml(text, label), label, default_name=Path(label).stem)


def cluster_from_data(data: Any, label: str, default_name: str = "cluster") -> ClusterSpec:
    top = Fields(data, label, "cluster")
    top.check_keys(_TOP_KEYS)
    custom = _custom_devices(top)
    raw_nodes = top.get("nodes", _non_empty_list)
    groups = tuple(
        _node_group(Fields(item, label, f"nodes[{i}]", _item_line(raw_nodes, i)), custom)
        for i, item in enumerate(raw_nodes)
    )
    _check_unique_names(groups, top)
    try:
        check_size(groups)
    except ConfigError as err:
        raise top.error("nodes", str(err)) from None
    links = _links(top, {group.name for group in groups})
    used = dict.fromkeys(group.gpu for group in groups)
    device_types = tuple(lookup(name, custom) for name in used)
    name = top.get("name", cluster_name, default_name)
    spec = ClusterSpec(nodes=groups, device_types=device_types, links=links, name=name)
    if top.has("execution"):
        spec = replace(spec, execution=parse_execution(
            top.data["execution"], label, "execution", top.line_of("execution")))
    return _calibrated(spec, top) if top.has("calibration") else spec


def _calibrated(spec: ClusterSpec, top: Fields) -> ClusterSpec:
    """Apply the file's ``calibration:`` section (:mod:`potluck.cluster.calibration`)."""
    found = parse_calibration(top, {t.name for t in spec.device_types},
                              {g.name for g in spec.nodes})
    return ClusterSpec(
        nodes=tuple(calibrate_group(group, found) for group in spec.nodes),
        device_types=tuple(calibrate_device(t, found) for t in spec.device_types),
        links=calibrated_links(spec.links, found), name=spec.name, calibration=found,
        execution=spec.execution,
    )


def _item_line(items: Any, index: int) -> int:
    lines = getattr(items, "item_lines", None)
    return lines[index] if lines else 0


def _non_empty_list(value: Any) -> list:
    if not isinstance(value, list) or not value:
        raise ConfigError("must be a non-empty list")
    return value


def _custom_devices(top: Fields) -> dict[str, DeviceType]:
    if not top.has("devices"):
        return {}
    devices = Fields(top.data["devices"], top.label, "devices", top.line_of("devices"))
    custom: dict[str, DeviceType] = {}
    for key, raw in devices.data.items():
        entry = Fields(raw, top.label, f"devices.{key}", devices.line_of(key))
        try:
            name = check_name(key, "device type name")
            base_name = entry.data.get("base", name if _in_catalog(name) else None)
            base = lookup(str(base_name)) if base_name is not None else None
            custom[name] = make_device_type(name, dict(entry.data), base)
        except ConfigError as err:
            raise entry.error(None, str(err)) from None
    return custom


def _in_catalog(name: str) -> bool:
    try:
        lookup(name)
    except ConfigError:
        return False
    return True


MAX_GPUS = 16384  # a cluster's GPUs (check_size); 16,384 H100s take 30 s to plan (README)
NAME_CHARACTERS = "letters, digits, '-' or '_'"
MAX_NAME_CHARS = 64


def check_name(value: Any, what: str = "node group name") -> str:
    """A name that ends up in device ids (``<group>.<machine>:<gpu>``), environment variables
    and shell commands: ASCII letters, digits, ``-`` and ``_``, starting with a letter or
    digit. The cluster loader and the plan loader both check names with it."""
    name = non_empty_str(value)
    bad = sorted({c for c in name if not (c.isascii() and (c.isalnum() or c in "-_"))})
    if bad:
        shown = ", ".join("a space" if c.isspace() else repr(c) for c in bad)
        raise ConfigError(f"{what} {name!r} cannot contain {shown} (names reach device ids "
                          f"<group>.<machine>:<gpu> and shell commands); use {NAME_CHARACTERS}")
    if name.startswith("-") or len(name) > MAX_NAME_CHARS:
        raise ConfigError(f"{what} {name!r} must start with a letter or digit and have at most "
                          f"{MAX_NAME_CHARS} characters; use {NAME_CHARACTERS}")
    return name


MAX_HOST_NAME_CHARS = 253  # RFC 1035: a full domain name


def check_host_name(value: Any, what: str = "host name") -> str:
    """A machine's host name (it reaches ``#SBATCH --nodelist`` and the launch scripts):
    names as :func:`check_name` allows them, joined by ``.`` (``gpu-a01``,
    ``gpu-a01.lab.example``); no spaces, quotes, ``;``, ``/`` or empty parts (``..``)."""
    name = non_empty_str(value)
    try:
        for part in name.split("."):
            check_name(part, what)
    except ConfigError:
        raise ConfigError(f"{what} {name!r} must be names of {NAME_CHARACTERS} joined by '.', "
                          "such as gpu-a01 or gpu-a01.lab.example (host names reach sbatch "
                          "and shell scripts)") from None
    if len(name) > MAX_HOST_NAME_CHARS:
        raise ConfigError(f"{what} {name[:20]!r}... has more than {MAX_HOST_NAME_CHARS} "
                          "characters")
    return name


MAX_CLUSTER_NAME_CHARS = 200


def cluster_name(value: Any, what: str = "cluster name") -> str:
    """A cluster's name: free text shown in titles and messages (markup is printed as
    written; the name reaches no path and no command), one line of printable characters:
    a newline or a terminal escape would forge or hide output."""
    name = non_empty_str(value)
    hidden = sorted({c for c in name if not c.isprintable()})
    if hidden:
        raise ConfigError(f"{what} {name!r} cannot contain {', '.join(map(repr, hidden))} "
                          "(line breaks and control characters); write it on one line")
    if len(name) > MAX_CLUSTER_NAME_CHARS:
        raise ConfigError(f"{what} {name[:20]!r}... has more than {MAX_CLUSTER_NAME_CHARS} "
                          "characters")
    return name


def group_name(value: Any) -> str:
    """A node group's name (:func:`check_name`)."""
    return check_name(value, "node group name")


def _node_group(node: Fields, custom: dict[str, DeviceType]) -> NodeGroup:
    node.check_keys(_NODE_KEYS)
    gpu_name = node.get("gpu", non_empty_str)
    try:
        device_type = lookup(gpu_name, custom)
    except ConfigError as err:
        raise node.error("gpu", str(err)) from None
    nvlink = node.get("nvlink", parse_nvlink_topology, default_nvlink(device_type))
    group = NodeGroup(
        name=node.get("name", group_name),
        gpu=device_type.name,
        gpus_per_node=node.get("gpus_per_node", positive_int),
        count=node.get("count", positive_int, 1),
        nvlink=nvlink,
        nvlink_bandwidth_bytes_per_s=node.optional("nvlink_bandwidth", parse_bandwidth_bytes_per_s),
        intra_bandwidth_bytes_per_s=node.optional("intra_bandwidth", parse_bandwidth_bytes_per_s),
        inter_bandwidth_bytes_per_s=node.get(
            "inter_bandwidth", parse_bandwidth_bytes_per_s, DEFAULT_INTER_BANDWIDTH_BYTES_PER_S
        ),
        intra_latency_s=node.get("intra_latency", parse_duration_s, DEFAULT_INTRA_LATENCY_S),
        inter_latency_s=node.get("inter_latency", parse_duration_s, DEFAULT_INTER_LATENCY_S),
        price_per_hour_usd=node.optional("price_per_hour", non_negative_number),
        purchase_price_usd=node.optional("purchase_price", non_negative_number),
        power_w=node.optional("power_w", non_negative_number),
        host_memory_bytes=node.optional("host_memory", parse_size_bytes),
        host_bandwidth_bytes_per_s=node.optional("host_bandwidth", parse_bandwidth_bytes_per_s),
        host_memory_bandwidth_bytes_per_s=node.optional("host_memory_bandwidth",
                                                        parse_bandwidth_bytes_per_s),
    )
    _check_nvlink(node, group, device_type)
    return group


def default_nvlink(device_type: DeviceType) -> NvlinkTopology:
    """SXM/OAM boards share their link across the node; bridges must be declared."""
    return NvlinkTopology.ALL if device_type.link.joins_whole_node else NvlinkTopology.NONE


def parse_nvlink_topology(value: Any) -> NvlinkTopology:
    """``none``, ``pairs`` or ``all`` (``false`` means none; ``true`` names neither)."""
    if value is False:
        return NvlinkTopology.NONE
    if value is True:
        raise ConfigError("must be none, pairs or all, not true (YAML reads yes, on and true "
                          "as true): write pairs (GPUs bridged two by two) or all (NVSwitch)")
    try:
        return NvlinkTopology(str(value).lower())
    except ValueError:
        raise ConfigError(f"must be none, pairs or all, not {value!r}") from None


def _check_nvlink(node: Fields, group: NodeGroup, device_type: DeviceType) -> None:
    if group.nvlink is NvlinkTopology.NONE or group.nvlink_bandwidth_bytes_per_s:
        return
    if device_type.link is LinkKind.NONE:
        raise node.error(
            "nvlink",
            f"{device_type.name} has no NVLink; remove `nvlink` or give nvlink_bandwidth",
        )
    if group.nvlink is NvlinkTopology.PAIRS and group.gpus_per_node % 2:
        raise node.error("nvlink", "pairs needs an even gpus_per_node")


def _check_unique_names(groups: tuple[NodeGroup, ...], top: Fields) -> None:
    seen: set[str] = set()
    for group in groups:
        if group.name in seen:
            raise top.error("nodes", f"two node groups are named {group.name!r}; names must differ")
        seen.add(group.name)


def check_size(groups: tuple[NodeGroup, ...]) -> None:
    """At most :data:`MAX_GPUS` GPUs: the search's time grows with the devices (the largest
    cluster of ``benchmarks/search_scale.py`` has 1,024)."""
    total = sum(group.num_gpus for group in groups)
    if total > MAX_GPUS:
        sizes = ", ".join(f"{g.name}: {g.count:,} x {g.gpus_per_node:,}" for g in groups)
        raise ConfigError(f"the cluster has {total:,} GPUs ({sizes}); potluck plans for at most "
                          f"{MAX_GPUS:,}: check count and gpus_per_node")


def check_spec(spec: ClusterSpec) -> None:
    """What :func:`cluster_from_data` checks of names, references and size, for a cluster
    that did not come from a cluster file (a plan file carries one). Numbers are checked
    by the types of the fields (positive, at least 0) when the plan is read."""
    _at("name", cluster_name, spec.name)
    types = {}
    for i, device_type in enumerate(spec.device_types):
        _at(f"device_types[{i}].name", check_name, device_type.name, "device type name")
        types[device_type.name] = device_type
    names = set()
    for i, group in enumerate(spec.nodes):
        _at(f"nodes[{i}].name", check_name, group.name, "node group name")
        if group.name in names:
            raise ConfigError(f"nodes[{i}].name: two node groups are named {group.name!r}")
        if group.gpu not in types:
            raise ConfigError(f"nodes[{i}].gpu: {group.gpu!r} is none of the device types "
                              f"({', '.join(types)})")
        names.add(group.name)
    for i, link in enumerate((*spec.links, *_calibration_links(spec))):
        for name in link.between or ():
            if name not in names:
                raise ConfigError(f"links[{i}].between: no node group named {name!r}")
    check_size(spec.nodes)


def _at(where: str, check: Any, *args: Any) -> None:
    try:
        check(*args)
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None


def _calibration_links(spec: ClusterSpec) -> tuple:
    return spec.calibration.links if spec.calibration is not None else ()


def _links(top: Fields, group_names: set[str]) -> tuple[LinkSpec, ...]:
    if not top.has("links"):
        return ()
    raw_links = top.get("links", _non_empty_list)
    links = []
    for i, item in enumerate(raw_links):
        link = Fields(item, top.label, f"links[{i}]", _item_line(raw_links, i))
        link.check_keys(("between", "bandwidth", "latency"))
        between = link.get("between", _pair)
        for name in between:
            if name not in group_names:
                known = ", ".join(sorted(group_names))
                raise link.error("between", f"no node group named {name!r} (groups: {known})")
        links.append(
            LinkSpec(
                between=between,
                bandwidth_bytes_per_s=link.get("bandwidth", parse_bandwidth_bytes_per_s),
                latency_s=link.get("latency", parse_duration_s, DEFAULT_INTER_LATENCY_S),
            )
        )
    return tuple(links)


def _pair(value: Any) -> tuple[str, str]:
    if not isinstance(value, LineList | list) or len(value) != 2:
        raise ConfigError("must name two node groups, e.g. [box3090, boxa100]")
    return (str(value[0]), str(value[1]))
