"""Plan files: JSON in and out, validated as a file from someone else (a known version,
every field of its type, every number finite, every name as a cluster file allows it),
and the JSON schema the README documents."""

from __future__ import annotations

import json
import math
from functools import cache
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from potluck.cluster.spec import check_spec
from potluck.errors import ConfigError
from potluck.plans.data import PLAN_VERSION, Plan
from potluck.safe_files import write_text
from potluck.yamlio import parse_json


@cache
def _adapter() -> TypeAdapter:
    return TypeAdapter(Plan)


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    return _adapter().dump_python(plan, mode="json")


def plan_to_json(plan: Plan, indent: int | None = 2) -> str:
    return json.dumps(plan_to_dict(plan), indent=indent)


def plan_from_dict(data: Any, label: str = "plan") -> Plan:
    """A plan from its JSON form, validated as a file from someone else: a known version,
    every field of its type, every number finite (counts and sizes at least 1), every name
    as a cluster file allows it (:func:`potluck.cluster.spec.check_spec`)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{label}: a plan must be a JSON object")
    _check_version(data, label)
    data = _upgraded(data)
    where = _non_finite(data)
    if where is not None:
        raise ConfigError(f"{label}: {where}: is not a finite number; make the plan again "
                          "with `potluck plan`")
    try:
        plan = _adapter().validate_python(data)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise ConfigError(f"{label}: {where}: {first['msg']}; fix it or make the plan again "
                          "with `potluck plan`") from None
    except ConfigError as err:  # a dataclass's own check (e.g. ModelSpec's shape)
        raise ConfigError(f"{label}: {err}") from None
    try:
        check_spec(plan.cluster)
    except ConfigError as err:
        raise ConfigError(f"{label}: cluster: {err}") from None
    return plan


def _upgraded(data: dict[str, Any]) -> dict[str, Any]:
    """A plan written before ZeRO had stages: ``zero1: true`` is ``zero: 1``."""
    if "zero1" not in data:
        return data
    upgraded = {key: value for key, value in data.items() if key != "zero1"}
    upgraded.setdefault("zero", 1 if data["zero1"] is True else 0)
    return upgraded


def _check_version(data: dict[str, Any], label: str) -> None:
    if "version" not in data:
        raise ConfigError(f"{label}: the plan has no 'version' (this potluck reads version "
                          f"{PLAN_VERSION}); make the plan again with `potluck plan`")
    version = data["version"]
    if isinstance(version, bool) or version != PLAN_VERSION:
        raise ConfigError(
            f"{label}: plan version {version!r} is not supported (this potluck reads "
            f"version {PLAN_VERSION}); make the plan again with `potluck plan`"
        )


def _non_finite(value: Any, where: str = "") -> str | None:
    """The path (``cluster.nodes.0.inter_bandwidth_bytes_per_s``) of the first NaN or
    infinite number in a JSON value, None when every number is finite."""
    if isinstance(value, float) and not math.isfinite(value):
        return where or "(top level)"
    items = value.items() if isinstance(value, dict) else (
        enumerate(value) if isinstance(value, list) else ())
    for key, item in items:
        found = _non_finite(item, f"{where}.{key}" if where else str(key))
        if found is not None:
            return found
    return None


def load_plan(path: str | Path) -> Plan:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"plan file {str(path)!r} not found; make one with `potluck plan -o`")
    data = parse_json(path, "plan file")
    return plan_from_dict(data, str(path))


def save_plan(plan: Plan, path: str | Path) -> None:
    """Write ``plan`` as JSON (atomically, never through a link; one line if it cannot be)."""
    write_text(path, plan_to_json(plan) + "\n")


def plan_json_schema() -> dict[str, Any]:
    """The JSON schema of a plan file (documented in the README)."""
    return _adapter().json_schema()
