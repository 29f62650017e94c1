"""Quantities as users write them: bandwidths in GB/s and Gb/s, sizes, durations, counts."""

import pytest

from potluck.errors import ConfigError
from potluck.units import (
    parse_bandwidth_bytes_per_s,
    parse_count,
    parse_duration_s,
    parse_size_bytes,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("25GB/s", 25e9), ("10Gb/s", 1.25e9), ("100Gbps", 12.5e9), ("1Gb/s", 125e6),
     ("500MB/s", 500e6), ("12.5", 12.5e9), (3, 3e9), ("10 Gbit/s", 1.25e9)],
)
def test_bandwidth_capital_b_is_bytes_lower_b_is_bits_bare_is_gb_per_s(text, expected):
    assert parse_bandwidth_bytes_per_s(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["fast", "10 furlongs", "-5GB/s", "0"])
def test_unreadable_or_non_positive_bandwidth_is_rejected(text):
    with pytest.raises(ConfigError):
        parse_bandwidth_bytes_per_s(text)


def test_sizes_are_decimal_unless_binary_prefix():
    assert parse_size_bytes("24GB") == 24e9
    assert parse_size_bytes("80GiB") == 80 * 2**30
    assert parse_size_bytes(16) == 16e9


def test_durations():
    assert parse_duration_s("20ms") == pytest.approx(0.02)
    assert parse_duration_s("5us") == pytest.approx(5e-6)
    assert parse_duration_s(0.5) == 0.5


@pytest.mark.parametrize(("text", "expected"), [("2B", 2_000_000_000), ("300M", 300_000_000),
                                                ("1e9", 10**9), ("15k", 15_000), (42, 42)])
def test_token_counts(text, expected):
    assert parse_count(text) == expected


def test_fractional_count_is_rejected():
    with pytest.raises(ConfigError):
        parse_count("1.5")
