"""Scheduling policies compared: average job completion time (JCT) and makespan.

(a) A small mixed lab (2 machines of 4 A100 and 4 machines of 4 RTX 3090 on 10 Gb/s)
    shared by eight jobs: LLaMA-2 7B, GPT-3 2.7B, 1.3B and 125M, and three jobs of the
    toy tiny-llama (hidden size 64), which is host-bound and about as fast on either GPU.
    Two arrival orders.
(b) The same lab shared by eight jobs a lab runs, chosen so that their speedups on the
    A100s differ as much as potluck's cost model lets realistic jobs differ: small-batch
    fine-tunes of GPT-3 125M and Qwen2.5 0.5B on 512-token sequences (2.5-3x per GPU,
    no gain from a second machine over 10 Gb/s) up to long-context LLaMA-3.1 8B and
    Qwen2.5 7B and LLaMA-2 13B (4.5-5x, pipelines that scale over machines). The table of
    tokens/s per machine comes first. Two loads: the jobs' tokens as listed and tripled.
(c) A synthetic trace of 120 jobs (Poisson arrivals, presets from GPT-3 350M to LLaMA-2 13B)
    on 256 GPUs (8 machines of 8 A100, 12 of 8 RTX 4090, 12 of 8 RTX 3090, 100 Gb/s), with
    the wall time of planning and simulating every policy.

Policies: fifo, equal, Gavel's throughput and fair, and jct (shortest remaining time first
on each job's fastest GPUs); "vs best aware" divides by the best of the last three.

``equal`` visits node groups in the cluster file's order (it is blind to which is
faster), so where a group sits in the file changes its result. Every case is therefore
run on the cluster file as written and with its node groups reversed; each figure is the
mean of the two, and the table shows equal's two results.

Usage: taskset -c 0 python benchmarks/schedule_policies.py   (one core)

Throughputs are the planner's predictions; each start or move of a job costs 120 s.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from potluck.cluster import parse_cluster
from potluck.model import load_model
from potluck.multijob import Job, JobShape, Policy, ThroughputTable, compare_policies, synthetic_trace
from potluck.multijob.allocations import Allocation
from potluck.plans import TrainingShape

LAB_GROUPS = (
    "{name: a100, gpu: a100-80g-sxm, gpus_per_node: 4, count: 2, inter_bandwidth: 10Gb/s}",
    "{name: r3090, gpu: rtx3090, gpus_per_node: 4, count: 4, nvlink: pairs, inter_bandwidth: 10Gb/s}",
)
TOY_JOBS = [  # (name, model, global batch, sequence length, tokens, arrival hour)
    ("tiny-a", "tiny-llama", 32, 1024, 20_000_000_000, 0.0),
    ("llama-7b", "llama2-7b", 64, 4096, 300_000_000, 0.0),
    ("gpt-2.7b", "gpt3-2.7b", 64, 2048, 500_000_000, 0.0),
    ("tiny-b", "tiny-llama", 32, 1024, 20_000_000_000, 0.5),
    ("gpt-1.3b", "gpt3-1.3b", 64, 2048, 1_000_000_000, 1.0),
    ("tiny-c", "tiny-llama", 32, 1024, 10_000_000_000, 1.5),
    ("gpt-125m", "gpt3-125m", 64, 2048, 3_000_000_000, 2.0),
    ("llama-7b-2", "llama2-7b", 64, 4096, 200_000_000, 2.5),
]
LAB_JOBS = [
    ("sft-0.5b", "qwen2.5-0.5b", 16, 512, 500_000_000, 0.0),
    ("long-8b", "llama3.1-8b", 32, 8192, 100_000_000, 0.0),
    ("cls-125m", "gpt3-125m", 8, 512, 1_000_000_000, 0.5),
    ("pre-1b", "llama3.2-1b", 16, 2048, 300_000_000, 1.0),
    ("ft-13b", "llama2-13b", 64, 4096, 60_000_000, 1.5),
    ("sft-0.5b-2", "qwen2.5-0.5b", 16, 512, 300_000_000, 2.0),
    ("long-7b", "qwen2.5-7b", 16, 16384, 100_000_000, 2.5),
    ("cls-125m-2", "gpt3-125m", 8, 512, 600_000_000, 3.0),
]
LOADS = (1, 3)  # (b): the jobs' tokens times this
BIG_GROUPS = (
    "{name: a100, gpu: a100-80g-sxm, gpus_per_node: 8, count: 8, inter_bandwidth: 100Gb/s}",
    "{name: r4090, gpu: rtx4090, gpus_per_node: 8, count: 12, inter_bandwidth: 100Gb/s}",
    "{name: r3090, gpu: rtx3090, gpus_per_node: 8, count: 12, nvlink: pairs, inter_bandwidth: 100Gb/s}",
)
TRACE_JOBS, TRACE_SEED = 120, 1
AWARE = (Policy.THROUGHPUT, Policy.FAIR, Policy.JCT)  # "vs best aware" divides by the best


def cluster(name: str, groups: tuple[str, ...]):
    return parse_cluster(f"name: {name}\nnodes:\n" + "".join(f"  - {g}\n" for g in groups))


def jobs_of(rows, scale: int = 1) -> tuple[Job, ...]:
    return tuple(Job(name, JobShape(load_model(model), TrainingShape(batch, seq)), tokens * scale,
                     arrival, model_name=model)
                 for name, model, batch, seq, tokens, arrival in rows)


@dataclass(frozen=True)
class Row:
    policy: Policy
    avg_h: tuple[float, ...]  # one per node-group order
    makespan_h: tuple[float, ...]


def both_orders(jobs: tuple[Job, ...], tables: tuple[ThroughputTable, ...],
                seed: int | None = None) -> list[Row]:
    """Every policy on ``jobs`` on each of ``tables`` (the cluster in each group order)."""
    runs = [compare_policies(jobs, table, seed).runs for table in tables]
    return [Row(policy, tuple(r[i].result.avg_completion_h for r in runs),
                tuple(r[i].result.makespan_h for r in runs))
            for i, policy in enumerate(Policy)]


def print_table(title: str, rows: list[Row], orders: tuple[str, str]) -> None:
    mean = {row.policy: sum(row.avg_h) / len(row.avg_h) for row in rows}
    aware = min(mean[p] for p in AWARE)
    print(f"\n{title}\n")
    print(f"| policy | avg JCT | {orders[0]} / {orders[1]} | vs best aware | makespan |")
    print("|---|---:|---:|---:|---:|")
    for row in rows:
        each = " / ".join(f"{h:.2f}" for h in row.avg_h)
        span = sum(row.makespan_h) / len(row.makespan_h)
        print(f"| {row.policy.value} | {mean[row.policy]:.2f} h | {each} h | "
              f"{mean[row.policy] / aware:.2f}x | {span:.2f} h |")


def print_speedups(jobs: tuple[Job, ...], table: ThroughputTable) -> None:
    """Tokens/s per machine of each group, the A100's speedup per GPU, and how each job
    scales from one 3090 machine to four."""
    one, four = Allocation((("r3090", 1),)), Allocation((("r3090", 4),))
    print("\n(b) the jobs: tokens/s per machine (planner), speedup per GPU, scaling on 3090s\n")
    print("| job | model | batch x seq | A100 machine | 3090 machine | A100 / 3090 | 4 / 1 3090 machines |")
    print("|---|---|---|---:|---:|---:|---:|")
    seen = set()
    for job in jobs:
        if job.shape in seen:
            continue
        seen.add(job.shape)
        fast, slow = table.per_machine(job.shape, "a100"), table.per_machine(job.shape, "r3090")
        scaling = table.tokens_per_s(job.shape, four) / table.tokens_per_s(job.shape, one)
        training = job.shape.training
        print(f"| {job.name} | {job.model_name} | {training.global_batch} x {training.seq_len} | "
              f"{fast:,.0f} | {slow:,.0f} | {fast / slow:.2f}x | {scaling:.2f}x |")


def lab_cases() -> None:
    tables = tuple(ThroughputTable(cluster("lab", groups)) for groups in (LAB_GROUPS, LAB_GROUPS[::-1]))
    orders = ("A100 first", "3090 first")
    for big_first, order in ((False, "a tiny job first"), (True, "big jobs first")):
        rows = [*TOY_JOBS[1:3], TOY_JOBS[0], *TOY_JOBS[3:]] if big_first else TOY_JOBS
        print_table(f"(a) {len(rows)} jobs with toy ones on lab: 24 GPUs (8 A100, 16 RTX 3090), "
                    f"{order}", both_orders(jobs_of(rows), tables), orders)
    print_speedups(jobs_of(LAB_JOBS), tables[0])
    for scale in LOADS:
        tokens = "tokens as listed" if scale == 1 else f"tokens x{scale}"
        print_table(f"(b) {len(LAB_JOBS)} lab jobs whose speedups differ on lab, {tokens}",
                    both_orders(jobs_of(LAB_JOBS, scale), tables), orders)


def trace_case() -> None:
    started, cpu_started = time.perf_counter(), time.process_time()
    table = ThroughputTable(cluster("big-lab", BIG_GROUPS))
    jobs = synthetic_trace(table, TRACE_JOBS, TRACE_SEED)
    first = compare_policies(jobs, table, TRACE_SEED)
    wall_s, cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
    planned = (table.planner_calls, table.planner_time_s)
    reversed_table = ThroughputTable(cluster("big-lab", BIG_GROUPS[::-1]))
    rows = both_orders(jobs, (table, reversed_table), TRACE_SEED)
    assert [r.result.avg_completion_h for r in first.runs] == [row.avg_h[0] for row in rows]
    print_table(f"(c) {TRACE_JOBS} jobs (seed {TRACE_SEED}) on big-lab: 256 GPUs "
                "(64 A100, 96 RTX 4090, 96 RTX 3090)", rows, ("A100 first", "3090 first"))
    print(f"\n(c) took {wall_s:.1f} s wall, {cpu_s:.1f} s CPU for all {len(Policy)} policies in one "
          f"group order ({planned[0]} plans, {planned[1]:.1f} s of planning)")


def main() -> None:
    lab_cases()
    trace_case()


if __name__ == "__main__":
    main()
