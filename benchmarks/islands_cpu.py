"""Issue 33's judged CPU run: a tiny Llama on the shipped corpus, 4 CPU ranks in 2 islands of
2 joined by an emulated 100 Mb/s link (benchmarks/data/islands_cpu.yaml), synchronous training
against ``diloco`` and ``bounded`` at equal tokens (the same global batch and steps).

Usage: python benchmarks/islands_cpu.py [--steps N] [--dilation D] [--lrs R,R,...]
(prints a markdown table; README's bench:islands_cpu; progress on stderr)

**Data and loss.** Every run trains on the shipped corpus less the last tenth of each file
(cut at a line) and is judged by the loss of its final model on that held-out tenth
(:func:`held_out_loss`): the synchronous run's weights, DiLoCo's outer model (its FP32
snapshot after the last outer step, as DiLoCo evaluates, Douillard et al. 2023,
arXiv:2311.08105), bounded's weights once its last push has landed. The mean training loss of
the last ``LAST_STEPS`` steps is shown beside it.

**Learning rate.** Synchronous training is run at each rate of ``--lrs`` first (without
stretching: only the loss matters) and every run then trains at the best one, so that the
islands are judged against a tuned baseline. The islands' AdamW runs at that rate over the
root of its island's share of the batch (the plans' default ``inner_lr: sqrt_share``,
:class:`potluck.plans.islands.InnerLR`); one row keeps the run's rate (``same``) to show
what that scaling does.

**Plans.** The planner's (``potluck plan --sync sync|diloco|bounded``: its H, compression,
fragments, staleness and outer step), and departures from its diloco plan, one setting or two
each: DiLoCo's published outer Nesterov step (lr 0.7, momentum 0.9); plain periodic averaging
(outer SGD at lr 1 without momentum: Local SGD, DiLoCo 2023's baseline outer optimizer) with
one fragment, at H=1, at the planner's H, and at H=50 (the planner's next H,
choose.INNER_STEPS, 100x fewer bytes). Every judged run is emulated (``--emulate``):
ops are stretched to the cost model's time for the cluster's CPU devices, the per-step
gradient all-reduce of the synchronous plan and the exchanges across islands to the 100 Mb/s
link's, all at the one dilation the synchronous run calibrates, so wall times compare.

- **bytes across islands**: from the exchange's one owner
  (:func:`potluck.planner.islands.exchange.pseudo_gradient_bytes`): synchronous training
  sends a whole FP32 gradient per step, islands a pseudo-gradient at the compression's width
  per outer step (the link carries it once, as the planner charges it); the runtime's own
  count (``bytes_exchanged_across_islands``, every rank's payload into the cross-island
  collectives) is shown beside it;
- **emulated wall time**: the sum of the measured step times (the exchange still in flight
  after the last step, applied at the end of the run, is not in it).

Inner optimizer: AdamW with a linear warm-up and cosine decay, as DiLoCo's inner optimizer
(Douillard et al. 2023, section 3).
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from potluck import api
from potluck.data.corpus import builtin_corpus_path, data_files
from potluck.data.dataset import tokenize_documents
from potluck.data.tokenizer import load_tokenizer
from potluck.model.hf import hf_config_for
from potluck.planner.islands.exchange import pseudo_gradient_bytes
from potluck.plans import Compression, InnerLR, Plan, SyncMethod
from potluck.plans.islands import DILOCO_OUTER_LR, DILOCO_OUTER_MOMENTUM
from potluck.runtime.checkpoints.export import checkpoint_weights
from potluck.runtime.checkpoints.storage import latest_checkpoint, load_full_state_dict

DATA = Path(__file__).resolve().parent / "data"
CLUSTER = DATA / "islands_cpu.yaml"
MODEL, BATCH, SEQ = "tiny-llama", 16, 64
STEPS, LAST_STEPS = 300, 30
LR, WARMUP_STEPS = 3e-3, 50  # warm-up: at most a tenth of the run
LRS = (3e-3, 6e-3, 8.5e-3, 1.2e-2)  # synchronous rates tried (--lrs)
HELD_OUT = 0.1  # the last tenth of each corpus file
NEXT_H = 50
log = logging.getLogger("islands_cpu")


@dataclass(frozen=True)
class Run:
    label: str
    plan: Plan
    losses: list[float]
    held_out: float  # the final model's loss on the held-out text
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


@dataclass(frozen=True)
class Corpus:
    """The shipped corpus cut in two: ``train`` (a folder of files) and the held-out ids."""

    train: Path
    held_out: torch.Tensor


def split_corpus(folder: Path) -> Corpus:
    """Each shipped file's last ``HELD_OUT`` (from a line start) held out, the rest in
    ``folder``."""
    held_out_text = []
    folder.mkdir(parents=True)
    for file in data_files(builtin_corpus_path()):
        text = file.read_text()
        cut = text.rfind("\n", 0, int(len(text) * (1 - HELD_OUT))) + 1
        (folder / file.name).write_text(text[:cut])
        held_out_text.append(text[cut:])
    return Corpus(folder, tokenize_documents(held_out_text, load_tokenizer(None)))


def held_out_loss(plan: Plan, run_dir: Path, tokens: torch.Tensor) -> float:
    """The mean next-token loss on ``tokens`` (cut into ``SEQ``-token rows) of the run's
    final model: DiLoCo's outer snapshot, else the checkpoint's weights."""
    checkpoint = latest_checkpoint(run_dir)
    weights = checkpoint_weights(checkpoint, plan.model)
    if plan.islands.split and plan.islands.sync is SyncMethod.DILOCO:
        outer = load_full_state_dict(checkpoint, section="outer")
        weights = {name.removeprefix("snapshot."): value for name, value in outer.items()
                   if name.startswith("snapshot.")}
    model = AutoModelForCausalLM.from_config(hf_config_for(plan.model))
    model.load_state_dict(weights)
    rows = (tokens.numel() - 1) // SEQ
    inputs = tokens[:rows * SEQ].view(rows, SEQ)
    targets = tokens[1:rows * SEQ + 1].view(rows, SEQ)
    with torch.no_grad():
        logits = model.eval()(inputs).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()


def planned(sync: str) -> Plan:
    options = api.search_options(sync=sync, tp=1, pp=1, top_k=1,
                                 dp=4 if sync == "sync" else None)
    return api.plan(CLUSTER, MODEL, options=options, global_batch=BATCH, seq_len=SEQ,
                    dtype="fp32").best


def train(label: str, plan: Plan, steps: int, lr: float, dilation: float | None,
          corpus: Corpus, out: Path, schedule: str = "cosine", seed: int = 0) -> Run:
    options = api.train_options(data=corpus.train, out=out, steps=steps, emulate=True,
                                dilation=dilation, lr=lr, warmup_steps=warmup(steps),
                                lr_schedule=schedule, progress=False, seed=seed)
    log.info("%s: training %d steps at lr %g (%s)", label, steps, lr, describe(plan))
    began = time.perf_counter()
    history = api.run_plan(plan, options).history
    held_out = held_out_loss(plan, out, corpus.held_out)
    log.info("%s: %d steps in %.0f s here, held-out loss %.3f", label, steps,
             time.perf_counter() - began, held_out)
    return Run(label, plan, [m.loss for m in history], held_out,
               sum(m.step_time_s for m in history),
               sum(m.bytes_exchanged_across_islands or 0 for m in history),
               history[-1].dilation or 0.0)


def describe(plan: Plan) -> str:
    islands = plan.islands
    if not islands.split:
        return "synchronous (per-step all-reduce over the link)"
    what = f"{islands.sync.value}, H={islands.inner_steps}, {islands.compression.value}"
    if islands.sync is SyncMethod.DILOCO:
        what += f", outer lr {islands.outer_lr:g} momentum {islands.outer_momentum:g}"
    what += f", {islands.fragments} fragment(s), inner lr {islands.inner_lr.value}"
    if islands.sync is SyncMethod.BOUNDED:
        what += f", staleness {islands.staleness}"
    return what


def row(run: Run, sync: Run, steps: int) -> str:
    loss = run.held_out / sync.held_out - 1
    fewer = sync.link_bytes(steps) / run.link_bytes(steps)
    counted = f"{run.runtime_bytes / 1e6:,.1f} MB" if run.runtime_bytes else "-"
    return (f"| {run.label} | {describe(run.plan)} | {run.held_out:.3f} ({loss:+.1%}) | "
            f"{run.final_loss:.3f} | {run.link_bytes(steps) / 1e6:,.1f} MB ({fewer:,.0f}x "
            f"fewer) | {counted} | {run.wall_s:,.1f} s ({sync.wall_s / run.wall_s:.1f}x "
            f"shorter) |")


def variants(diloco: Plan) -> list[tuple[str, Plan]]:
    """The planner's diloco and departures from it (module docstring)."""
    return [("diloco", diloco),
            ("the same with DiLoCo's published outer step", with_published_outer(diloco)),
            ("diloco, outer averaging", averaging(diloco, fragments=1)),
            ("the same at the run's rate", averaging(diloco, fragments=1,
                                                     inner_lr=InnerLR.SAME)),
            ("the same at H=1", averaging(diloco, fragments=1, inner_steps=1)),
            (f"the same at H={NEXT_H}", averaging(diloco, fragments=1, inner_steps=NEXT_H))]


def averaging(plan: Plan, **changes: object) -> Plan:
    """``plan`` with its outer step plain periodic averaging (outer SGD at lr 1 without
    momentum), and its islands' other ``changes``."""
    return replace(plan, islands=replace(plan.islands, outer_lr=1.0, outer_momentum=0.0,
                                         **changes))


def with_published_outer(plan: Plan) -> Plan:
    """``plan`` with DiLoCo's published outer step (Nesterov, lr 0.7, momentum 0.9)."""
    return replace(plan, islands=replace(plan.islands, outer_lr=DILOCO_OUTER_LR,
                                         outer_momentum=DILOCO_OUTER_MOMENTUM))


def best_rate(plan: Plan, steps: int, rates: list[float], corpus: Corpus, out: Path
              ) -> tuple[float, dict[float, float]]:
    """The rate of ``rates`` whose synchronous run has the lowest held-out loss, and each
    rate's held-out loss (runs not stretched)."""
    found = {lr: train(f"synchronous, lr {lr:g}", plan, steps, lr, 1e-6, corpus,
                       out / f"lr{index}").held_out
             for index, lr in enumerate(rates)}
    return min(found, key=found.get), found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--dilation", type=float, default=None,
                        help="emulation time stretch for every run (default: calibrated by "
                             "the synchronous run; a busy machine calibrates a larger one)")
    parser.add_argument("--lrs", default=",".join(f"{lr:g}" for lr in LRS),
                        help="synchronous learning rates tried; every run takes the best")
    args = parser.parse_args()
    steps = args.steps
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s", force=True)
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        corpus = split_corpus(root / "corpus")
        sync_plan = planned("sync")
        lr, tried = best_rate(sync_plan, steps, [float(r) for r in args.lrs.split(",")],
                              corpus, root)
        sync = train("synchronous", sync_plan, steps, lr, args.dilation, corpus, root / "sync")
        plans = [*variants(planned("diloco")), ("bounded", planned("bounded"))]
        runs = [sync, *(train(label, plan, steps, lr, sync.dilation, corpus, root / str(i))
                        for i, (label, plan) in enumerate(plans))]
    rates = ", ".join(f"{r:g}: {loss:.3f}" for r, loss in tried.items())
    print(f"{MODEL} on the shipped corpus less a held-out tenth, global batch {BATCH} x {SEQ} "
          f"tokens, {steps} steps (equal tokens), AdamW lr {lr:g} ({warmup(steps)} warm-up "
          f"steps, cosine), the best synchronous held-out loss of {rates}; 4 CPU ranks in 2 "
          f"islands of 2, 100 Mb/s between them, emulated at dilation {sync.dilation:.1f}\n")
    print("| run | plan | held-out loss (vs sync) | training loss, last "
          f"{LAST_STEPS} steps | bytes across the link | runtime's count (all ranks) | "
          "emulated wall time |")
    print("|---|---|---|---|---|---|---|")
    for run in runs:
        print(row(run, sync, steps))


def warmup(steps: int) -> int:
    return min(WARMUP_STEPS, steps // 10)


if __name__ == "__main__":
    main()
