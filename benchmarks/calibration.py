"""Predicted against measured step time on CPU clusters, before and after calibration.

Trains a small LLaMA-like model (hidden 256, 8 blocks, sequences of 128
tokens) on real CPU ranks of this machine (a ``gpu: cpu`` cluster of 4 and of
8 ranks) in several layouts, each with ``--trace``. For every run it prints
the measured step time, the prediction of the uncalibrated cost model (the
catalog's nominal ``cpu`` figures), and the prediction after calibrating on
ANOTHER run of the same cluster (``potluck calibrate`` on the first layout of
the cluster, one with both data and pipeline parallelism, then the other
layouts' plans re-evaluated on the calibrated cluster file): calibration must
generalize, not just reproduce the run it was fitted on. The summary line
takes every ordered pair of layouts (fit on one, predict another). Targets:
within 15% before, 5% after calibration.

``--emulated 4 8`` does the same on emulated GPU clusters (2 A100 + 2 RTX
3090; 2 A100 + 2 RTX 4090 + 4 RTX 3090) running gpt3-1.3b plans with the
tiny stand-in: every op is padded to the cost model's time on TRUE figures
the plans do not know (efficiencies 0.5-0.6, memory bandwidth 80-85%, a
0.7 GB/s network), so the uncalibrated prediction is off the way a catalog is
off for real GPUs, and calibration must find the true figures from the trace.
Their column "error on the true figures" is the cost model's prediction with
the figures the run was timed with: the best any calibration can reach (what
is left is where the cost model composes a step differently from the runtime).

The plans keep potluck's default execution traits, which are the runtime's
(gradient all-reduce overlapped with the backward pass; fp32 on CPU).

CPU ranks share the machine with whatever else runs on it, and every other
process shows up as slower ops. Before each run the script waits (up to
``--quiet-wait`` seconds) until the rest of the machine is nearly idle, runs
every layout ``--rounds`` times in turn and keeps each layout's least
disturbed run (the lowest step time); the last column is the share of the
CPUs other processes used around that run.

    python benchmarks/calibration.py [--ranks 4 8] [--emulated 4 8] [--steps 12] [--rounds 2]
                                     [--keep DIR [--reuse]]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from potluck import api
from potluck.calibrate.calibrate_run import calibrate_run
from potluck.calibrate.compare_run import compare_run
from potluck.calibrate.fit import applied_overhead
from potluck.calibrate.run import load_run
from potluck.cluster.spec import parse_cluster
from potluck.errors import PotluckError
from potluck.model.spec import PRESETS
from potluck.planner.evaluate import predict
from potluck.plans import Plan, save_plan
from potluck.runtime.options import TrainOptions
from potluck.runtime.training import train

MODEL = replace(PRESETS["tiny-llama"], name="llama-h256-l8", hidden_size=256, ffn_hidden_size=688,
                num_heads=4, num_kv_heads=4, num_layers=8, max_seq_len=256)
LAYOUTS = {4: [(2, 2), (1, 4), (4, 1)], 8: [(2, 4), (1, 8), (8, 1), (4, 2)]}  # (dp, pp)
SHAPE = {"global_batch": 16, "seq_len": 128, "micro_batch_size": 2}
EMULATED = {
    4: "nodes:\n  - {name: a100, gpu: a100-80g-pcie, gpus_per_node: 2}\n"
       "  - {name: box3090, gpu: rtx3090, gpus_per_node: 2, nvlink: pairs}\n",
    8: "nodes:\n  - {name: a100, gpu: a100-80g-pcie, gpus_per_node: 2}\n"
       "  - {name: box4090, gpu: rtx4090, gpus_per_node: 2}\n"
       "  - {name: box3090, gpu: rtx3090, gpus_per_node: 4, nvlink: pairs}\n",
}
EMULATED_TITLES = {4: "emulated 2 A100 + 2 RTX 3090", 8: "emulated 2 A100 + 2 4090 + 4 3090"}
# What the emulated devices really do (the runs are timed with these); the plans and
# their predictions only know the catalog.
TRUE_DEVICES = {"a100-80g-pcie": "{matmul_efficiency: 0.6, memory_bandwidth_factor: 0.85}",
                "rtx3090": "{matmul_efficiency: 0.5, memory_bandwidth_factor: 0.8}",
                "rtx4090": "{matmul_efficiency: 0.55, memory_bandwidth_factor: 0.8}"}
TRUE_LINKS = "  links:\n    - {kind: network, bandwidth: 0.7GB/s, latency: 100us}\n"


def true_figures(cluster_text: str) -> str:
    """The calibration section with the true figures of the devices ``cluster_text`` has."""
    devices = "".join(f"    {name}: {figures}\n" for name, figures in TRUE_DEVICES.items()
                      if name in cluster_text)
    return "calibration:\n  devices:\n" + devices + TRUE_LINKS
EMULATED_LAYOUTS = {4: [{"dp": 2, "pp": 2}, {"dp": 1, "pp": 4}, {"dp": 4, "pp": 1}],
                    8: [{"dp": 2, "pp": 4}, {"dp": 1, "pp": 8}, {}]}  # {}: the planner's choice


def with_prediction(plan: Plan) -> Plan:
    """``plan`` with the cost model's prediction on its own cluster."""
    return replace(plan, prediction=predict(plan))


def cpu_plan(ranks: int, dp: int, pp: int) -> Plan:
    cluster = parse_cluster(f"nodes:\n  - {{name: cpu, gpu: cpu, gpus_per_node: {ranks}}}\n",
                            f"cpu{ranks}.yaml")
    return with_prediction(api.plan(cluster, MODEL, dp=dp, pp=pp, tp=1, **SHAPE).best)


def busy_share(seconds: float = 2.0) -> float:
    """Share of the machine's CPU time spent by all processes over ``seconds`` (Linux)."""
    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        idle = fields[3] + fields[4]
        return sum(fields) - idle, sum(fields)

    if not Path("/proc/stat").exists():
        return 0.0
    busy0, total0 = sample()
    time.sleep(seconds)
    busy1, total1 = sample()
    return (busy1 - busy0) / max(1, total1 - total0)


def wait_for_quiet(limit: float, wait_s: float) -> float:
    """Wait until other processes use less than ``limit`` of the CPUs; their share."""
    deadline = time.monotonic() + wait_s
    share = busy_share()
    while share > limit and time.monotonic() < deadline:
        share = busy_share()
    return share


@dataclass
class Run:
    run_dir: Path
    background: float  # share of the CPUs other processes used just before and after


def run(plan: Plan | tuple[Plan, Plan], out_dir: Path, args: argparse.Namespace,
        **options: object) -> Run:
    """Train ``plan`` with --trace into ``out_dir`` once the machine is quiet (with
    ``--reuse``, read the run already there). A pair is (the plan the run directory
    records, the plan that times the emulated run)."""
    background_file = out_dir / "background.txt"
    if args.reuse and background_file.is_file():
        return Run(out_dir, float(background_file.read_text()))
    plan, timing = plan if isinstance(plan, tuple) else (plan, plan)
    out_dir.mkdir(parents=True, exist_ok=True)
    before = wait_for_quiet(args.quiet_share, args.quiet_wait)
    train(timing, TrainOptions(steps=args.steps, out_dir=str(out_dir), trace_steps=args.steps - 3,
                               progress=False, overwrite=True, **options))  # a rerun replaces
    save_plan(plan, out_dir / "plan.json")  # after: the run writes the plan it ran (timing)
    background = max(before, busy_share(1.0))
    background_file.write_text(f"{background}\n")
    return Run(out_dir, background)


def measured_step_s(run_dir: Path) -> float:
    return compare_run(load_run(run_dir)).measured_step_s


def best_runs(plans: dict[str, Plan | tuple[Plan, Plan]], work: Path, args: argparse.Namespace,
              **options: object) -> dict[str, Run]:
    """Each layout run ``args.rounds`` times in turn; the least disturbed run of each."""
    tries: dict[str, list[Run]] = {name: [] for name in plans}
    for round_ in range(args.rounds):
        for i, (name, plan) in enumerate(plans.items()):
            tries[name].append(run(plan, work / f"{work.name}-{i}-{round_}", args, **options))
    return {name: min(runs, key=lambda r: measured_step_s(r.run_dir))
            for name, runs in tries.items()}


def cross_errors(runs: dict[str, Run], work: Path) -> dict[tuple[str, str], float]:
    """Step-time error of run B's plan on the cluster calibrated from run A (A == B too)."""
    errors = {}
    for fit_name, fit_run in runs.items():
        try:
            outcome = calibrate_run(fit_run.run_dir, out=work / f"{fit_name}.yaml")
        except PotluckError as err:  # the fit predicted its own run worse: nothing written
            print(f"{fit_name}: {err}", file=sys.stderr)
            outcome = None
        for name, other in runs.items():
            record = load_run(other.run_dir)
            plan = record.plan
            if outcome is not None:
                plan = applied_overhead(replace(plan, cluster=outcome.calibrated),
                                        outcome.fit.step_overhead_s or None)
            errors[(fit_name, name)] = compare_run(record, plan).cost_model_error
    return errors


def cluster_rows(title: str, runs: dict[str, Run], work: Path,
                 truth: dict[str, float] | None = None) -> list[str]:
    """Rows of the table for one cluster: the first run is the one calibrated on.
    ``truth``: per layout, the step time the cost model predicts on the figures an
    emulated run was timed with (the best any calibration can do)."""
    errors = cross_errors(runs, work)
    fit_name = next(iter(runs))
    rows, before_errors = [], []
    for name, found in runs.items():
        before = compare_run(load_run(found.run_dir))
        before_errors.append(abs(before.cost_model_error))
        after = errors[(fit_name, name)]
        true_error = ("–" if truth is None else
                      f"{truth[name] / before.measured_step_s - 1:+.1%}")
        rows.append(f"| {title} | {name} | {before.measured_step_s:.3f} s | "
                    f"{before.cost_model_step_s:.3f} s ({before.cost_model_error:+.0%}) | "
                    f"{after:+.1%}{' (fitted on it)' if name == fit_name else ''} | "
                    f"{true_error} | {found.background:.0%} |")
    spread = [abs(e) for (fit, name), e in errors.items() if fit != name]
    rows.append(f"| {title} | every ordered pair (fit one, predict another) | | mean "
                f"{statistics.fmean(before_errors):.0%} | mean {statistics.fmean(spread):.1%}, "
                f"worst {max(spread):.1%} | | |")
    return rows


def cpu_plans(ranks: int) -> dict[str, Plan]:
    plans = [cpu_plan(ranks, dp, pp) for dp, pp in LAYOUTS[ranks]]
    return {plan.layout(): plan for plan in plans}


def emulated_plans(ranks: int) -> dict[str, tuple[Plan, Plan]]:
    """Per layout: the plan on the catalog's figures, and the same on the true figures."""
    claimed = parse_cluster(EMULATED[ranks], f"emulated{ranks}.yaml")
    true = parse_cluster(EMULATED[ranks] + true_figures(EMULATED[ranks]),
                         f"emulated{ranks}-true.yaml")
    plans = {}
    for pins in EMULATED_LAYOUTS[ranks]:
        plan = with_prediction(api.plan(claimed, "gpt3-1.3b", global_batch=32, seq_len=1024,
                                     tp=1 if pins else None, **pins).best)
        name = plan.layout() + ("" if pins else " (planner)")
        plans[name] = (plan, with_prediction(replace(plan, cluster=true)))
    return plans


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, nargs="*", default=[4, 8], choices=sorted(LAYOUTS))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quiet-share", type=float, default=0.15)
    parser.add_argument("--quiet-wait", type=float, default=120.0)
    parser.add_argument("--keep", help="Keep the run directories here (traces, plans, "
                        "calibrated cluster files).")
    parser.add_argument("--reuse", action="store_true",
                        help="Calibrate and compare the runs already in --keep DIR again.")
    parser.add_argument("--emulated", type=int, nargs="*", default=[], choices=sorted(EMULATED))
    args = parser.parse_args()
    print("| cluster | layout | measured step | predicted, uncalibrated (error) | error after "
          "calibrating on the first layout | error on the true figures | background CPU |")
    print("|---|---|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory(prefix="potluck-calibration-") as tmp:
        tmp = args.keep or tmp
        for ranks in args.ranks:
            work = Path(tmp) / f"cpu{ranks}"
            runs = best_runs(cpu_plans(ranks), work, args)
            print("\n".join(cluster_rows(f"{ranks} CPU ranks", runs, work)), flush=True)
        for ranks in args.emulated:
            work = Path(tmp) / f"emulated{ranks}"
            plans = emulated_plans(ranks)
            runs = best_runs(plans, work, args, emulate=True, stand_in="tiny")
            truth = {name: timing.prediction.iteration_time_s for name, (_, timing) in plans.items()}
            print("\n".join(cluster_rows(EMULATED_TITLES[ranks], runs, work, truth)), flush=True)


if __name__ == "__main__":
    main()
