"""The default search on realistic labs against the best plan found by pinning.

A user who doubts the default plan pins what they suspect: ``--tp``, ``--pp``, a
recomputation mode, a ZeRO stage, optimizer offload, swapping. This benchmark does that
over a grid on each lab of :mod:`labs` and takes the fastest plan any pin found (each
pinned search is the search itself, narrowed), then reports quality = that time / the
default plan's time (target: at least 0.98 on every lab; above 1 where no pin finds
what the default did). The exhaustive reference (:mod:`potluck.planner.exhaustive`) runs
only on labs of at most eight tensor-parallel units, none of these.

Usage: python benchmarks/lab_quality.py [--labs N ...] [--quick] [--execution PRESET]
(--quick pins tp and pp only; the full grid takes several minutes a lab on 2 cores;
--execution plans every search, default and pinned, for that framework, e.g. megatron-lm)
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from labs import LABS, Lab  # noqa: E402

from potluck.cluster import parse_cluster  # noqa: E402
from potluck.cluster.execution import PRESETS  # noqa: E402
from potluck.errors import PotluckError  # noqa: E402
from potluck.model import load_model  # noqa: E402
from potluck.model.counts import Recompute  # noqa: E402
from potluck.model.loading import model_from_hf_config  # noqa: E402
from potluck.planner.options import SearchOptions  # noqa: E402
from potluck.planner.search import search  # noqa: E402
from potluck.plans import Plan, TrainingShape  # noqa: E402
from potluck.plans.memory import Offload, Swap  # noqa: E402

PP_PINS = (2, 3, 4, 5, 6, 8, 10, 12, 14, 16, 20, 24)


def lab_model(lab: Lab):
    if isinstance(lab.model, str):
        return load_model(lab.model)
    config = {k: v for k, v in lab.model.items() if k != "name"}
    return model_from_hf_config(config, lab.model["name"])


def pins(lab: Lab, num_gpus: int, layers: int, quick: bool) -> list[tuple[str, SearchOptions]]:
    """The grid: TP alone, PP alone and with tp=1, then each memory technique alone."""
    grid = [(f"--tp {t}", SearchOptions(tp=t)) for t in (1, 2, 4)]
    for pp in (p for p in PP_PINS if p <= min(num_gpus, layers)):
        grid += [(f"--pp {pp}", SearchOptions(pp=pp)),
                 (f"--tp 1 --pp {pp}", SearchOptions(tp=1, pp=pp))]
    if quick:
        return grid
    grid += [(f"--recompute {r.value}", SearchOptions(recompute=r)) for r in Recompute]
    grid += [(f"--zero {z}", SearchOptions(zero=z)) for z in range(4)]
    grid += [("--offload optimizer", SearchOptions(offload=Offload.OPTIMIZER)),
             ("--swap host", SearchOptions(swap=Swap.HOST)),
             ("--swap none", SearchOptions(swap=Swap.NONE))]
    return grid


def best_pinned(lab: Lab, spec, model, shape: TrainingShape, quick: bool
                ) -> tuple[Plan | None, str, int]:
    best: Plan | None = None
    label, runs = "", 0
    for name, options in pins(lab, spec.num_gpus, model.num_layers, quick):
        try:
            plan = search(spec, model, shape, replace(options, top_k=1)).best
        except PotluckError:
            continue
        runs += 1
        if best is None or plan.prediction.iteration_time_s < best.prediction.iteration_time_s:
            best, label = plan, name
    return best, label, runs


def row(lab: Lab, quick: bool, execution: str) -> str:
    spec = parse_cluster(lab.cluster)
    model = lab_model(lab)
    shape = TrainingShape(lab.global_batch, lab.seq_len, execution=PRESETS[execution])
    began = time.process_time()
    default = search(spec, model, shape).best
    search_s = time.process_time() - began
    began = time.process_time()
    pinned, label, runs = best_pinned(lab, spec, model, shape, quick)
    grid_s = time.process_time() - began
    mine = default.prediction.iteration_time_s
    best = pinned.prediction.iteration_time_s if pinned else float("nan")
    quality = best / mine
    pinned_text = f"{best:.2f} s {pinned.layout()} (`{label}`)" if pinned else "none"
    return (f"| {lab.name} | {lab.model_name} | {spec.num_gpus} ({len(spec.nodes)} groups) | "
            f"{mine:.2f} s {default.layout()} | {pinned_text} | {quality:.3f} | "
            f"{search_s:.1f} s | {runs} in {grid_s:.0f} s |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--labs", type=int, nargs="*", help="lab numbers (from 0)")
    parser.add_argument("--quick", action="store_true", help="pin tp and pp only")
    parser.add_argument("--execution", default="potluck", choices=sorted(PRESETS),
                        help="the framework every plan is made for")
    args = parser.parse_args()
    chosen = [LABS[i] for i in args.labs] if args.labs is not None else LABS
    print("| lab | model | GPUs | default plan | best pinned plan | quality | search CPU | "
          "pinned searches |")
    print("|---|---|---:|---|---|---:|---:|---:|")
    for lab in chosen:
        print(row(lab, args.quick, args.execution), flush=True)


if __name__ == "__main__":
    main()
