"""The non-tensor leaves of a checkpointed state, kept as JSON instead of pickles.

A training state is nested dicts whose leaves are tensors (weights, optimizer
moments) or plain values (an optimizer's param-group settings: ``lr``,
``betas``, ``foreach``...). Tensors go to the safetensors shards; the plain
values go to ``values.json``, keyed by their dotted path
(``optim.param_groups.model.norm.weight.betas``), because DCP would pickle
them. On load each value takes the type of the live one it replaces (JSON
has lists where the optimizer had tuples, and may write ``1`` for ``1.0``), and an
optimizer setting must hold a value the optimizer can step with
(:func:`settings_problem`: a finite, non-negative ``lr``, ``betas`` in [0, 1), a bool
``foreach``...), so that a crafted ``values.json`` is refused instead of training NaN.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from potluck.errors import ConfigError
from potluck.units import is_real

VALUES = "values.json"
_PLAIN = (bool, int, float, str, type(None))


def split_state(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(tensors, values)``: the state's tensors in its own nesting, its other leaves flat."""
    tensors: dict[str, Any] = {}
    values: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, Mapping):
            inner, inner_values = split_state(value)
            if inner:
                tensors[key] = inner
            values.update({f"{key}.{k}": v for k, v in inner_values.items()})
        elif isinstance(value, torch.Tensor):
            tensors[key] = value
        else:
            values[key] = _checked_plain(key, value)
    return tensors, values


def _checked_plain(key: str, value: Any) -> Any:
    """``value`` if JSON holds it as it is (lists and tuples of plain values too)."""
    items = value if isinstance(value, list | tuple) else (value,)
    if not all(isinstance(item, _PLAIN) for item in items):
        raise TypeError(f"cannot checkpoint {key!r}: a {type(value).__name__} is neither a "
                        "tensor nor a plain value")
    return value


def values_text(values: Mapping[str, Any]) -> str:
    return json.dumps(dict(sorted(values.items())), indent=1)


def read_values(text: str) -> dict[str, Any]:
    try:
        values = json.loads(text)
    except ValueError:
        values = None
    if not isinstance(values, dict):
        raise ConfigError(f"{VALUES} of the checkpoint is not a JSON object")
    return values


def values_problem(state: Mapping[str, Any], saved: Mapping[str, Any]) -> str | None:
    """The first plain value ``state`` asks for that ``saved`` lacks or holds as another type
    (checked before loading, so that every rank can refuse together)."""
    for key, live in _plain_leaves(state, ""):
        if key not in saved:
            return f"it has no value {key!r}"
        try:
            _like(live, saved[key], key)
        except ConfigError as err:
            return str(err).removeprefix("checkpoint ")
    return None


def settings_problem(saved: Mapping[str, Any]) -> str | None:
    """The first saved optimizer setting no optimizer can step with (see
    :func:`setting_problem`); None: every one can."""
    return next(filter(None, (setting_problem(key, value) for key, value in saved.items())), None)


def setting_problem(key: str, value: Any) -> str | None:
    """Why the saved optimizer setting ``key`` (a dotted path ending in the setting's name:
    ``optim.param_groups.model.norm.weight.lr``) cannot be stepped with; None: it can, or
    the setting has no rule here. Add a rule to :data:`SETTING_RULES` with a new setting."""
    name = key.rsplit(".", 1)[-1]
    rule = SETTING_RULES.get(name) if key.startswith("optim.param_groups.") else None
    if rule is None or value is None:
        return None
    wanted = rule[1]
    return None if rule[0](value) else f"value {key!r} is {value!r}; it must be {wanted}"


def _non_negative(value: Any) -> bool:
    return is_real(value) and value >= 0


def _betas(value: Any) -> bool:
    return (isinstance(value, list | tuple) and len(value) == 2
            and all(is_real(beta) and 0 <= beta < 1 for beta in value))


def _flag(value: Any) -> bool:
    return isinstance(value, bool)


_NON_NEGATIVE = (_non_negative, "a finite number of at least 0")
_FLAG = (_flag, "true or false")
SETTING_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "lr": _NON_NEGATIVE, "initial_lr": _NON_NEGATIVE, "eps": _NON_NEGATIVE,
    "weight_decay": _NON_NEGATIVE, "momentum": _NON_NEGATIVE, "dampening": _NON_NEGATIVE,
    "betas": (_betas, "two finite numbers in [0, 1)"),
    "foreach": _FLAG, "fused": _FLAG, "capturable": _FLAG, "differentiable": _FLAG,
    "maximize": _FLAG, "amsgrad": _FLAG, "nesterov": _FLAG, "decoupled_weight_decay": _FLAG,
}
"""Each optimizer setting's test and what it must be (None passes: torch's "default")."""


def restore_values(state: dict[str, Any], saved: Mapping[str, Any], prefix: str = "") -> None:
    """Put the saved plain values into ``state`` in place, each with its live value's type."""
    for key, value in state.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            restore_values(value, saved, path + ".")  # type: ignore[arg-type]
        elif not isinstance(value, torch.Tensor):
            state[key] = _like(value, saved[path], path)


def _like(live: Any, saved: Any, key: str) -> Any:
    """``saved`` in the type of ``live``: a tuple for a tuple, a float for a float."""
    if isinstance(live, tuple) and isinstance(saved, list):
        return tuple(saved)
    if isinstance(live, float) and isinstance(saved, int) and not isinstance(saved, bool):
        return float(saved)
    if live is not None and saved is not None and not isinstance(saved, type(live)):
        raise ConfigError(f"checkpoint value {key!r} is a {type(saved).__name__}, "
                          f"this run has a {type(live).__name__} there")
    return saved


def _plain_leaves(state: Mapping[str, Any], prefix: str) -> Iterator[tuple[str, Any]]:
    for key, value in state.items():
        if isinstance(value, Mapping):
            yield from _plain_leaves(value, f"{prefix}{key}.")
        elif not isinstance(value, torch.Tensor):
            yield f"{prefix}{key}", value
