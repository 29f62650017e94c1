"""The islands' outer cycle, drawn: one period of H inner steps with each fragment's (diloco)
or push's (bounded) exchange laid out in time, and the part of it training waits for.

The exchange's bytes, time and amortized exposed part are
:mod:`potluck.planner.islands.exchange`'s (its one owner); a fragment takes the owner's whole
exchange time over F. This module only lays them out, following the runtime
(:mod:`potluck.runtime.grads.islands`):

- after inner step ``n`` (1-based) every fragment due by
  :meth:`~potluck.plans.islands.Islands.exchanges_at` is sent, and every exchange due to be
  applied after step ``n`` is waited for: diloco ``overlap_steps`` steps after it was sent
  (blocking with one fragment), bounded ``staleness`` pushes (H steps each) later;
- the link between the islands carries one exchange at a time (the owner's time is the whole
  link's): an exchange starts once it is sent and the one before it has arrived.

An inner step lasts the simulated iteration plus what it waits for after it. The drawn period
is a steady one (earlier periods are laid out first), so a fragment sent after step H is
applied in the next period (``applied_after_step`` past H). Its total wait over H equals the
owner's ``exposed_per_step_s``: for bounded beyond ``staleness`` 1 too, as the link carries
one push per period (``exchange - H steps`` per period, whatever the staleness).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from potluck.planner.islands.exchange import OuterExchange
from potluck.plans.islands import Islands, SyncMethod


@dataclass(frozen=True)
class InnerStep:
    """One inner step of the drawn period (times from the period's start)."""

    step: int  # 1..H
    start_s: float
    end_s: float  # its compute, then what it waits for
    waited_s: float  # the exchanges applied after it that had not arrived


@dataclass(frozen=True)
class OuterSend:
    """One fragment's (diloco) or push's (bounded) exchange, sent in the drawn period."""

    fragment: int
    sent_after_step: int  # 1..H
    start_s: float  # on the link
    end_s: float
    applied_after_step: int  # past H: in the next period
    waited_s: float  # the part of it training waits for


@dataclass(frozen=True)
class OuterCycle:
    """One steady outer period of a plan whose islands synchronize rarely."""

    sync: SyncMethod
    step_s: float  # one simulated inner step, without waits
    steps: tuple[InnerStep, ...]
    sends: tuple[OuterSend, ...]

    @property
    def waited_s(self) -> float:
        """What training waits for over the period."""
        return sum(step.waited_s for step in self.steps)

    @property
    def period_s(self) -> float:
        return self.steps[-1].end_s

    def as_dict(self) -> dict[str, Any]:
        """The figures of ``potluck simulate --json``'s ``outer_cycle``."""
        return {"sync": self.sync.value, "inner_steps": len(self.steps),
                "period_s": self.period_s, "waited_s": self.waited_s,
                "sends": [{"fragment": s.fragment, "sent_after_step": s.sent_after_step,
                           "start_s": s.start_s, "end_s": s.end_s,
                           "applied_after_step": s.applied_after_step,
                           "waited_s": s.waited_s} for s in self.sends]}


@dataclass
class _Flight:
    fragment: int
    sent: int  # absolute step
    due: int  # absolute step it is applied after
    start_s: float
    end_s: float
    waited_s: float = 0.0


def apply_delay_steps(islands: Islands) -> int:
    """Inner steps between sending an exchange and applying it (0: blocking)."""
    if islands.sync is SyncMethod.BOUNDED:
        return islands.staleness * islands.inner_steps
    return islands.overlap_steps


def outer_cycle(islands: Islands, exchange: OuterExchange, step_s: float) -> OuterCycle | None:
    """The drawn period of ``islands`` (None unless they synchronize rarely), inner steps of
    ``step_s`` seconds and ``exchange`` from the owner."""
    if not islands.split:
        return None
    h, delay = islands.inner_steps, apply_delay_steps(islands)
    lag = math.ceil(delay / h)
    drawn = lag + 2  # steady by then (module docstring), and its sends applied by the last
    fragment_s = exchange.exchange_s / islands.fragments
    steps: list[InnerStep] = []
    flights: list[_Flight] = []
    now_s = link_free_s = 0.0
    for n in range(1, (drawn + lag) * h + 1):
        computed_s = now_s + step_s
        for fragment in range(islands.fragments):
            if islands.exchanges_at(n, fragment):
                start_s = max(computed_s, link_free_s)
                link_free_s = start_s + fragment_s
                flights.append(_Flight(fragment, n, n + delay, start_s, link_free_s))
        waited_until_s = computed_s
        for flight in sorted((f for f in flights if f.due == n), key=lambda f: f.end_s):
            flight.waited_s = max(0.0, flight.end_s - waited_until_s)
            waited_until_s = max(waited_until_s, flight.end_s)
        steps.append(InnerStep(n, now_s, waited_until_s, waited_until_s - computed_s))
        now_s = waited_until_s
    return _period(islands.sync, step_s, steps, flights, (drawn - 1) * h, h)


def _period(sync: SyncMethod, step_s: float, steps: list[InnerStep], flights: list[_Flight],
            first: int, h: int) -> OuterCycle:
    """Steps ``first + 1 .. first + h`` and the exchanges sent after them, from the period's
    start."""
    origin_s = steps[first].start_s
    period = tuple(InnerStep(s.step - first, s.start_s - origin_s, s.end_s - origin_s,
                             s.waited_s) for s in steps[first:first + h])
    sends = tuple(OuterSend(f.fragment, f.sent - first, f.start_s - origin_s,
                            f.end_s - origin_s, f.due - first, f.waited_s)
                  for f in flights if first < f.sent <= first + h)
    return OuterCycle(sync, step_s, period, tuple(sorted(sends, key=lambda s: s.sent_after_step)))
