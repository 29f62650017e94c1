"""Cost studies: the dollar arithmetic of each candidate, the rankings, the deadline, the budget."""

from __future__ import annotations

from dataclasses import replace

import pytest

from potluck.cluster.catalog import catalog
from potluck.economics import rank
from potluck.economics.candidates import CostRequest
from potluck.economics.offers import parse_offers
from potluck.economics.prices import PriceMode, Pricing
from potluck.economics.study import cost_study
from potluck.errors import ConfigError, InfeasibleError
from potluck.planner.requests.memo import PlanMemo

TOKENS = 10**9

OFFERS = """\
offers:
  - {name: four, gpu: rtx4090, gpus_per_node: 4, price_per_hour: 0.60}
  - {name: four-dear, gpu: rtx4090, gpus_per_node: 4, price_per_hour: 1.20}
  - {name: eight, gpu: rtx4090, gpus_per_node: 8, price_per_hour: 0.60}
  - {name: one-slow-cheap, gpu: rtx3090, gpus_per_node: 1, price_per_hour: 0.05}
  - {name: h100, gpu: h100-sxm, gpus_per_node: 8}
"""


@pytest.fixture
def offers():
    return parse_offers(OFFERS)


@pytest.fixture
def study(model, shape, offers):
    return cost_study(model, shape, offers, CostRequest(TOKENS))


def test_usd_per_million_tokens_is_the_hourly_price_over_the_hourly_throughput(study):
    for candidate in study.candidates:
        f = candidate.figures
        assert f.usd_per_million_tokens == pytest.approx(f.usd_per_hour / (f.tokens_per_s * 3600 / 1e6))
        assert f.hours_to_train == pytest.approx(TOKENS / f.tokens_per_s / 3600)
        assert f.total_usd == pytest.approx(f.usd_per_hour * f.hours_to_train)
        assert f.tokens_per_s == candidate.plan.prediction.tokens_per_s


def test_the_hourly_price_is_the_offer_price_of_the_gpus_the_plan_uses(study):
    by_name = {c.name: c for c in study.candidates}
    assert by_name["four"].figures.usd_per_hour == pytest.approx(by_name["four"].plan.num_gpus * 0.60)
    h100 = by_name["h100"]
    assert h100.figures.usd_per_hour == pytest.approx(
        h100.plan.num_gpus * catalog()["h100-sxm"].price_per_hour_usd)


def test_rcc_is_peak_tflops_over_the_hourly_price(study):
    for candidate in study.candidates:
        f = candidate.figures
        peak = catalog()[candidate.offer.group.gpu].tflops * candidate.plan.num_gpus
        assert f.tflops_per_usd == pytest.approx(peak / f.usd_per_hour)
        assert f.achieved_tflops_per_usd < f.tflops_per_usd  # no plan beats the datasheet


def test_candidates_rank_cheapest_per_token_first(study):
    costs = [c.figures.usd_per_million_tokens for c in study.candidates]
    assert costs == sorted(costs)
    names = [c.name for c in study.candidates]
    assert names.index("four") < names.index("four-dear")  # same GPUs and plan, twice the price
    by_name = {c.name: c for c in study.candidates}
    assert by_name["four-dear"].figures.usd_per_million_tokens == pytest.approx(
        2 * by_name["four"].figures.usd_per_million_tokens)


def test_ranking_by_time_puts_the_fastest_first(study):
    hours = [c.figures.hours_to_train for c in rank.by_time(study.candidates)]
    assert hours == sorted(hours)
    assert study.fastest.name == "h100"


def test_the_pareto_front_holds_exactly_the_undominated_candidates(study):
    front = study.pareto
    others = [c for c in study.candidates if c not in front]
    assert front and others
    for member in front:
        assert not any(rank.dominates(c, member) for c in study.candidates)
    for other in others:
        assert any(rank.dominates(member, other) for member in front)
    assert "four-dear" not in {c.name for c in front}  # "four" is as fast and cheaper


def test_dominates_needs_no_worse_on_both_and_better_on_one(study):
    a = study.candidates[0]
    f = a.figures
    assert not rank.dominates(a, a)
    same_total_slower = replace(a, figures=replace(f, tokens_per_s=f.tokens_per_s / 2,
                                                   usd_per_hour=f.usd_per_hour / 2))
    assert rank.dominates(a, same_total_slower) and not rank.dominates(same_total_slower, a)
    faster_dearer = replace(a, figures=replace(f, tokens_per_s=f.tokens_per_s * 2,
                                               usd_per_hour=f.usd_per_hour * 3))
    assert not rank.dominates(a, faster_dearer) and not rank.dominates(faster_dearer, a)


def test_a_deadline_puts_candidates_that_miss_it_last(model, shape, offers):
    free = cost_study(model, shape, offers, CostRequest(TOKENS))
    cheapest = free.best
    deadline = cheapest.figures.hours_to_train / 2  # the cheapest one is too slow now
    assert free.fastest.figures.hours_to_train < deadline
    rushed = cost_study(model, shape, offers, CostRequest(TOKENS, deadline_hours=deadline))
    assert rushed.best.name != cheapest.name
    assert rushed.best.figures.hours_to_train <= deadline
    meets = [c.meets_deadline for c in rushed.candidates]
    assert meets == sorted(meets, reverse=True)  # all that meet it, then all that miss it
    for candidate in rushed.candidates:
        assert candidate.meets_deadline == (candidate.figures.hours_to_train <= deadline)


def test_budget_and_gpu_limits_skip_offers_with_a_reason(model, shape, offers):
    study = cost_study(model, shape, offers, CostRequest(TOKENS, max_usd_per_hour=3.0, max_gpus=4))
    assert {c.name for c in study.candidates} == {"four", "one-slow-cheap"}
    reasons = {s.name: s.reason for s in study.skipped}
    assert "--max-gpus 4" in reasons["eight"]
    assert "--max-usd-per-hour" in reasons["four-dear"]  # 4.80 USD/h
    assert all(c.figures.usd_per_hour <= 3.0 for c in study.candidates)


def test_an_offer_the_model_does_not_fit_is_skipped_with_the_planner_reason(shape, offers):
    from potluck.model.loading import load_model

    big = load_model("llama2-7b")
    study = cost_study(big, replace(shape, seq_len=2048), offers, CostRequest(TOKENS))
    reasons = {s.name: s.reason for s in study.skipped}
    assert "needs" in reasons["one-slow-cheap"] and "GB" in reasons["one-slow-cheap"]


def test_no_offer_left_is_one_clear_error(model, shape, offers):
    with pytest.raises(InfeasibleError, match="none of the 5 offers"):
        cost_study(model, shape, offers, CostRequest(TOKENS, max_usd_per_hour=0.01))


def test_when_no_offer_is_left_the_error_gives_their_own_reasons(model, shape):
    """Spot prices missing from every offer is not a matter of more GPUs or a smaller model."""
    no_spot = parse_offers(OFFERS.replace("  - {name: h100, gpu: h100-sxm, gpus_per_node: 8}\n", ""))
    with pytest.raises(InfeasibleError) as info:
        cost_study(model, shape, no_spot, CostRequest(TOKENS, Pricing(spot=True)))
    message = str(info.value)
    assert "spot_price_per_hour" in message and "smaller model" not in message
    assert "\n" not in message


def test_buying_changes_the_prices_not_the_plans(model, shape, offers):
    rent = cost_study(model, shape, offers, CostRequest(TOKENS))
    buy = cost_study(model, shape, offers, CostRequest(TOKENS, Pricing(PriceMode.BUY)))
    rent_speed = {c.name: c.figures.tokens_per_s for c in rent.candidates}
    # offers with their own price_per_hour only still have catalog purchase prices
    for candidate in buy.candidates:
        assert candidate.figures.tokens_per_s == pytest.approx(rent_speed[candidate.name])


@pytest.mark.parametrize("kwargs", [{"tokens": 0}, {"tokens": 1, "deadline_hours": 0},
                                    {"tokens": 1, "max_usd_per_hour": -1}, {"tokens": 1, "max_gpus": 0}])
def test_impossible_requests_are_rejected(kwargs):
    with pytest.raises(ConfigError):
        CostRequest(**kwargs)


def test_without_offers_the_catalog_supplies_the_candidates(model):
    from potluck import api

    study = api.cost(model, "1B", max_gpus=2, global_batch=32, seq_len=1024)
    assert {c.offer.group.gpu for c in study.candidates} >= {"rtx4090", "rtx3090", "h100-sxm"}
    assert all(c.offer.num_gpus <= 2 for c in study.candidates)
    assert all(c.offer.source.startswith("catalog") for c in study.candidates)


def test_offers_of_the_same_hardware_are_searched_once_and_priced_each(model, shape, offers):
    """"four" and "four-dear" differ only in price: one search, two prices; a second study of
    the same offers under other prices searches nothing again."""
    memo = PlanMemo()
    rent = cost_study(model, shape, offers, CostRequest(TOKENS), memo=memo)
    assert memo.searches == len(offers) - 1
    by_name = {c.name: c for c in rent.candidates}
    four, dear = by_name["four"], by_name["four-dear"]
    assert four.plan.layout() == dear.plan.layout()
    assert dear.figures.usd_per_million_tokens == pytest.approx(
        2 * four.figures.usd_per_million_tokens)
    assert dear.plan.cluster.name == "four-dear"
    bought = cost_study(model, shape, offers, CostRequest(TOKENS, Pricing(PriceMode.BUY)), memo=memo)
    assert len(bought.candidates) == len(rent.candidates)
    assert memo.searches == len(offers) - 1
