"""A cost study: which offer trains a model's N tokens cheapest, and which fastest.

:func:`cost_study` plans every offer (from an offers file or the catalog),
prices each offer's cheapest plan and returns a :class:`CostStudy` with the
candidates ranked by USD per million tokens, the offers skipped and why, and
the Pareto front of time against cost. ``potluck cost`` renders it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from potluck.economics import rank
from potluck.economics.candidates import (
    Candidate,
    CostRequest,
    OfferProgress,
    Skipped,
    evaluate_offers,
)
from potluck.economics.offers import Offer
from potluck.errors import InfeasibleError
from potluck.model.spec import ModelSpec
from potluck.planner.options import SearchOptions
from potluck.planner.requests.memo import PlanMemo
from potluck.plans import TrainingShape

MAX_REASONS_SHOWN = 3  # offers named in the error when none can train the model


@dataclass(frozen=True)
class CostStudy:
    """Candidates ranked by USD per token (those missing the deadline last)."""

    model: ModelSpec
    training: TrainingShape
    request: CostRequest
    candidates: tuple[Candidate, ...]
    skipped: tuple[Skipped, ...]
    search_time_s: float
    notes: tuple[str, ...] = ()  # what the request means for every candidate

    @property
    def best(self) -> Candidate:
        return self.candidates[0]

    @property
    def fastest(self) -> Candidate:
        return rank.by_time(self.candidates)[0]

    @property
    def pareto(self) -> list[Candidate]:
        return rank.pareto_front(self.candidates)


def cost_study(model: ModelSpec, training: TrainingShape, offers: list[Offer], request: CostRequest,
               options: SearchOptions | None = None, progress: OfferProgress | None = None,
               memo: PlanMemo | None = None) -> CostStudy:
    """Plan and price every offer; raise InfeasibleError when none can train the model.
    ``memo`` shares the searches with other studies of the same offers (other prices)."""
    started = time.perf_counter()
    candidates, skipped = evaluate_offers(offers, model, training, request, options, progress,
                                          memo)
    if not candidates:
        raise InfeasibleError(_nothing_left(model, offers, skipped))
    return CostStudy(model, training, request, tuple(rank.by_cost(candidates)), tuple(skipped),
                     time.perf_counter() - started)


def _nothing_left(model: ModelSpec, offers: list[Offer], skipped: list[Skipped]) -> str:
    if len(skipped) == 1:
        return f"offer {skipped[0].name!r} cannot train {model.name}: {skipped[0].reason}"
    shown = "; ".join(f"{s.name}: {s.reason}" for s in skipped[:MAX_REASONS_SHOWN])
    more = len(skipped) - MAX_REASONS_SHOWN
    rest = f"; and {more} more (--json says why)" if more > 0 else ""
    return f"none of the {len(offers)} offers can train {model.name}: {shown}{rest}"
