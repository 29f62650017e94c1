"""`potluck calibrate --measured` on synthetic runs of a mixed cluster whose true inputs
are known: what the fit recovers, its in-sample and leave-one-out error, and its time.

The "measured" iteration times are potluck's own predictions for pinned layouts on the
demo cluster (`src/potluck/examples/mixed.yaml`: RTX 3090s, RTX 4090s, A100s on a 10 Gb/s
network) with TRUE inputs the cluster file does not know (matmul efficiencies 0.45-0.6,
the network at 45% of its figure, 4 ms per micro-batch and 30 ms per iteration of
framework overhead), times a seeded log-normal noise of ``--noise`` (the run-to-run
spread of a real measurement). The fit starts from the cluster file's own figures.
Layouts the planner refuses are left out (reported by the command).

    python benchmarks/calibrate_measured.py [--model gpt3-1.3b] [--rows 10 16] [--noise 0 0.03]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

from potluck.calibrate.measured.calibrate import calibrate_measured
from potluck.calibrate.measured.report import summary
from potluck.calibrate.measured.runs import MeasuredRun
from potluck.cluster.spec import parse_cluster
from potluck.errors import PotluckError
from potluck.model.loading import load_model
from potluck.planner.search import search
from potluck.plans import Execution

CLUSTER = Path(__file__).resolve().parents[1] / "src/potluck/examples/mixed.yaml"
TRUE_EFFICIENCY = {"rtx3090": 0.55, "rtx4090": 0.6, "a100-80g-sxm": 0.45}
TRUE_NETWORK_FACTOR = 0.45
TRUE_EXECUTION = Execution(micro_batch_overhead_s=0.004, step_overhead_s=0.03)
LAYOUTS = (  # tp, pp, dp, micro-batch size, global batch, sequence length
    (1, 2, 4, 1, 64, 1024), (2, 2, 2, 1, 64, 1024), (2, 4, 1, 1, 32, 1024), (1, 4, 2, 2, 64, 1024),
    (2, 1, 4, 1, 64, 1024), (4, 2, 1, 1, 32, 2048), (1, 2, 6, 1, 96, 1024), (2, 3, 2, 1, 64, 1024),
    (1, 8, 1, 1, 32, 1024), (2, 2, 3, 1, 48, 2048), (1, 4, 3, 1, 96, 512), (4, 1, 2, 1, 32, 1024),
    (2, 2, 2, 2, 64, 512), (1, 6, 2, 1, 64, 1024), (2, 4, 1, 2, 64, 1024), (1, 2, 7, 1, 112, 1024),
)


def true_text() -> str:
    devices = "".join(f"    {name}: {{matmul_efficiency: {value}}}\n"
                      for name, value in TRUE_EFFICIENCY.items())
    links = "".join(f"    - {{kind: network, groups: [{group}], bandwidth: {10 * TRUE_NETWORK_FACTOR}Gb/s}}\n"
                    for group in ("box3090", "box4090", "a100"))
    return CLUSTER.read_text() + f"calibration:\n  devices:\n{devices}  links:\n{links}"


def measured_rows(model, rows: int, noise: float, seed: int) -> list[str]:
    spec = parse_cluster(true_text(), "true.yaml")
    rng = random.Random(seed)
    lines = []
    for layout in LAYOUTS[:rows]:
        run = MeasuredRun(0, *layout, 1.0)
        try:
            best = search(spec, model, run.shape(TRUE_EXECUTION), run.options()).best
        except PotluckError:
            lines.append(",".join(map(str, layout)) + ",1.0")  # the command reports it
            continue
        time_s = best.prediction.iteration_time_s * rng.lognormvariate(0.0, noise)
        lines.append(",".join(map(str, layout)) + f",{time_s:.6g}")
    return lines


def run_case(model, rows: int, noise: float, folder: Path) -> list[str]:
    runs = folder / f"runs-{rows}-{noise}.csv"
    runs.write_text("tp,pp,dp,micro_batch_size,global_batch,seq_len,iteration_time_s\n"
                    + "\n".join(measured_rows(model, rows, noise, seed=rows)) + "\n")
    started = time.perf_counter()
    try:
        outcome = calibrate_measured(runs, model, CLUSTER, folder / "calibrated.yaml")
    except PotluckError as err:
        return [f"| {rows} | {noise:.0%} | refused: {err} | | | | | |"]
    total_s = time.perf_counter() - started
    figures = summary(outcome)
    fitted = ", ".join(f"{p.name} {v * 1e3:.3g} ms" if p.in_seconds else
                       f"{p.name} {p.start:.3g} -> {v:.3g}" for p, v in outcome.fit.values.items())
    return [f"| {rows} ({len(outcome.planned)} planned) | {noise:.0%} | {fitted} | "
            f"{figures['mape_before']:.1%} | {figures['mape_after']:.1%} | "
            f"{figures['mape_leave_one_out']:.1%} | {figures['spearman_leave_one_out']:.3f} | "
            f"{outcome.fit_time_s:.1f} s ({total_s:.1f} s) |"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt3-1.3b")
    parser.add_argument("--rows", type=int, nargs="+", default=[10, 16])
    parser.add_argument("--noise", type=float, nargs="+", default=[0.0, 0.03])
    args = parser.parse_args()
    model = load_model(args.model)
    truth = ", ".join(f"{k} {v}" for k, v in TRUE_EFFICIENCY.items())
    print(f"True inputs: matmul efficiency {truth}; network factor {TRUE_NETWORK_FACTOR}; "
          f"overheads {TRUE_EXECUTION.micro_batch_overhead_s * 1e3:g} ms per micro-batch, "
          f"{TRUE_EXECUTION.step_overhead_s * 1e3:g} ms per iteration. Model {args.model}.\n")
    print("| runs | noise | fitted (cluster file -> fit) | MAPE before | after | leave-one-out | "
          "Spearman (LOO) | fit + LOO time (with planning) |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        for rows in args.rows:
            for noise in args.noise:
                for line in run_case(model, rows, noise, Path(folder)):
                    print(line)


if __name__ == "__main__":
    main()
