"""Why an island's adaptive optimizer runs at the run's rate / sqrt(its share of the batch):
two islands averaged every step at rate r train as one optimizer at r / sqrt(2).

Usage: python benchmarks/islands_inner_lr.py [--steps N] [--lr R]   (prints a markdown table;
README's bench:islands_inner_lr; progress on stderr)

Four runs of the judged CPU setting (``islands_cpu.py``: tiny Llama, the shipped corpus less
a held-out tenth, 4 CPU ranks, AdamW with a cosine schedule, the final model's held-out
loss), nothing stretched:

- synchronous training at r and at r / sqrt(2);
- the planner's ``diloco`` plan made plain averaging every step (H=1, outer lr 1, no
  momentum, one fragment), its islands' AdamW at r (``inner_lr: same``) and at r / sqrt(1/2)
  (``sqrt_share``, the default: :class:`potluck.plans.islands.InnerLR`).

If averaging the islands' steps shortened them by sqrt(2) (the module docstring of
``potluck.plans.islands``), the ``same`` run lands on synchronous training at r / sqrt(2)
and the ``sqrt_share`` run on synchronous training at r.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import tempfile
from pathlib import Path

from islands_cpu import MODEL, averaging, planned, split_corpus, train

from potluck.plans import InnerLR, Plan

STEPS, LR = 300, 3e-3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--lr", type=float, default=LR, help="r: AdamW's peak rate")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s", force=True)
    sync, diloco, r = planned("sync"), planned("diloco"), args.lr
    runs = [("synchronous", sync, r), ("synchronous", sync, r / math.sqrt(2)),
            *((f"2 islands averaged every step, inner lr {inner_lr.value}",
               averaging(diloco, inner_steps=1, fragments=1, inner_lr=inner_lr), r)
              for inner_lr in (InnerLR.SAME, InnerLR.SQRT_SHARE))]
    with tempfile.TemporaryDirectory() as folder:
        corpus = split_corpus(Path(folder) / "corpus")
        losses = [train(label, plan, args.steps, lr, 1e-6, corpus, Path(folder) / str(i)).held_out
                  for i, (label, plan, lr) in enumerate(runs)]
    print(f"{MODEL} on the shipped corpus less a held-out tenth, 4 CPU ranks, {args.steps} "
          f"steps, AdamW (cosine), r = {r:g}; loss: the final model's on the held-out tenth\n")
    print("| run | AdamW's rate | held-out loss |")
    print("|---|---|---|")
    for (label, plan, lr), loss in zip(runs, losses, strict=True):
        print(f"| {label} | {lr * inner_scale(plan):.3g} | {loss:.3f} |")


def inner_scale(plan: Plan) -> float:
    """The multiplier of island 0's AdamW rate (1 without islands)."""
    return plan.islands.inner_lr.factor(plan.island_share(0)) if plan.islands.split else 1.0


if __name__ == "__main__":
    main()
