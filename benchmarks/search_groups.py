"""Search time against the number of distinct node groups: labs of 1 to 32 machines that
each differ (1-8 GPUs, consumer to datacenter GPUs, 1-100 Gb/s), the first N of one list.

Usage: taskset -c 0 python benchmarks/search_groups.py [--groups N ...]   (one core)

Targets (issue 29): 16 groups in at most 10 s of CPU, 32 in at most 30 s. CPU time is
the process's own (time.process_time), so other load on the machine does not count.
"""

from __future__ import annotations

import argparse
import time

from potluck.cluster import parse_cluster
from potluck.model import load_model
from potluck.planner.search import search
from potluck.plans import TrainingShape

MACHINES = [  # (gpu, GPUs, NVLink, network): distinct machines in the order labs add them
    ("rtx3090", 4, "pairs", "10Gb/s"), ("rtx4090", 2, "none", "10Gb/s"),
    ("a100-40g-pcie", 4, "none", "100Gb/s"), ("rtx3060", 1, "none", "1Gb/s"),
    ("rtx2080ti", 1, "none", "1Gb/s"), ("rtx-a6000", 2, "pairs", "25Gb/s"),
    ("l40s", 4, "none", "25Gb/s"), ("rtx3080", 1, "none", "1Gb/s"),
    ("v100-32g", 8, "all", "25Gb/s"), ("t4", 4, "none", "10Gb/s"),
    ("a10", 2, "none", "10Gb/s"), ("rtx4080", 1, "none", "1Gb/s"),
    ("rtx-a5000", 4, "pairs", "10Gb/s"), ("h100-pcie", 2, "none", "100Gb/s"),
    ("l4", 4, "none", "25Gb/s"), ("rtx5090", 2, "none", "10Gb/s"),
    ("rtx3090ti", 1, "none", "1Gb/s"), ("rtx4070ti", 1, "none", "1Gb/s"),
    ("a40", 2, "pairs", "25Gb/s"), ("rtx3080ti", 1, "none", "1Gb/s"),
    ("a100-80g-pcie", 2, "pairs", "100Gb/s"), ("titan-rtx", 2, "pairs", "10Gb/s"),
    ("rtx-6000-ada", 4, "none", "25Gb/s"), ("v100-16g", 4, "all", "10Gb/s"),
    ("rtx2080", 1, "none", "1Gb/s"), ("l40", 2, "none", "25Gb/s"),
    ("rtx3090", 2, "none", "1Gb/s"), ("rtx4090", 1, "none", "1Gb/s"),
    ("a10", 1, "none", "10Gb/s"), ("t4", 1, "none", "1Gb/s"),
    ("l4", 2, "none", "10Gb/s"), ("rtx-a6000", 1, "none", "10Gb/s"),
]
ROWS = (1, 2, 4, 6, 8, 12, 16, 24, 32)
MODEL, BATCH, SEQ = "llama2-7b", 256, 4096


def cluster_text(groups: int) -> str:
    lines = ["nodes:"]
    for k, (gpu, gpus, nvlink, network) in enumerate(MACHINES[:groups]):
        lines.append(f"  - {{name: m{k:02d}-{gpu}, gpu: {gpu}, gpus_per_node: {gpus}, "
                     f"nvlink: {nvlink}, inter_bandwidth: {network}}}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, nargs="*", default=list(ROWS))
    args = parser.parse_args()
    model = load_model(MODEL)
    print(f"{MODEL}, global batch {BATCH}, sequence {SEQ}\n")
    print("| node groups | GPUs | GPU types | CPU time | candidates | best layout | iteration |")
    print("|---:|---:|---:|---:|---:|---|---:|")
    for groups in args.groups:
        spec = parse_cluster(cluster_text(groups))
        types = len({gpu for gpu, *_ in MACHINES[:groups]})
        began = time.process_time()
        result = search(spec, model, TrainingShape(BATCH, SEQ))
        cpu_s = time.process_time() - began
        best = result.best
        print(f"| {groups} | {spec.num_gpus} | {types} | {cpu_s:.1f} s | {result.candidates} | "
              f"{best.layout()} ({best.num_gpus} used) | "
              f"{best.prediction.iteration_time_s:.2f} s |", flush=True)


if __name__ == "__main__":
    main()
