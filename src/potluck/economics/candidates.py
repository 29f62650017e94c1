"""Plan each offer with the planner and keep its cheapest plan: the candidates of a cost study.

For every offer the search returns its best few plans (fastest first; offers of the same
hardware share one search, :class:`~potluck.planner.requests.memo.PlanMemo`); the
candidate takes the one with the lowest USD per token that finishes the
tokens by the deadline, or, when none does, the fastest, marked as missing
it. An offer that cannot train the model (memory, divisibility), has no price
in the chosen mode, or is over the GPU or hourly budget becomes a
:class:`Skipped` with the one-line reason.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from potluck.economics.figures import CostFigures, cheapest, plan_figures
from potluck.economics.offers import Offer
from potluck.economics.prices import Pricing, cluster_usd_per_hour
from potluck.errors import ConfigError, PotluckError
from potluck.model.spec import ModelSpec
from potluck.planner.options import SearchOptions
from potluck.planner.requests.memo import PlanMemo
from potluck.plans import Plan, TrainingShape
from potluck.units import positive_number, whole_number

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CostRequest:
    """What a cost study prices and the limits it respects."""

    tokens: int
    pricing: Pricing = Pricing()
    deadline_hours: float | None = None
    max_usd_per_hour: float | None = None
    max_gpus: int | None = None

    def __post_init__(self) -> None:
        if self.tokens < 1:
            raise ConfigError(f"--tokens must be at least 1, not {self.tokens}")
        for flag, value in (("--deadline-hours", self.deadline_hours),
                            ("--max-usd-per-hour", self.max_usd_per_hour)):
            if value is not None:
                positive_number(value, flag)
        if self.max_gpus is not None:
            whole_number(self.max_gpus, "--max-gpus")


@dataclass(frozen=True)
class Candidate:
    """An offer with the plan chosen for it and that plan's cost figures."""

    name: str
    offer: Offer
    plan: Plan
    figures: CostFigures
    meets_deadline: bool = True


@dataclass(frozen=True)
class Skipped:
    """An offer that yields no candidate, and why."""

    name: str
    reason: str


def evaluate_offer(offer: Offer, model: ModelSpec, training: TrainingShape, request: CostRequest,
                   options: SearchOptions | None = None,
                   memo: PlanMemo | None = None) -> Candidate | Skipped:
    """Plan one offer (through ``memo``: once per cluster shape) and price its cheapest plan."""
    if request.max_gpus is not None and offer.num_gpus > request.max_gpus:
        return Skipped(offer.name, f"{offer.num_gpus} GPUs, more than --max-gpus {request.max_gpus}")
    try:
        offered_usd_per_hour = cluster_usd_per_hour(offer.spec, request.pricing)
    except ConfigError as err:
        return Skipped(offer.name, str(err))
    if request.max_usd_per_hour is not None and offered_usd_per_hour > request.max_usd_per_hour:
        return Skipped(offer.name, f"${offered_usd_per_hour:.2f}/h, over --max-usd-per-hour "
                                   f"{request.max_usd_per_hour:g}")
    try:
        result = (memo or PlanMemo()).search(offer.spec, model, training,
                                              options or SearchOptions())
    except PotluckError as err:
        return Skipped(offer.name, str(err))
    priced = [(plan, plan_figures(plan, request.pricing, request.tokens)) for plan in result.plans]
    chosen = cheapest(priced, request.deadline_hours)
    if chosen is None:
        plan, figures = min(priced, key=lambda o: o[1].hours_to_train)
        return Candidate(offer.name, offer, plan, figures, meets_deadline=False)
    return Candidate(offer.name, offer, chosen[0], chosen[1])


OfferProgress = Callable[[int, int, str], None]  # (offers done, offers, the last one; 0 first)


def evaluate_offers(offers: list[Offer], model: ModelSpec, training: TrainingShape,
                    request: CostRequest, options: SearchOptions | None = None,
                    progress: OfferProgress | None = None, memo: PlanMemo | None = None
                    ) -> tuple[list[Candidate], list[Skipped]]:
    """Plan every offer, each cluster shape once (``memo``, one for these offers unless
    given); the candidates and the offers skipped, in the offers' order."""
    memo = memo or PlanMemo()
    candidates: list[Candidate] = []
    skipped: list[Skipped] = []
    if progress is not None:
        progress(0, len(offers), "")
    for index, offer in enumerate(offers):
        outcome = evaluate_offer(offer, model, training, request, options, memo)
        if isinstance(outcome, Candidate):
            candidates.append(outcome)
        else:
            log.info("offer %s skipped: %s", offer.name, outcome.reason)
            skipped.append(outcome)
        if progress is not None:
            progress(index + 1, len(offers), offer.name)
    return candidates, skipped
