"""The device catalog: what each GPU type can do and what it costs.

A :class:`DeviceType` holds the public figures the cost model needs (dense
16-bit TFLOPS, memory, memory bandwidth, native link, streaming multiprocessors, the
GEMM ceiling measured by published matmul sweeps: ``matmul_efficiency``, which
:mod:`potluck.planner.gemm` combines with each GEMM's shape) and the economics needs
(rental and purchase price, power). The figures live in ``catalog.yaml`` beside this
module, each entry with its sources (:func:`source_of` finds the one covering a field); a
cluster file can add custom types or override any field.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, replace
from enum import Enum
from functools import cache
from importlib import resources
from typing import Annotated, Any

import yaml
from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveFloat

from potluck.errors import ConfigError
from potluck.units import (
    non_negative_number,
    parse_bandwidth_bytes_per_s,
    parse_size_bytes,
    positive_number,
)

DEFAULT_MATMUL_EFFICIENCY = 0.8
# A share of the peak: GeForce cards run above their rated boost clock (the catalog's
# figures reach 1.14), no card at 1.5 times it; 50 is a percentage meant as 0.5.
MAX_MATMUL_EFFICIENCY = 1.5
Efficiency = Annotated[float, Field(gt=0, le=MAX_MATMUL_EFFICIENCY)]


def matmul_efficiency(value: Any, what: str = "matmul_efficiency") -> float:
    """A GEMM ceiling: the share of ``tflops`` large GEMMs reach (0.8, not 80)."""
    number = positive_number(value, what)
    if number > MAX_MATMUL_EFFICIENCY:
        raise ConfigError(f"{what}: {value!r} is no share of the peak; write one such as 0.8 "
                          f"(80%), at most {MAX_MATMUL_EFFICIENCY}")
    return number
DEFAULT_MEMORY_BANDWIDTH_BYTES_PER_S = 1000e9
DEFAULT_PCIE_BANDWIDTH_BYTES_PER_S = 12.9e9


class LinkKind(str, Enum):
    """The native GPU<->GPU link of a device type."""

    NONE = "none"
    NVLINK_BRIDGE = "nvlink-bridge"
    NVLINK = "nvlink"
    INFINITY_FABRIC = "infinity-fabric"

    @property
    def joins_whole_node(self) -> bool:
        return self in (LinkKind.NVLINK, LinkKind.INFINITY_FABRIC)


class Vendor(str, Enum):
    """Whose accelerator a device type is: ranks of one vendor share a collective backend
    (NCCL; RCCL, torch's ``nccl`` on ROCm), the others meet over gloo."""

    NVIDIA = "nvidia"
    AMD = "amd"
    CPU = "cpu"


@dataclass(frozen=True)
class DeviceType:
    """One accelerator model with the figures potluck plans with."""

    name: str
    tflops: PositiveFloat  # dense 16-bit tensor-core peak
    memory_bytes: PositiveFloat
    memory_bandwidth_bytes_per_s: PositiveFloat = DEFAULT_MEMORY_BANDWIDTH_BYTES_PER_S
    bf16: bool = True
    link: LinkKind = LinkKind.NONE
    link_bandwidth_bytes_per_s: NonNegativeFloat = 0.0
    pcie_bandwidth_bytes_per_s: PositiveFloat = DEFAULT_PCIE_BANDWIDTH_BYTES_PER_S
    matmul_efficiency: Efficiency = DEFAULT_MATMUL_EFFICIENCY  # GEMM ceiling (planner.gemm)
    price_per_hour_usd: NonNegativeFloat = 0.0
    spot_price_per_hour_usd: NonNegativeFloat = 0.0
    purchase_price_usd: NonNegativeFloat = 0.0
    power_w: NonNegativeFloat = 0.0
    sm_count: NonNegativeInt = 0
    fp32_tflops: NonNegativeFloat = 0.0  # non-tensor FP32 peak (0: not known)
    tf32_tflops: NonNegativeFloat = 0.0  # dense TF32 tensor-core peak (0: the hardware has none)
    vendor: Vendor = Vendor.NVIDIA
    sources: dict[str, str] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.is_cpu:  # a plan file written before types had a vendor names none
            object.__setattr__(self, "vendor", Vendor.CPU)

    @property
    def is_cpu(self) -> bool:
        return self.name == "cpu"


_FIELDS: dict[str, tuple[str, Any]] = {
    "tflops": ("tflops", float),
    "memory": ("memory_bytes", parse_size_bytes),
    "memory_bandwidth": ("memory_bandwidth_bytes_per_s", parse_bandwidth_bytes_per_s),
    "bf16": ("bf16", bool),
    "link": ("link", LinkKind),
    "link_bandwidth": ("link_bandwidth_bytes_per_s", parse_bandwidth_bytes_per_s),
    "pcie_bandwidth": ("pcie_bandwidth_bytes_per_s", parse_bandwidth_bytes_per_s),
    "matmul_efficiency": ("matmul_efficiency", float),
    "price_per_hour": ("price_per_hour_usd", float),
    "spot_price_per_hour": ("spot_price_per_hour_usd", float),
    "purchase_price": ("purchase_price_usd", float),
    "power_w": ("power_w", float),
    "sm_count": ("sm_count", int),
    "fp32_tflops": ("fp32_tflops", float),
    "tf32_tflops": ("tf32_tflops", float),
    "vendor": ("vendor", Vendor),
}
_IGNORED = {"pcie_gen", "sources", "base"}
_POSITIVE = {"tflops"}  # the other numbers may be 0 (free, not known)

# YAML field -> DeviceType attribute, in the catalog's order (what `potluck catalog NAME` lists).
FIELD_ATTRS: dict[str, str] = {key: attr for key, (attr, _) in _FIELDS.items()}
# A `sources` key that covers several fields; a field's own key wins, then its group, then `all`.
SOURCE_GROUPS: dict[str, tuple[str, ...]] = {
    "specs": ("memory", "memory_bandwidth", "bf16", "link", "pcie_gen", "sm_count", "vendor"),
    "price": ("price_per_hour", "spot_price_per_hour", "purchase_price"),
}


def device_fields_from_yaml(name: str, raw: dict[str, Any]) -> dict[str, Any]:
    """Convert one YAML device entry to :class:`DeviceType` keyword arguments."""
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        if key in _IGNORED:
            continue
        if key not in _FIELDS:
            hint = difflib.get_close_matches(key, list(_FIELDS), n=1)
            tip = f"; did you mean {hint[0]!r}?" if hint else f"; known: {', '.join(_FIELDS)}"
            raise ConfigError(f"device {name!r}: unknown field {key!r}{tip}")
        attr, convert = _FIELDS[key]
        kwargs[attr] = _convert(name, key, value, convert)
    return kwargs


def _convert(name: str, key: str, value: Any, convert: Any) -> Any:
    if convert is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"device {name!r}: {key} must be true or false, not {value!r}")
        return value
    if convert in (LinkKind, Vendor):
        try:
            return convert(value)
        except ValueError:
            choices = ", ".join(member.value for member in convert)
            raise ConfigError(f"device {name!r}: {key} must be one of {choices}, not {value!r}") from None
    if convert is int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"device {name!r}: {key} must be a whole number, not {value!r}")
        return value
    what = f"device {name!r} {key}"
    if convert is float:
        # the peak and the share of it reached divide every compute time: zero is no device
        check = matmul_efficiency if key == "matmul_efficiency" else (
            positive_number if key in _POSITIVE else non_negative_number)
        return check(value, what)
    return convert(value, what=what)


def make_device_type(name: str, raw: dict[str, Any], base: DeviceType | None = None) -> DeviceType:
    """Build a device type from YAML fields, on top of ``base`` when given."""
    kwargs = device_fields_from_yaml(name, raw)
    if base is not None:
        sources = dict(base.sources)
        sources.update({k: "cluster file" for k in raw if k in _FIELDS})
        return replace(base, name=name, sources=sources, **kwargs)
    for required in ("tflops", "memory_bytes"):
        if required not in kwargs:
            yaml_key = "tflops" if required == "tflops" else "memory"
            raise ConfigError(
                f"device {name!r}: missing {yaml_key}; a custom device needs at least "
                "tflops and memory (or `base: <catalog name>` to start from a known GPU)"
            )
    sources = {str(k): str(v) for k, v in (raw.get("sources") or {}).items()}
    return DeviceType(name=name, sources=sources, **kwargs)


@cache
def catalog() -> dict[str, DeviceType]:
    """All device types shipped with potluck, by name."""
    text = resources.files("potluck.cluster").joinpath("catalog.yaml").read_text()
    entries = yaml.safe_load(text)
    return {name: make_device_type(name, raw) for name, raw in entries.items()}


def source_of(device_type: DeviceType, key: str) -> str:
    """Where the figure of YAML field ``key`` comes from ('' when no source covers it)."""
    sources = device_type.sources
    if key in sources:
        return sources[key]
    for group, keys in SOURCE_GROUPS.items():
        if key in keys and group in sources:
            return sources[group]
    return sources.get("all", "")


def normalize_name(name: str) -> str:
    return str(name).strip().lower().replace("_", "-").replace(" ", "-")


def closest_names(name: str, known: list[str], n: int = 3) -> list[str]:
    """Known names that look like ``name``, best first."""
    wanted = normalize_name(name)
    matches = difflib.get_close_matches(wanted, known, n=n, cutoff=0.4)
    contains = [k for k in known if wanted and (wanted in k or k in wanted)]
    return list(dict.fromkeys(contains + matches))[:n]


def lookup(name: str, custom: dict[str, DeviceType] | None = None) -> DeviceType:
    """Find a device type in the custom types or the catalog, or explain what is close."""
    custom = custom or {}
    if name in custom:
        return custom[name]
    key = normalize_name(name)
    if key in catalog():
        return catalog()[key]
    known = sorted(set(catalog()) | set(custom))
    close = closest_names(name, known)
    hint = f"did you mean {', '.join(close)}?" if close else f"known types: {', '.join(known)}"
    raise ConfigError(
        f"unknown GPU type {name!r}: {hint} (or define it under `devices:` in the cluster file)"
    )
