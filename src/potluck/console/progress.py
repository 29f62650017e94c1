"""Progress of work counted in steps (an offer planned, a search run), shown on a console.

On a terminal: a bar with the steps done, the time so far and the time left. Anywhere
else (a pipe, a log file, CI), lines, so that a long run is never silent and says early
how long it will take: one when the work starts (how many steps), one with the time it
will take once the pace is known (after :data:`ESTIMATE_AFTER_S` or the first tenth of the
steps, whichever comes first), one after each further tenth, and one at the end. Times
extrapolate the pace so far over the steps left.

The work reports through a callback ``progress(done, total, what)``: ``done`` steps of
``total`` are done, ``what`` names the last one (``done`` 0 at the start). Where ``total``
is a bound (:attr:`Steps.bounded`: a schedule searches only what its policy asks for),
the lines say "up to" and the work may end below it.

Work that reports a fraction of a bound instead (one search: ``progress(fraction)`` of
every memory level it may try, :func:`fraction_progress`) is silent off a terminal for its
first :data:`QUIET_FOR_S` seconds, then says how far it is and, at most, how long it will
take, and again after each further tenth.

``POTLUCK_PROGRESS=0`` in the environment silences the lines (not the bar on a terminal).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

ESTIMATE_AFTER_S = 1.0  # the first estimate, unless a tenth of the steps comes sooner
LINES = 10  # lines between the first and the last: one per tenth

QUIET_FOR_S = 2.0  # a fraction-reporting search says nothing off a terminal before this
QUIET_ENV = "POTLUCK_PROGRESS"  # "0": no progress lines off a terminal

StepCallback = Callable[[int, int, str], None]


def lines_wanted() -> bool:
    """Whether progress lines may be written off a terminal (see :data:`QUIET_ENV`)."""
    return os.environ.get(QUIET_ENV, "1") != "0"


@dataclass(frozen=True)
class Steps:
    """How the lines name the work: ``planning offer 3/136``, ``planned 136 offers``."""

    noun: str  # one step: "offer"
    plural: str  # "offers"
    detail: str = ""  # what a step is, said once at the start: "a search each"
    bounded: bool = False  # the total is a bound the work may stay under
    verb: str = "planning"
    done_verb: str = "planned"


@contextmanager
def step_progress(console: Console, steps: Steps) -> Iterator[StepCallback]:
    """A ``progress(done, total, what)`` callback showing on ``console`` (see the module
    docstring)."""
    if console.is_terminal:
        with _bar(console, steps) as update:
            yield update
        return
    if not lines_wanted():
        yield lambda done, total, what: None
        return
    lines = _Lines(console, steps)
    yield lines.update
    lines.finish()


@contextmanager
def fraction_progress(console: Console, label: str, *, enabled: bool = True
                      ) -> Iterator[Callable[[float], None] | None]:
    """A ``progress(fraction)`` callback for work that reports the fraction done of a bound
    (see the module docstring); None where ``enabled`` is False."""
    if not enabled:
        yield None
        return
    if console.is_terminal:
        bar = Progress(TextColumn(label), BarColumn(), TimeElapsedColumn(),
                       TextColumn("at most"), TimeRemainingColumn(), console=console,
                       transient=True)
        task = bar.add_task(label, total=1.0)
        with bar:
            yield lambda fraction: bar.update(task, completed=fraction)
        return
    if not lines_wanted():
        yield lambda fraction: None
        return
    lines = _FractionLines(console, label)
    yield lines.update
    lines.finish()


@contextmanager
def _bar(console: Console, steps: Steps) -> Iterator[StepCallback]:
    bar = Progress(TextColumn(f"{steps.verb} {steps.plural}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn(),
                   TextColumn("{task.description}"), console=console, transient=True)
    task = bar.add_task("", total=None)
    with bar:
        yield lambda done, total, what: bar.update(task, completed=done, total=total,
                                                   description=what)


class _Lines:
    """The lines of a run that is not on a terminal."""

    def __init__(self, console: Console, steps: Steps) -> None:
        self.console, self.steps = console, steps
        self.started = time.monotonic()
        self.done, self.total = 0, 0
        self.estimated, self.finished = False, False
        self.tenths_said = 0

    def update(self, done: int, total: int, what: str) -> None:
        if done == 0:
            self.started, self.total = time.monotonic(), total
            detail = f" ({self.steps.detail})" if self.steps.detail else ""
            self._say(f"{self.steps.verb} {'up to ' if self.steps.bounded else ''}{total} "
                      f"{self.steps.plural}{detail}; how long it takes follows from the first ones")
            return
        self.done, self.total = done, total
        elapsed_s = time.monotonic() - self.started
        if done >= total:
            self.finish()
            return
        tenths = done * LINES // total
        if not self.estimated and (elapsed_s >= ESTIMATE_AFTER_S or tenths >= 1):
            self.estimated, self.tenths_said = True, tenths
            self._say(self._where(done, total, what, elapsed_s)
                      + f", {self._about()} {elapsed_s / done * total:.0f} s in all")
        elif self.estimated and tenths > self.tenths_said:
            self.tenths_said = tenths
            self._say(self._where(done, total, what, elapsed_s)
                      + f", {self._about()} {elapsed_s / done * (total - done):.0f} s left")

    def finish(self) -> None:
        """The last line, once: how many steps in how long."""
        if self.finished or not self.done:
            return
        self.finished = True
        elapsed_s = time.monotonic() - self.started
        unused = (f" (the other {self.total - self.done} were not needed)"
                  if self.done < self.total else "")
        self._say(f"{self.steps.done_verb} {self.done} {self.steps.plural} in {elapsed_s:.0f} s"
                  + unused)

    def _about(self) -> str:
        return "at most about" if self.steps.bounded else "about"

    def _where(self, done: int, total: int, what: str, elapsed_s: float) -> str:
        count = f"{done} of up to {total}" if self.steps.bounded else f"{done}/{total}"
        return f"{self.steps.verb} {self.steps.noun} {count} ({what}): {elapsed_s:.0f} s so far"

    def _say(self, line: str) -> None:
        self.console.print(line, highlight=False, markup=False, soft_wrap=True)


class _FractionLines:
    """The lines of a fraction-reporting run off a terminal, after :data:`QUIET_FOR_S`."""

    def __init__(self, console: Console, label: str) -> None:
        self.console, self.label = console, label
        self.started = time.monotonic()
        self.tenths_said = -1

    def update(self, fraction: float) -> None:
        elapsed_s = time.monotonic() - self.started
        tenths = int(fraction * LINES)
        if elapsed_s < QUIET_FOR_S or fraction <= 0 or tenths <= self.tenths_said:
            return
        left_s = elapsed_s / fraction * (1 - fraction)
        first = self.tenths_said < 0
        self.tenths_said = tenths
        bound = (" (the bound: it stops at the first memory level whose plans the next "
                 "could not better)") if first else ""
        self.console.print(f"{self.label}: {fraction:.0%} after {elapsed_s:.0f} s, at most "
                           f"about {left_s:.0f} s left{bound}", highlight=False, markup=False,
                           soft_wrap=True)

    def finish(self) -> None:
        """The last line, where the run said anything before."""
        if self.tenths_said >= 0:
            self.console.print(f"{self.label}: done in {time.monotonic() - self.started:.0f} s",
                               highlight=False, markup=False, soft_wrap=True)
