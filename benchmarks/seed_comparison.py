"""The seed talk's cost-effectiveness comparison, redone with potluck's planner.

Eight GPUs of each kind (RTX 3090 in NVLink pairs, the same without bridges,
RTX 4090 over PCIe, A100 SXM and H100 SXM with NVSwitch) train a 7B and a
1.3B model. For each: raw TFLOPS per dollar (RCC), the plan potluck chooses,
its predicted throughput, and what a million tokens costs. Prints Markdown
tables; ``docs/economics.md`` pastes its output.

    PYTHONPATH=src python benchmarks/seed_comparison.py
"""

from __future__ import annotations

import argparse
from pathlib import Path

from potluck.api import training_shape
from potluck.economics import rank
from potluck.economics.candidates import Candidate, CostRequest
from potluck.economics.offers import load_offers
from potluck.economics.prices import HOURS_PER_YEAR, PriceMode, Pricing
from potluck.economics.study import CostStudy, cost_study
from potluck.model.loading import load_model
from potluck.planner.options import SearchOptions
from potluck.planner.requests.memo import PlanMemo

OFFERS_FILE = Path(__file__).with_name("seed_offers.yaml")
MODELS = ("llama2-7b", "gpt3-1.3b")
TOKENS = 10**10
GLOBAL_BATCH = 64
SEQ_LEN = 2048


def study(model_name: str, pricing: Pricing, memo: PlanMemo,
          options: SearchOptions | None = None) -> CostStudy:
    """The offers priced under ``pricing``; ``memo`` plans each offer once for every pricing."""
    model = load_model(model_name)
    shape = training_shape(model, GLOBAL_BATCH, SEQ_LEN)
    return cost_study(model, shape, load_offers(OFFERS_FILE), CostRequest(TOKENS, pricing),
                      options or SearchOptions(), memo=memo)


def headline_table(result: CostStudy) -> str:
    rcc = rank.positions(rank.by_rcc(result.candidates))
    cost = rank.positions(result.candidates)
    best = result.best.figures.usd_per_million_tokens
    rows = ["| offer | $/h | RCC: peak TFLOPS per $/h | RCC rank | plan | tokens/s | MFU "
            "| model TFLOPS per $/h | $ per M tokens | rank | tokens per $ | vs best |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in sorted(result.candidates, key=lambda c: rcc[c.name]):
        f = c.figures
        rows.append(
            f"| {c.name} | {f.usd_per_hour:.2f} | {f.tflops_per_usd:.0f} | {rcc[c.name]} | "
            f"{c.plan.layout()} | {f.tokens_per_s:,.0f} | {c.plan.prediction.mfu:.0%} | "
            f"{f.achieved_tflops_per_usd:.0f} | {f.usd_per_million_tokens:.4f} | {cost[c.name]} | "
            f"{f.tokens_per_usd:,.0f} | {f.usd_per_million_tokens / best:.2f}x |")
    return "\n".join(rows)


def plans_table(result: CostStudy) -> str:
    rows = ["| offer | plan | micro-batch | recompute | iteration | compute | bubble | TP | PP | DP "
            "| comm share | peak memory |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in result.candidates:
        p = c.plan.prediction
        b = p.breakdown
        comm = (b.tp_s + b.pp_s + b.dp_s) / p.iteration_time_s
        rows.append(
            f"| {c.name} | {c.plan.layout()} | {c.plan.pipelines[0].micro_batch_size} | "
            f"{c.plan.recompute.value} | {p.iteration_time_s:.2f} s | {b.compute_s:.2f} | "
            f"{_s(b.bubble_s)} | {_s(b.tp_s)} | {_s(b.pp_s)} | {_s(b.dp_s)} | {comm:.0%} | "
            f"{p.peak_memory_bytes / 1e9:.1f} GB |")
    return "\n".join(rows)


def _s(seconds: float) -> str:
    return f"{max(seconds, 0.0):.2f}"  # the breakdown can hold -1e-17 from rounding


def break_even(result: CostStudy, candidate: Candidate) -> float:
    """The per-GPU hourly price at which ``candidate`` would cost as much per token as the best."""
    best = result.best.figures
    return best.usd_per_million_tokens * candidate.figures.tokens_per_hour / 1e6 / candidate.figures.gpus


def break_even_purchase(result: CostStudy, candidate: Candidate) -> float:
    """Buy mode: the purchase price per GPU at which ``candidate`` would match the best."""
    pricing = result.request.pricing
    card = candidate.offer.spec.device_types[0]
    electricity = card.power_w / 1000 * pricing.pue * pricing.electricity_usd_per_kwh
    hours = pricing.lifetime_years * HOURS_PER_YEAR * pricing.utilization
    return (break_even(result, candidate) - electricity) * hours


def pricing_table(model_name: str, memo: PlanMemo) -> str:
    modes = {"on-demand": Pricing(), "spot": Pricing(spot=True),
             "buy (3 y, 50 % use)": Pricing(PriceMode.BUY)}
    studies = {label: study(model_name, pricing, memo) for label, pricing in modes.items()}
    head = "| offer | " + " | ".join(f"$/M tokens, {label}" for label in modes) + \
        " | on-demand $/GPU-h to match the best | purchase $/GPU to match the best (buy) |"
    rows = [head, "|---" * (len(modes) + 3) + "|"]
    on_demand, bought = studies["on-demand"], studies["buy (3 y, 50 % use)"]
    for c in on_demand.candidates:
        cells = []
        for result in studies.values():
            other = {x.name: x for x in result.candidates}[c.name]
            cells.append(f"{other.figures.usd_per_million_tokens:.4f}")
        purchase = break_even_purchase(bought, {x.name: x for x in bought.candidates}[c.name])
        rows.append(f"| {c.name} | " + " | ".join(cells) + f" | {break_even(on_demand, c):.2f} | "
                    f"{purchase:,.0f} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    print(f"Global batch {GLOBAL_BATCH} x {SEQ_LEN} tokens, bf16, {TOKENS:.0e} tokens; "
          "catalog prices (RunPod via aggregator, 2026-03).\n")
    memo = PlanMemo()  # every pricing of an offer shares its search
    for model_name in MODELS:
        result = study(model_name, Pricing(), memo)
        print(f"### {model_name}, rented on demand\n\n{headline_table(result)}\n")
        print(f"Plans behind the figures (times per iteration, seconds on the critical path):\n\n"
              f"{plans_table(result)}\n")
        print(f"Under other prices:\n\n{pricing_table(model_name, memo)}\n")
    for model_name in MODELS:
        pinned = study(model_name, Pricing(), memo, SearchOptions(tp=2))
        print(f"### {model_name}, tensor parallel pinned to 2 (the strategy NVLink pairs serve)\n\n"
              f"{headline_table(pinned)}\n\n{plans_table(pinned)}\n")


if __name__ == "__main__":
    main()
