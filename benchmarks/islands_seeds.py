"""How far the judged CPU run's loss gaps are from noise, and how the learning-rate schedule
moves them: synchronous training against plain averaging at H=10 and H=50 and the planner's
``diloco`` plan with DiLoCo's published outer step (Nesterov, lr 0.7, momentum 0.9), over
several seeds, for a cosine and a constant schedule.

Usage: python benchmarks/islands_seeds.py [--steps N] [--lr R] [--seeds K]   (prints a markdown
table; README's bench:islands_seeds; progress on stderr)

The judged setting of ``islands_cpu.py`` (tiny Llama, the shipped corpus less a held-out tenth,
4 CPU ranks in 2 islands, AdamW at the synchronous run's best rate of that script, the
islands' at ``sqrt_share``), nothing stretched: only the final model's held-out loss
matters. A seed sets the weights' initialization and the order of the batches; each plan runs
each seed under each schedule. The table gives each plan's mean held-out loss over the seeds,
and its gap to synchronous training's as the mean and the range of the per-seed gaps.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
from pathlib import Path

from islands_cpu import (
    MODEL,
    NEXT_H,
    averaging,
    planned,
    split_corpus,
    train,
    with_published_outer,
)

STEPS, LR, SEEDS = 1000, 6e-3, 3
SCHEDULES = ("cosine", "constant")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--lr", type=float, default=LR, help="AdamW's peak rate")
    parser.add_argument("--seeds", type=int, default=SEEDS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s", force=True)
    diloco = planned("diloco")
    plans = {"synchronous": planned("sync"),
             f"averaging, H={diloco.islands.inner_steps}": averaging(
                 diloco, fragments=1),
             f"averaging, H={NEXT_H}": averaging(diloco, fragments=1,
                                                                inner_steps=NEXT_H),
             "DiLoCo's published outer step": with_published_outer(diloco)}
    losses: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as folder:
        corpus = split_corpus(Path(folder) / "corpus")
        for schedule in SCHEDULES:
            for label, plan in plans.items():
                losses[schedule, label] = [
                    train(f"{label}, {schedule}, seed {seed}", plan, args.steps, args.lr, 1e-6,
                          corpus, Path(folder) / f"{schedule}-{len(losses)}-{seed}",
                          schedule=schedule, seed=seed).held_out
                    for seed in range(args.seeds)]
    print(f"{MODEL} on the shipped corpus less a held-out tenth, 4 CPU ranks, {args.steps} "
          f"steps at equal tokens, AdamW lr {args.lr:g}, islands' inner lr sqrt_share; "
          f"{args.seeds} seeds; loss: the final model's on the held-out tenth\n")
    print("| schedule | run | held-out loss (mean) | vs synchronous: mean (range over seeds) |")
    print("|---|---|---|---|")
    for schedule in SCHEDULES:
        base = losses[schedule, "synchronous"]
        for label in plans:
            mine = losses[schedule, label]
            gaps = [m / b - 1 for m, b in zip(mine, base, strict=True)]
            print(f"| {schedule} | {label} | {statistics.mean(mine):.3f} | "
                  f"{statistics.mean(gaps):+.1%} ({min(gaps):+.1%} to {max(gaps):+.1%}) |")


if __name__ == "__main__":
    main()
