"""Issue 33's judged CPU run: a tiny Llama on the shipped corpus, 4 CPU ranks in 2 islands of
2 joined by an emulated 100 Mb/s link (benchmarks/data/islands_cpu.yaml), synchronous training
against ``diloco`` and ``bounded`` at equal tokens (the same global batch and steps).

Usage: python benchmarks/islands_cpu.py [--steps N] [--dilation D]   (prints a markdown table; README's
bench:islands_cpu; progress on stderr)

Each plan is the planner's (``potluck plan --sync sync|diloco|bounded``: its H, compression,
fragments and staleness), plus diloco at H=50, the planner's next H (choose.INNER_STEPS), to
show what 50x fewer bytes costs in loss. Every run is emulated (``--emulate``): ops are
stretched to the cost model's time for the cluster's CPU devices, the per-step gradient
all-reduce of the synchronous plan and the exchanges across islands to the 100 Mb/s link's,
all at the one dilation the synchronous run calibrates, so wall times compare.

- **final loss**: the mean of the last ``LAST_STEPS`` steps' training loss (rank 0's report:
  the mean over every rank's batch);
- **bytes across islands**: from the exchange's one owner
  (:func:`potluck.planner.islands.exchange.pseudo_gradient_bytes`): synchronous training
  sends a whole FP32 gradient per step, islands a pseudo-gradient at the compression's width
  per outer step (the link carries it once, as the planner charges it); the runtime's own
  count (``bytes_exchanged_across_islands``, every rank's payload into the cross-island
  collectives) is shown beside it;
- **emulated wall time**: the sum of the measured step times (the exchange still in flight
  after the last step, applied at the end of the run, is not in it).

Inner optimizer: AdamW with a linear warm-up and cosine decay, as DiLoCo's inner optimizer
(Douillard et al. 2023, arXiv:2311.08105, section 3); outer: Nesterov SGD at DiLoCo's
published lr 0.7, momentum 0.9 (the planner's defaults).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from potluck import api
from potluck.planner.islands.exchange import pseudo_gradient_bytes
from potluck.plans import Compression, Plan

DATA = Path(__file__).resolve().parent / "data"
CLUSTER = DATA / "islands_cpu.yaml"
MODEL, BATCH, SEQ = "tiny-llama", 16, 64
STEPS, LAST_STEPS = 300, 30
LR, WARMUP_STEPS = 3e-3, 50  # warm-up: at most a tenth of the run
NEXT_H = 50
log = logging.getLogger("islands_cpu")


@dataclass(frozen=True)
class Run:
    label: str
    plan: Plan
    losses: list[float]
    wall_s: float
    runtime_bytes: int
    dilation: float

    @property
    def final_loss(self) -> float:
        return sum(self.losses[-LAST_STEPS:]) / len(self.losses[-LAST_STEPS:])

    def link_bytes(self, steps: int) -> float:
        """Bytes across the link over the run, from the exchange's owner."""
        islands = self.plan.islands
        if not islands.split:
            return steps * pseudo_gradient_bytes(self.plan.model, Compression.NONE)
        outer_steps = steps / islands.inner_steps
        return outer_steps * pseudo_gradient_bytes(self.plan.model, islands.compression)


def planned(sync: str) -> Plan:
    options = api.search_options(sync=sync, tp=1, pp=1, top_k=1,
                                 dp=4 if sync == "sync" else None)
    return api.plan(CLUSTER, MODEL, options=options, global_batch=BATCH, seq_len=SEQ,
                    dtype="fp32").best


def train(label: str, plan: Plan, steps: int, dilation: float | None) -> Run:
    options = api.train_options(steps=steps, emulate=True, dilation=dilation, lr=LR,
                                warmup_steps=warmup(steps), lr_schedule="cosine",
                                progress=False)
    log.info("%s: training %d steps (%s)", label, steps, describe(plan))
    began = time.perf_counter()
    history = api.run_plan(plan, options).history
    log.info("%s: %d steps in %.0f s here, loss %.3f", label, steps,
             time.perf_counter() - began, history[-1].loss)
    return Run(label, plan, [m.loss for m in history], sum(m.step_time_s for m in history),
               sum(m.bytes_exchanged_across_islands or 0 for m in history),
               history[-1].dilation or 0.0)


def describe(plan: Plan) -> str:
    islands = plan.islands
    if not islands.split:
        return "synchronous (per-step all-reduce over the link)"
    what = (f"{islands.sync.value}, H={islands.inner_steps}, {islands.compression.value}, "
            f"{islands.fragments} fragment(s)")
    if islands.sync.value == "bounded":
        what += f", staleness {islands.staleness}"
    return what


def row(run: Run, sync: Run, steps: int) -> str:
    loss = run.final_loss / sync.final_loss - 1
    fewer = sync.link_bytes(steps) / run.link_bytes(steps)
    counted = f"{run.runtime_bytes / 1e6:,.1f} MB" if run.runtime_bytes else "-"
    return (f"| {run.label} | {describe(run.plan)} | {run.final_loss:.3f} ({loss:+.1%}) | "
            f"{run.link_bytes(steps) / 1e6:,.1f} MB ({fewer:,.0f}x fewer) | {counted} | "
            f"{run.wall_s:,.1f} s ({sync.wall_s / run.wall_s:.1f}x shorter) |")


def variants(diloco: Plan) -> list[tuple[str, Plan]]:
    """The planner's diloco and two departures from it, each one setting: plain periodic
    averaging (outer SGD at lr 1 without momentum: Local SGD, DiLoCo 2023's baseline outer
    optimizer, section 3.2) and the planner's next H."""
    islands = diloco.islands
    return [("diloco", diloco),
            ("diloco, outer averaging", replace(diloco, islands=replace(
                islands, outer_lr=1.0, outer_momentum=0.0))),
            (f"diloco, H={NEXT_H}", replace(diloco, islands=replace(
                islands, inner_steps=NEXT_H)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--dilation", type=float, default=None,
                        help="emulation time stretch for every run (default: calibrated by "
                             "the synchronous run; a busy machine calibrates a larger one)")
    args = parser.parse_args()
    steps = args.steps
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s", force=True)
    sync = train("synchronous", planned("sync"), steps, args.dilation)
    runs = [sync, *(train(label, plan, steps, sync.dilation)
                    for label, plan in variants(planned("diloco"))),
            train("bounded", planned("bounded"), steps, sync.dilation)]
    print(f"{MODEL} on the shipped corpus, global batch {BATCH} x {SEQ} tokens, {steps} steps "
          f"(equal tokens), AdamW lr {LR} ({warmup(steps)} warm-up steps, cosine); 4 CPU ranks "
          f"in 2 islands of 2, 100 Mb/s between them, emulated at dilation {sync.dilation:.1f}; "
          f"final loss: mean of the last {LAST_STEPS} steps\n")
    print("| run | plan | final loss (vs sync) | bytes across the link | runtime's count "
          "(all ranks) | emulated wall time |")
    print("|---|---|---|---|---|---|")
    for run in runs:
        print(row(run, sync, steps))


def warmup(steps: int) -> int:
    return min(WARMUP_STEPS, steps // 10)


if __name__ == "__main__":
    main()
