"""Scheduling policies compared: average job completion time (JCT) and makespan.

(a) A small mixed lab (2 machines of 4 A100 and 4 machines of 4 RTX 3090 on 10 Gb/s)
    shared by eight jobs whose speedups on the A100s differ: the compute-bound models
    (LLaMA-2 7B, GPT-3 2.7B and 1.3B) run about 3-4x faster there per machine, the
    overhead-bound tiny-llama about as fast anywhere. Every policy on the same jobs.
(b) A synthetic trace of 120 jobs (Poisson arrivals, presets from GPT-3 350M to LLaMA-2 13B)
    on 256 GPUs (8 machines of 8 A100, 12 of 8 RTX 4090, 12 of 8 RTX 3090, 100 Gb/s), with
    the wall time of planning and simulating all four policies.

Usage: taskset -c 0 python benchmarks/schedule_policies.py   (one core)

Throughputs are the planner's predictions; each start or move of a job costs 120 s.
"""

from __future__ import annotations

import time

from potluck.cluster import parse_cluster
from potluck.model import load_model
from potluck.multijob import Job, JobShape, ThroughputTable, compare_policies, synthetic_trace
from potluck.plans import TrainingShape

LAB = """
name: lab
nodes:
  - {name: a100, gpu: a100-80g-sxm, gpus_per_node: 4, count: 2, inter_bandwidth: 10Gb/s}
  - {name: r3090, gpu: rtx3090, gpus_per_node: 4, count: 4, nvlink: pairs, inter_bandwidth: 10Gb/s}
"""
LAB_JOBS = [  # (name, model, global batch, sequence length, tokens, arrival hour)
    ("tiny-a", "tiny-llama", 32, 1024, 20_000_000_000, 0.0),
    ("llama-7b", "llama2-7b", 64, 4096, 300_000_000, 0.0),
    ("gpt-2.7b", "gpt3-2.7b", 64, 2048, 500_000_000, 0.0),
    ("tiny-b", "tiny-llama", 32, 1024, 20_000_000_000, 0.5),
    ("gpt-1.3b", "gpt3-1.3b", 64, 2048, 1_000_000_000, 1.0),
    ("tiny-c", "tiny-llama", 32, 1024, 10_000_000_000, 1.5),
    ("gpt-125m", "gpt3-125m", 64, 2048, 3_000_000_000, 2.0),
    ("llama-7b-2", "llama2-7b", 64, 4096, 200_000_000, 2.5),
]
BIG = """
name: big-lab
nodes:
  - {name: a100, gpu: a100-80g-sxm, gpus_per_node: 8, count: 8, inter_bandwidth: 100Gb/s}
  - {name: r4090, gpu: rtx4090, gpus_per_node: 8, count: 12, inter_bandwidth: 100Gb/s}
  - {name: r3090, gpu: rtx3090, gpus_per_node: 8, count: 12, nvlink: pairs, inter_bandwidth: 100Gb/s}
"""
TRACE_JOBS, TRACE_SEED = 120, 1


def lab_jobs(big_first: bool = False) -> tuple[Job, ...]:
    rows = [*LAB_JOBS[1:3], LAB_JOBS[0], *LAB_JOBS[3:]] if big_first else LAB_JOBS
    return tuple(Job(name, JobShape(load_model(model), TrainingShape(batch, seq)), tokens, arrival,
                     model_name=model)
                 for name, model, batch, seq, tokens, arrival in rows)


def print_table(title: str, comparison) -> None:
    best = min(run.result.avg_completion_h for run in comparison.runs)
    print(f"\n{title}\n")
    print("| policy | avg JCT | vs best | makespan |")
    print("|---|---:|---:|---:|")
    for run in comparison.runs:
        result = run.result
        print(f"| {result.policy.value} | {result.avg_completion_h:.2f} h | "
              f"{result.avg_completion_h / best:.2f}x | {result.makespan_h:.2f} h |")


def main() -> None:
    spec = parse_cluster(LAB)
    lab_table = ThroughputTable(spec)
    for big_first, order in ((False, "a tiny job first"), (True, "big jobs first")):
        lab = compare_policies(lab_jobs(big_first), lab_table)
        print_table(f"(a) {len(LAB_JOBS)} jobs on {spec.name}: {spec.num_gpus} GPUs "
                    f"(8 A100, 16 RTX 3090), {order}", lab)
    started, cpu_started = time.perf_counter(), time.process_time()
    big = parse_cluster(BIG)
    table = ThroughputTable(big)
    trace = compare_policies(synthetic_trace(table, TRACE_JOBS, TRACE_SEED), table, TRACE_SEED)
    wall_s, cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
    print_table(f"(b) {TRACE_JOBS} jobs (seed {TRACE_SEED}) on {big.name}: {big.num_gpus} GPUs "
                "(64 A100, 96 RTX 4090, 96 RTX 3090)", trace)
    print(f"\n(b) took {wall_s:.1f} s wall, {cpu_s:.1f} s CPU for all four policies "
          f"({table.planner_calls} plans, {table.planner_time_s:.1f} s of planning)")


if __name__ == "__main__":
    main()
