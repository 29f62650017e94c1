"""Plan files: JSON in and out, validated as a file from someone else (a known version,
every key one the plan has, every field of its type, every number finite, every name as a
cluster file allows it, the model as its own config says and the sequence within its
learned positions), and the JSON schema the README documents."""

from __future__ import annotations

import difflib
import json
import math
from functools import cache
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from potluck.cluster.spec import check_spec
from potluck.errors import ConfigError
from potluck.model.loading import config_contradiction
from potluck.model.spec import check_seq_len
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
    unknown = _unknown_key(data, plan_json_schema())
    if unknown is not None:
        raise ConfigError(f"{label}: {unknown} (or make the plan again with `potluck plan`)")
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
    _check_itself(plan, label)
    return plan


def _check_itself(plan: Plan, label: str) -> None:
    """The plan agrees with itself: its model with the config it carries, its sequence with
    the model's learned positions (:func:`potluck.model.spec.check_seq_len`; beyond rotary
    positions the plan's own note says so)."""
    problem = config_contradiction(plan.model)
    if problem is None:
        try:
            check_seq_len(plan.model, plan.training.seq_len, flag="training.seq_len")
        except ConfigError as err:
            problem = str(err)
    if problem is not None:
        raise ConfigError(f"{label}: {problem}; make the plan again with `potluck plan`")


def _unknown_key(value: Any, schema: dict[str, Any], where: str = "") -> str | None:
    """The first key of ``value`` that ``schema`` (the plan's JSON schema, or a part of it)
    has no place for, with the closest known key; None when there is none."""
    schema = _resolved(schema, value)
    if isinstance(value, dict) and "properties" in schema:
        known = list(schema["properties"])
        for key, item in value.items():
            path = f"{where}.{key}" if where else str(key)
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=1)
                tip = f"did you mean {close[0]!r}?" if close else f"known: {', '.join(known)}"
                return (f"{path}: unknown key, which potluck would ignore (a misspelt setting "
                        f"would be off); {tip}")
            found = _unknown_key(item, schema["properties"][key], path)
            if found is not None:
                return found
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            found = _unknown_key(item, schema["items"], f"{where}.{index}")
            if found is not None:
                return found
    return None


def _resolved(schema: dict[str, Any], value: Any) -> dict[str, Any]:
    """``schema`` with its ``$ref`` followed and, of ``anyOf`` choices, the one for a JSON
    object (or array) when ``value`` is one."""
    if "$ref" in schema:
        schema = plan_json_schema()["$defs"][schema["$ref"].rsplit("/", 1)[1]]
    kind = "object" if isinstance(value, dict) else "array" if isinstance(value, list) else None
    for choice in schema.get("anyOf", ()):
        choice = _resolved(choice, value)
        if kind is not None and choice.get("type") == kind:
            return choice
    return schema


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
    if not path.exists():
        raise ConfigError(f"plan file {str(path)!r} not found; make one with `potluck plan -o`")
    data = parse_json(path, "plan file")
    return plan_from_dict(data, str(path))


def save_plan(plan: Plan, path: str | Path) -> None:
    """Write ``plan`` as JSON (atomically, never through a link; one line if it cannot be)."""
    write_text(path, plan_to_json(plan) + "\n")


@cache
def plan_json_schema() -> dict[str, Any]:
    """The JSON schema of a plan file (documented in the README)."""
    return _adapter().json_schema()
