"""User-facing errors.

Every mistake a user can make (a malformed cluster file, an unknown GPU, a model
that fits nowhere) raises :class:`PotluckError` with one line that says what is
wrong and how to fix it. The CLI prints that line and exits non-zero; it never
shows a traceback for a ``PotluckError``.
"""

from __future__ import annotations


class PotluckError(Exception):
    """A problem with the user's input, explained in one line."""

    exit_code = 2


class ConfigError(PotluckError):
    """A cluster, model, offers or plan file is malformed or inconsistent."""


class InfeasibleError(PotluckError):
    """No plan satisfies the request (memory, divisibility or pins)."""

    exit_code = 3


class TrainingError(PotluckError):
    """Training cannot go on (every step skipped: the state or the settings hold inf/NaN)."""
