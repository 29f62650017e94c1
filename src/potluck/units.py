"""Parsing of human-written quantities: bandwidths, sizes, durations, counts.

Users write ``25GB/s``, ``10Gb/s``, ``24GB``, ``20ms`` or ``2B`` tokens; potluck
stores plain floats in SI base units with the unit in the name
(``_bytes_per_s``, ``_bytes``, ``_s``). A bare number is read in the default
unit the caller names (GB/s for bandwidths, GB for memory, seconds for time).
Capital ``B`` means bytes, lower-case ``b`` bits, as on network datasheets.
"""

from __future__ import annotations

import math
import numbers
import re

from potluck.errors import ConfigError

_NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"
_BANDWIDTH = re.compile(_NUMBER + r"\s*([kKmMgGtT]?)([Bb])(?:it)?(?:ps|/s)?$")
_SIZE = re.compile(_NUMBER + r"\s*([kKmMgGtT]?)(i?)[Bb]?$")
_TIME = re.compile(_NUMBER + r"\s*(ns|us|µs|ms|s|min|h)?$")
_COUNT = re.compile(_NUMBER + r"\s*([kKmMbBtT]?)$")

_DECIMAL = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_BINARY = {"": 1.0, "k": 2.0**10, "m": 2.0**20, "g": 2.0**30, "t": 2.0**40}
_TIME_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0, "h": 3600.0}
_COUNT_SCALE = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}

GB = 1e9


def _as_number(value: object) -> float | None:
    """A plain number, or a string that holds only one (read in the default unit)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return _float(value)
    try:
        return float(str(value).strip())
    except ValueError:
        return None


def _float(value: int | float) -> float:
    """``value`` as a float; integers too large for one are infinite (refused as such)."""
    try:
        return float(value)
    except OverflowError:
        return math.inf


def parse_bandwidth_bytes_per_s(value: object, what: str = "bandwidth") -> float:
    """``25GB/s`` -> 25e9, ``10Gb/s`` -> 1.25e9, ``100`` -> 100e9 (bare = GB/s)."""
    number = _as_number(value)
    if number is not None:
        return _positive(number * GB, value, what)
    match = _BANDWIDTH.match(str(value).strip())
    if not match:
        raise ConfigError(
            f"{what}: cannot read {value!r} as a bandwidth; write e.g. 25GB/s, 10Gb/s or 12.5"
        )
    amount, prefix, byte_or_bit = match.groups()
    scale = _DECIMAL[prefix.lower()] / (1.0 if byte_or_bit == "B" else 8.0)
    return _positive(float(amount) * scale, value, what)


def parse_size_bytes(value: object, what: str = "memory") -> float:
    """``24GB`` -> 24e9, ``80GiB`` -> 80*2**30, ``16`` -> 16e9 (bare = GB)."""
    number = _as_number(value)
    if number is not None:
        return _positive(number * GB, value, what)
    match = _SIZE.match(str(value).strip())
    if not match:
        raise ConfigError(f"{what}: cannot read {value!r} as a size; write e.g. 24GB or 80GiB")
    amount, prefix, binary = match.groups()
    table = _BINARY if binary else _DECIMAL
    return _positive(float(amount) * table[prefix.lower()], value, what)


def parse_duration_s(value: object, what: str = "latency") -> float:
    """``20ms`` -> 0.02, ``5us`` -> 5e-6, ``0.5`` -> 0.5 (bare = seconds)."""
    number = _as_number(value)
    if number is not None:
        return _non_negative(number, value, what)
    match = _TIME.match(str(value).strip())
    if not match:
        raise ConfigError(f"{what}: cannot read {value!r} as a duration; write e.g. 20ms or 5us")
    amount, unit = match.groups()
    return _non_negative(float(amount) * _TIME_S[unit or "s"], value, what)


def parse_count(value: object, what: str = "count") -> int:
    """``2B`` -> 2_000_000_000, ``300M``, ``1e9``, ``15k``: a whole, positive number."""
    number = _as_number(value)
    if number is None:
        match = _COUNT.match(str(value).strip())
        if not match:
            raise ConfigError(f"{what}: cannot read {value!r} as a number; write e.g. 2B, 300M or 1e9")
        amount, suffix = match.groups()
        number = float(amount) * _COUNT_SCALE[suffix.lower()]
    if not math.isfinite(number) or number <= 0 or number != int(number):
        raise ConfigError(f"{what}: {value!r} must be a positive whole number")
    return int(number)


def is_real(value: object) -> bool:
    """Whether a value read from a file is a finite int or float (JSON's ``true`` is no
    number, though Python's bool is an int)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def is_positive_real(value: object) -> bool:
    """Whether a value read from a file is a finite number above 0 (:func:`is_real`)."""
    return is_real(value) and value > 0  # type: ignore[operator]


def positive_number(value: object, what: str = "value") -> float:
    """A plain number greater than zero (not a string, not true/false, not inf or nan)."""
    number = _plain_number(value, what, "a positive number")
    if number <= 0:
        raise ConfigError(f"{what}: must be a positive number, not {value!r}")
    return number


def non_negative_number(value: object, what: str = "value") -> float:
    """A plain number of at least zero (not a string, not true/false, not inf or nan)."""
    number = _plain_number(value, what, "a non-negative number")
    if number < 0:
        raise ConfigError(f"{what}: must be a non-negative number, not {value!r}")
    return number


def fraction(value: object, what: str = "value") -> float:
    """A share of a whole: a plain number above 0 and at most 1 (0.7, not 70)."""
    number = positive_number(value, what)
    if number > 1:
        raise ConfigError(f"{what}: must be a fraction above 0 and at most 1 (0.7 for 70%), "
                          f"not {value!r}")
    return number


MAX_COUNT = 2**31 - 1  # steps, sequences, rows: what a 32-bit index holds
MAX_PORT = 65535


def whole_number(value: object, what: str = "count", least: int = 1,
                 most: int = MAX_COUNT) -> int:
    """A whole number from ``least`` to ``most`` (not true/false, not a float; a numpy
    integer is one)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"{what} must be a whole number, not {value!r}")
    if value < least:
        raise ConfigError(f"{what} must be at least {least}, not {value}")
    if value > most:
        raise ConfigError(f"{what} must be at most {most:,}, not {value:,}")
    return value


def port_number(value: object, what: str = "port") -> int:
    """A TCP port: a whole number from 1 to 65535."""
    return whole_number(value, what, 1, MAX_PORT)


def _plain_number(value: object, what: str, kind: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{what}: must be {kind}, not {value!r}")
    return _finite(_float(value), value, what)


def _finite(number: float, raw: object, what: str) -> float:
    if not math.isfinite(number):
        raise ConfigError(f"{what}: {raw!r} is not a finite number (or too large for one); "
                          "write a figure such as 12.5")
    return number


def _positive(number: float, raw: object, what: str) -> float:
    if _finite(number, raw, what) <= 0:
        raise ConfigError(f"{what}: {raw!r} must be greater than zero")
    return number


def _non_negative(number: float, raw: object, what: str) -> float:
    if _finite(number, raw, what) < 0:
        raise ConfigError(f"{what}: {raw!r} must not be negative")
    return number


def format_bandwidth(bytes_per_s: float) -> str:
    """25e9 -> '25 GB/s'; 1.25e8 -> '125 MB/s'."""
    for scale, unit in ((1e12, "TB/s"), (1e9, "GB/s"), (1e6, "MB/s"), (1e3, "kB/s")):
        if bytes_per_s >= scale:
            return f"{bytes_per_s / scale:.3g} {unit}"
    return f"{bytes_per_s:.3g} B/s"


def format_duration(seconds: float) -> str:
    """0.0123 -> '12.3 ms'."""
    if seconds >= 1.0:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} µs"
