"""Predicted time to a target loss for a 7B model on three clusters with slow links:
synchronous training against the planner's choice of islands (issue 33).

Usage: python benchmarks/slow_links.py   (prints a markdown table; README's bench:slow_links)

The target loss is synchronous training's after Chinchilla's 20 tokens per parameter
(Hoffmann et al. 2022); a plan with islands needs more tokens to reach it (the convergence
penalty, potluck/planner/islands/convergence.py, whose magnitudes are stated assumptions).
"""

from __future__ import annotations

from pathlib import Path

from potluck import api
from potluck.cluster import Cluster, load_cluster
from potluck.model import counts, load_model
from potluck.planner.islands import convergence
from potluck.planner.islands.exchange import outer_exchange
from potluck.plans import Plan

DATA = Path(__file__).resolve().parent / "data"
CLUSTERS = (
    ("two labs (2x2 boxes of 8 A100) joined at 1 Gb/s, 10 ms", "slow_two_labs.yaml"),
    ("eight desktops (2 RTX 4090 each) on 1 Gb/s", "slow_desktops.yaml"),
    ("lab (2x4 RTX 3090) + cloud (8 H100) over the internet, 0.5 Gb/s, 40 ms",
     "slow_lab_cloud.yaml"),
)
MODEL, BATCH, SEQ = "llama2-7b", 256, 4096


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:,.0f} h"


def _time_to_target_s(plan: Plan, target: float) -> tuple[float, float]:
    """The plan's time to ``target`` tokens' loss, and its convergence factor."""
    params = counts.total_params(plan.model)
    factor = convergence.penalty(plan.islands, params, target).token_factor
    assert plan.prediction is not None
    return target * factor / plan.prediction.tokens_per_s, factor


def _chosen(plan: Plan) -> tuple[str, str, str]:
    """The chosen synchronization, bytes per outer step and penalty columns."""
    islands = plan.islands
    if not islands.split:
        return "synchronous", "-", "-"
    step_s = plan.prediction.iteration_time_s - plan.prediction.breakdown.outer_s
    exchange = outer_exchange(Cluster(plan.cluster), plan, step_s)
    gap = convergence.loss_gap(islands, counts.total_params(plan.model))[0]
    return (f"{islands.count} islands, {plan.dp} pipelines, H={islands.inner_steps}, "
            f"{islands.compression.value}, {islands.fragments} fragment(s)",
            f"{exchange.bytes_per_outer_step / 1e9:.1f} GB", f"+{gap:.2%} loss")


def row(label: str, file: str) -> str:
    spec = load_cluster(DATA / file)
    model = load_model(MODEL)
    target = convergence.default_tokens(counts.total_params(model))
    sync = api.plan(spec, model, options=api.search_options(sync="sync"), global_batch=BATCH,
                    seq_len=SEQ).best
    chosen = api.plan(spec, model, global_batch=BATCH, seq_len=SEQ).best
    sync_s, _ = _time_to_target_s(sync, target)
    chosen_s, factor = _time_to_target_s(chosen, target)
    how, moved, gap = _chosen(chosen)
    if not chosen.islands.split:
        forced = api.plan(spec, model, options=api.search_options(sync="diloco"),
                          global_batch=BATCH, seq_len=SEQ).best
        how += (f" (best islands: {forced.islands.count}, H={forced.islands.inner_steps}, "
                f"{_hours(_time_to_target_s(forced, target)[0])})")
    penalty = gap if gap == "-" else f"{gap} ({factor:.2f}x tokens)"
    used = f"{sync.num_gpus} of {Cluster(spec).spec.num_gpus} GPUs"
    return (f"| {label} | {used}, {sync.prediction.iteration_time_s:.1f} s, {_hours(sync_s)} | "
            f"{how} | "
            f"{chosen.prediction.iteration_time_s:.2f} s | {moved} | {penalty} | "
            f"{_hours(chosen_s)} | {sync_s / chosen_s:.1f}x |")


def main() -> None:
    print(f"{MODEL}, global batch {BATCH} x {SEQ} tokens; target: synchronous training's loss "
          f"after 20 tokens per parameter\n")
    print("| cluster | synchronous: GPUs, step, time to target | chosen plan | step (outer "
          "amortized) | bytes per outer step (per island) | convergence penalty | time to "
          "target | speedup |")
    print("|---|---|---|---|---|---|---|---|")
    for label, file in CLUSTERS:
        print(row(label, file))


if __name__ == "__main__":
    main()
