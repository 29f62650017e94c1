"""Islands after a synchronous phase: does starting the islands from a synchronously trained
model close the loss gap of the judged CPU run (benchmarks/islands_cpu.py)?

Usage: python benchmarks/islands_warmup.py [--steps N] [--sync-steps W] [--lr R]   (prints a
markdown table; README's bench:islands_warmup; progress on stderr)

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
- the same with DiLoCo's published outer optimizer (Nesterov SGD, lr 0.7, momentum 0.9).

Nothing is stretched (``--emulate`` at a dilation of 1e-6: the plan's two machines run as
CPU ranks here): only the losses matter. As in ``islands_cpu.py``, every run trains on the
shipped corpus less a held-out tenth and is judged by its final model's loss on that tenth
(DiLoCo's outer model); ``--lr`` defaults to the best synchronous rate that
``islands_cpu.py --steps 1000`` found.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

from islands_cpu import (
    MODEL,
    Corpus,
    averaging,
    held_out_loss,
    planned,
    split_corpus,
    with_published_outer,
)

from potluck import api
from potluck.plans import Plan

STEPS, SYNC_STEPS, WARMUP_STEPS = 1000, 300, 50
LR = 6e-3
log = logging.getLogger("islands_warmup")


def train(plan: Plan, steps: int, lr: float, corpus: Corpus, out: Path,
          resume: bool = False) -> None:
    options = api.train_options(data=corpus.train, steps=steps, emulate=True, dilation=1e-6,
                                lr=lr, warmup_steps=WARMUP_STEPS, lr_schedule="constant",
                                progress=False, out=out, resume=resume)
    api.run_plan(plan, options)


def run(label: str, phases: list[tuple[Plan, int]], lr: float, corpus: Corpus,
        out: Path) -> float:
    """Train ``phases`` (plan, up to step) one after the other in ``out``; the final model's
    held-out loss."""
    began = time.perf_counter()
    log.info("%s: training %d steps", label, phases[-1][1])
    for index, (plan, steps) in enumerate(phases):
        train(plan, steps, lr, corpus, out, resume=index > 0)
    final = held_out_loss(phases[-1][0], out, corpus.held_out)
    log.info("%s: held-out loss %.3f (%.0f s here)", label, final,
             time.perf_counter() - began)
    return final


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--sync-steps", type=int, default=SYNC_STEPS,
                        help="synchronous steps before the islands start")
    parser.add_argument("--lr", type=float, default=LR, help="AdamW's peak rate")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s", force=True)
    sync, diloco = planned("sync"), planned("diloco")
    steps, first = args.steps, args.sync_steps
    runs = {
        "synchronous": [(sync, steps)],
        "diloco, outer averaging, from step 0": [(averaging(diloco), steps)],
        f"synchronous {first} steps, then diloco with outer averaging":
            [(sync, first), (averaging(diloco), steps)],
        f"synchronous {first} steps, then diloco with DiLoCo's published outer step (Nesterov 0.7, 0.9)":
            [(sync, first), (with_published_outer(diloco), steps)],
    }
    with tempfile.TemporaryDirectory() as folder:
        corpus = split_corpus(Path(folder) / "corpus")
        finals = {label: run(label, phases, args.lr, corpus, Path(folder) / str(index))
                  for index, (label, phases) in enumerate(runs.items())}
    islands = diloco.islands
    print(f"{MODEL} on the shipped corpus less a held-out tenth, 4 CPU ranks, {steps} steps at "
          f"equal tokens, AdamW lr {args.lr:g} constant after {WARMUP_STEPS} warm-up steps; "
          f"islands: 2, H={islands.inner_steps}, {islands.compression.value}, "
          f"{islands.fragments} fragment(s), inner lr {islands.inner_lr.value}; loss: the "
          f"final model's on the held-out tenth\n")
    print("| run | held-out loss | vs synchronous |")
    print("|---|---|---|")
    base = finals["synchronous"]
    for label, final in finals.items():
        print(f"| {label} | {final:.3f} | {final / base - 1:+.1%} |")


if __name__ == "__main__":
    main()
