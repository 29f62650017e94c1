"""Reading the files users give: YAML that remembers line numbers, so errors can point at
the bad line, and JSON; a file that is not UTF-8 text is one clear error, not a traceback.

``load_yaml`` returns plain ``dict``/``list`` subclasses that carry the line of
each key and item. :class:`Fields` reads one mapping with typed getters and
prefixes every error with ``file:line``. ``read_text`` and ``parse_json`` serve the
JSON files (plans, model configs).

Every file potluck reads from the user or from a run directory goes through
:func:`read_bounded`: a regular file of at most a stated size, read once through one
descriptor, so a link to ``/dev/zero``, a FIFO or a file of terabytes is one line instead
of an exhausted memory or a hang.
"""

from __future__ import annotations

import difflib
import json
import os
import stat
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import yaml

from potluck.errors import ConfigError

T = TypeVar("T")


class LineDict(dict):
    """A mapping from YAML with the 1-based line of itself and of each key."""

    line: int = 0
    key_lines: dict[Any, int]


class LineList(list):
    """A sequence from YAML with the 1-based line of itself and of each item."""

    line: int = 0
    item_lines: list[int]


class _LineLoader(yaml.SafeLoader):
    pass


def _construct_mapping(loader: _LineLoader, node: yaml.MappingNode) -> LineDict:
    _check_keys_once(loader, node)
    loader.flatten_mapping(node)
    result = LineDict()
    result.line = node.start_mark.line + 1
    result.key_lines = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        result[key] = loader.construct_object(value_node, deep=True)
        result.key_lines[key] = key_node.start_mark.line + 1
    return result


def _check_keys_once(loader: _LineLoader, node: yaml.MappingNode) -> None:
    """Every key of a mapping written once (YAML would keep the last silently) and a
    name or number, not a list or mapping. Keys a merge (``<<: *base``) brings may be
    written again: that overrides them."""
    first_lines: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        if isinstance(key, list | dict):
            raise yaml.constructor.ConstructorError(
                None, None, "a key must be a name or a number, not a list or mapping",
                key_node.start_mark)
        if key in first_lines:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} is written twice in one mapping (first at line "
                f"{first_lines[key]}; YAML would keep the last silently); keep one",
                key_node.start_mark)
        first_lines[key] = line


def _construct_sequence(loader: _LineLoader, node: yaml.SequenceNode) -> LineList:
    result = LineList(loader.construct_object(child, deep=True) for child in node.value)
    result.line = node.start_mark.line + 1
    result.item_lines = [child.start_mark.line + 1 for child in node.value]
    return result


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_SEQUENCE_TAG, _construct_sequence)


def load_yaml(path: str | Path, what: str) -> Any:
    """Parse a YAML file; a missing or malformed file is one clear ConfigError."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{what} {str(path)!r} not found; check the path")
    return parse_yaml(read_text(path, what), str(path))


MAX_FILE_BYTES = 64 << 20  # a cluster, plan, model, jobs or checkpoint JSON/YAML file
MAX_LOG_BYTES = 1 << 30  # a run's metrics.jsonl, trace.json or log: ~2 million steps' rows


def read_bounded(path: str | Path, what: str, max_bytes: int = MAX_FILE_BYTES) -> bytes:
    """The bytes of ``path``; one ConfigError when it is not a regular file (a device, a
    FIFO, a directory), holds more than ``max_bytes`` or cannot be read."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO must not block
    except OSError as err:
        raise ConfigError(f"{path}: cannot read the {what} ({err.strerror or err})") from None
    with os.fdopen(descriptor, "rb") as file:
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode):
            raise ConfigError(f"{path}: the {what} is {_kind(status.st_mode)}, not a regular file")
        try:  # a file that grows after fstat is caught by the length read
            data = file.read(max_bytes + 1) if status.st_size <= max_bytes else b""
        except OSError as err:
            raise ConfigError(f"{path}: cannot read the {what} ({err.strerror or err})") from None
    if status.st_size > max_bytes or len(data) > max_bytes:
        raise ConfigError(f"{path}: the {what} is larger than {max_bytes:,} bytes, more than "
                          "potluck reads from such a file; is it the right file?")
    return data


def _kind(mode: int) -> str:
    kinds = {stat.S_ISDIR: "a directory", stat.S_ISCHR: "a character device",
             stat.S_ISBLK: "a block device", stat.S_ISFIFO: "a FIFO",
             stat.S_ISSOCK: "a socket"}
    return next((name for test, name in kinds.items() if test(mode)), "not a file")


def read_text(path: Path, what: str, max_bytes: int = MAX_FILE_BYTES) -> str:
    """The file's text (see :func:`read_bounded`); one ConfigError when it cannot be read or
    is not UTF-8 text."""
    data = read_bounded(path, what, max_bytes)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: the {what} is not UTF-8 text (byte {err.start} is "
                          f"{err.object[err.start:err.start + 1]!r}); give a text file") from None


def parse_json(path: Path, what: str) -> Any:
    """A JSON file's value; one ConfigError naming the line when it is malformed."""
    text = read_text(path, what)
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}:{err.lineno}: malformed JSON: {err.msg}") from None
    except (ValueError, RecursionError) as err:  # an integer of thousands of digits, deep nesting
        raise ConfigError(f"{path}: the {what} cannot be read as JSON ({err})") from None


MAX_VALUES = 100_000  # values a file may expand to (YAML aliases may repeat one many times)


def parse_yaml(text: str, label: str) -> Any:
    """The YAML document in ``text``; one ConfigError when it is malformed, nested too deeply
    or expands (through aliases: ``*a`` repeats what ``&a`` names) to more than
    :data:`MAX_VALUES` values."""
    data = _load(text, label)
    if _count_values(data, MAX_VALUES) > MAX_VALUES:
        raise ConfigError(f"{label}: the file expands to more than {MAX_VALUES:,} values "
                          "(through YAML aliases *name); write the values out")
    return data


def _count_values(value: Any, budget: int) -> int:
    """How many values ``value`` holds, counting a repeated alias each time; stops past
    ``budget``, so the count takes at most that many steps."""
    count, pending = 0, [value]
    while pending and count <= budget:
        item = pending.pop()
        count += 1
        if isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return count


def _load(text: str, label: str) -> Any:
    try:
        return yaml.load(text, Loader=_LineLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark
        line = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{label}{line}: malformed YAML: {err.problem}") from None
    except yaml.YAMLError as err:  # e.g. a control character: "unacceptable character #x0005"
        raise ConfigError(f"{label}: malformed YAML: {' '.join(str(err).split())}") from None
    except RecursionError:
        raise ConfigError(f"{label}: malformed YAML: nested too deeply") from None


class Fields:
    """Typed access to one YAML mapping; errors carry ``file:line``."""

    def __init__(self, data: Any, label: str, where: str, line: int = 0) -> None:
        self.label = label
        self.where = where
        self.line = getattr(data, "line", line)
        if not isinstance(data, dict):
            raise ConfigError(f"{self._at(self.line)}{where} must be a mapping (key: value)")
        self.data = data
        self.key_lines: dict[Any, int] = getattr(data, "key_lines", {})

    def _at(self, line: int) -> str:
        return f"{self.label}:{line}: " if line else f"{self.label}: "

    def line_of(self, key: str) -> int:
        return self.key_lines.get(key, self.line)

    def error(self, key: str | None, message: str) -> ConfigError:
        line = self.line_of(key) if key is not None else self.line
        field_name = f"{self.where}.{key}" if key is not None else self.where
        return ConfigError(f"{self._at(line)}{field_name}: {message}")

    def check_keys(self, allowed: Iterable[str]) -> None:
        allowed = list(allowed)
        for key in self.data:
            if key not in allowed:
                close = difflib.get_close_matches(str(key), allowed, n=1)
                tip = f"did you mean {close[0]!r}?" if close else f"allowed: {', '.join(allowed)}"
                raise self.error(str(key), f"unknown key; {tip}")

    def has(self, key: str) -> bool:
        return key in self.data and self.data[key] is not None

    def get(self, key: str, convert: Callable[[Any], T], default: T | None = None) -> T:
        if not self.has(key):
            if default is None:
                raise self.error(key, "is required")
            return default
        try:
            return convert(self.data[key])
        except ConfigError as err:
            raise self.error(key, _without_subject(str(err))) from None
        except (TypeError, ValueError) as err:
            raise self.error(key, f"bad value {self.data[key]!r} ({err})") from None

    def optional(self, key: str, convert: Callable[[Any], T]) -> T | None:
        if not self.has(key):
            return None
        return self.get(key, convert)


def _without_subject(message: str) -> str:
    """``bandwidth: cannot read ...`` without its ``bandwidth: `` (the caller names the key);
    a message that only holds ``: `` in a value it shows (``not {'a': 1}``) stays whole."""
    subject, colon, rest = message.partition(": ")
    return rest if colon and not any(c.isspace() for c in subject) else message


def positive_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"must be a whole number of at least 1, not {value!r}")
    return value


def non_empty_str(value: Any) -> str:
    if not isinstance(value, str | int) or not str(value).strip():
        raise ConfigError(f"must be a name, not {value!r}")
    return str(value).strip()
