"""Benchmark: simulate one iteration of 1024-GPU plans (target: under 1 s each).

Run: /work/venv/bin/python benchmarks/simulate_1024.py
Prints, per plan, the layout, the simulation time (best of 3), how many pipelines were
actually simulated (identical, independent replicas share one run), the events run, and
the simulated against the cost model's iteration time.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from potluck import api  # noqa: E402
from potluck.cluster.spec import parse_cluster  # noqa: E402
from potluck.sim import simulate  # noqa: E402

HOMOGENEOUS = """
name: a100x1024
nodes:
  - name: dgx
    gpu: a100-80g-sxm
    gpus_per_node: 8
    count: 128
    inter_bandwidth: 200Gb/s
"""

MIXED = """
name: mixed1024
nodes:
  - name: dgx
    gpu: a100-80g-sxm
    gpus_per_node: 8
    count: 64
    inter_bandwidth: 200Gb/s
  - name: box4090
    gpu: rtx4090
    gpus_per_node: 8
    count: 64
    inter_bandwidth: 25Gb/s
"""

CASES = [
    ("1024 A100, llama2-70b, tp=8 pp=8 dp=16", HOMOGENEOUS, "llama2-70b",
     {"tp": 8, "pp": 8, "dp": 16}),
    ("1024 A100, llama2-70b, tp=4 pp=8 dp=32 (two replicas per machine pair)", HOMOGENEOUS,
     "llama2-70b", {"tp": 4, "pp": 8, "dp": 32}),
    ("1024 A100, llama2-13b, tp=1 pp=4 dp=256 (8 replicas share each machine's card)", HOMOGENEOUS,
     "llama2-13b", {"tp": 1, "pp": 4, "dp": 256}),
    ("512 A100 + 512 RTX 4090, llama2-13b, planner's choice", MIXED, "llama2-13b", {}),
]


def without_twins(plan) -> None:
    """The engine alone on every pipeline of ``plan`` at once: the cost when no replica is a twin."""
    from potluck.cluster.topology import Cluster
    from potluck.planner.cost import CostModel
    from potluck.schedules import schedule_for
    from potluck.sim import engine, program
    from potluck.sim.network import Network
    from potluck.sim.workload import plan_workloads

    cost = CostModel(Cluster(plan.cluster), plan.model, plan.training.seq_len, plan.training.dtype)
    network = Network(cost.cluster)
    started = time.perf_counter()
    built = program.build(plan_workloads(plan, cost), schedule_for(plan.schedule), 1, network)
    engine.run(built.program, network.capacity)
    elapsed = time.perf_counter() - started
    print(f"  without twins (all {plan.dp} pipelines as one program, {len(built.program)} "
          f"events incl. send/recv batches): {elapsed:.3f} s")


def main() -> None:
    for label, cluster, model, pins in CASES:
        plan = api.plan(parse_cluster(cluster), model, global_batch=1024, seq_len=4096,
                        top_k=1, **pins).best
        times = []
        for _ in range(3):
            started = time.perf_counter()
            result = simulate(plan)
            times.append(time.perf_counter() - started)
        events = sum(len(run.ops) for run in result.pipelines if run.twin_of == run.index)
        print(f"{label}\n  plan {plan.layout()} on {plan.num_gpus} GPUs, "
              f"{plan.pipelines[0].num_micro_batches} micro-batches per pipeline, "
              f"{plan.schedule.value}\n"
              f"  simulate: {min(times):.3f} s (best of 3); pipelines simulated "
              f"{result.simulated_pipelines}/{plan.dp}; ops run {events}\n"
              f"  iteration: simulated {result.iteration_time_s:.3f} s, cost model "
              f"{result.predicted_time_s:.3f} s "
              f"({result.predicted_time_s / result.iteration_time_s - 1:+.1%})")
        if pins.get("dp") == 32:
            without_twins(plan)


if __name__ == "__main__":
    main()
