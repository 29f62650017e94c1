"""Orderings of candidates: by USD per token, by time to train, by raw TFLOPS per dollar; the Pareto front.

Candidates that miss the deadline always rank after those that meet it. The
Pareto front is the set of candidates no other candidate beats on both time
to train and total cost (it is at least as fast and as cheap, and better on
one of them).
"""

from __future__ import annotations

from collections.abc import Sequence

from potluck.economics.candidates import Candidate


def by_cost(candidates: Sequence[Candidate]) -> list[Candidate]:
    """Cheapest per token first; faster first among equals."""
    return sorted(candidates, key=lambda c: (not c.meets_deadline, c.figures.usd_per_million_tokens,
                                             c.figures.hours_to_train))


def by_time(candidates: Sequence[Candidate]) -> list[Candidate]:
    """Fastest to train the tokens first; cheaper first among equals."""
    return sorted(candidates, key=lambda c: (not c.meets_deadline, c.figures.hours_to_train,
                                             c.figures.usd_per_million_tokens))


def by_rcc(candidates: Sequence[Candidate]) -> list[Candidate]:
    """Most peak TFLOPS per dollar first: the ranking raw compute alone would give."""
    return sorted(candidates, key=lambda c: -c.figures.tflops_per_usd)


def dominates(a: Candidate, b: Candidate) -> bool:
    """``a`` is at least as fast and as cheap as ``b``, and better on one of them."""
    fa, fb = a.figures, b.figures
    no_worse = fa.hours_to_train <= fb.hours_to_train and fa.total_usd <= fb.total_usd
    better = fa.hours_to_train < fb.hours_to_train or fa.total_usd < fb.total_usd
    return no_worse and better


def pareto_front(candidates: Sequence[Candidate]) -> list[Candidate]:
    """The candidates no other one dominates, fastest first."""
    front = [c for c in candidates if not any(dominates(o, c) for o in candidates)]
    return sorted(front, key=lambda c: (c.figures.hours_to_train, c.figures.total_usd))


def positions(ordered: Sequence[Candidate]) -> dict[str, int]:
    """Candidate name -> 1-based rank in ``ordered``."""
    return {c.name: i for i, c in enumerate(ordered, start=1)}
