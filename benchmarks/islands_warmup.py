"""Islands after a synchronous phase: does starting the islands from a synchronously trained
model close the loss gap of the judged CPU run (benchmarks/islands_cpu.py)?

Usage: python benchmarks/islands_warmup.py [--steps N] [--sync-steps W]   (prints a markdown
table; README's bench:islands_warmup; progress on stderr)

Four runs of the tiny Llama on the shipped corpus, 4 CPU ranks, at equal tokens (the same
global batch and steps), at a constant learning rate after a linear warm-up (a constant rate,
so that a run resumed under another plan continues the same schedule):

- synchronous training for all N steps;
- the planner's ``diloco`` plan with plain averaging (outer lr 1, no momentum) from step 0;
- synchronous training for W steps, then its checkpoint resumed under the planner's
  ``diloco`` plan with plain averaging (a consensus checkpoint resumes under any split:
  ``runtime/checkpoints/island_files.py``), as post-local SGD does (Lin et al. ICLR 2020,
  arXiv:1808.07217) and as DiLoCo's main runs start from a model trained synchronously
  (Douillard et al. 2023, arXiv:2311.08105, section 3);
- the same with the planner's outer optimizer (DiLoCo's Nesterov SGD, lr 0.7, momentum 0.9).

Nothing is stretched (``--emulate`` at a dilation of 1e-6: the plan's two machines run as
CPU ranks here): only the losses matter. Final loss: the mean of the last ``LAST_STEPS``
steps' training loss.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from islands_cpu import LAST_STEPS, LR, MODEL, planned

from potluck import api
from potluck.plans import Plan

STEPS, SYNC_STEPS, WARMUP_STEPS = 1000, 300, 50
log = logging.getLogger("islands_warmup")


def averaging(plan: Plan) -> Plan:
    """``plan`` with its outer step plain averaging (outer lr 1, no momentum)."""
    return replace(plan, islands=replace(plan.islands, outer_lr=1.0, outer_momentum=0.0))


def losses(plan: Plan, steps: int, out: Path, resume: bool = False) -> list[float]:
    options = api.train_options(steps=steps, emulate=True, dilation=1e-6, lr=LR,
                                warmup_steps=WARMUP_STEPS, lr_schedule="constant",
                                progress=False, out=out, resume=resume)
    return [m.loss for m in api.run_plan(plan, options).history]


def run(label: str, phases: list[tuple[Plan, int]], out: Path) -> float:
    """Train ``phases`` (plan, up to step) one after the other in ``out``; the final loss."""
    began = time.perf_counter()
    log.info("%s: training %d steps", label, phases[-1][1])
    seen: list[float] = []
    for index, (plan, steps) in enumerate(phases):
        seen += losses(plan, steps, out, resume=index > 0)
    final = sum(seen[-LAST_STEPS:]) / len(seen[-LAST_STEPS:])
    log.info("%s: final loss %.3f (%.0f s here)", label, final, time.perf_counter() - began)
    return final


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--sync-steps", type=int, default=SYNC_STEPS,
                        help="synchronous steps before the islands start")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s", force=True)
    sync, diloco = planned("sync"), planned("diloco")
    steps, first = args.steps, args.sync_steps
    runs = {
        "synchronous": [(sync, steps)],
        "diloco, outer averaging, from step 0": [(averaging(diloco), steps)],
        f"synchronous {first} steps, then diloco with outer averaging":
            [(sync, first), (averaging(diloco), steps)],
        f"synchronous {first} steps, then the planner's diloco (Nesterov 0.7, 0.9)":
            [(sync, first), (diloco, steps)],
    }
    with tempfile.TemporaryDirectory() as folder:
        finals = {label: run(label, phases, Path(folder) / str(index))
                  for index, (label, phases) in enumerate(runs.items())}
    islands = diloco.islands
    print(f"{MODEL} on the shipped corpus, 4 CPU ranks, {steps} steps at equal tokens, AdamW "
          f"lr {LR} constant after {WARMUP_STEPS} warm-up steps; islands: 2, H="
          f"{islands.inner_steps}, {islands.compression.value}, {islands.fragments} "
          f"fragment(s); final loss: mean of the last {LAST_STEPS} steps\n")
    print("| run | final loss | vs synchronous |")
    print("|---|---|---|")
    base = finals["synchronous"]
    for label, final in finals.items():
        print(f"| {label} | {final:.3f} | {final / base - 1:+.1%} |")


if __name__ == "__main__":
    main()
