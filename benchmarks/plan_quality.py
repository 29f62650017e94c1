"""Plan quality: the search's best plan against exhaustive enumeration (up to 16 GPUs).

The exhaustive reference (potluck.planner.exhaustive) tries every way to group the
tensor-parallel units into any number of pipelines, in every order, leaving any out,
with every micro-batch size and recomputation mode; the search assumes identical
pipelines within a family and prunes. Quality = optimum time / search time.

Usage: python benchmarks/plan_quality.py
"""

from __future__ import annotations

import time
from dataclasses import replace

from potluck.cluster import parse_cluster
from potluck.model import load_model
from potluck.planner.exhaustive import exhaustive_best
from potluck.planner.options import SearchOptions
from potluck.planner.search import search
from potluck.plans import TrainingShape

CASES = [  # (name, cluster, TP pinned per group or None, model, layers, batch, seq)
    ("2 A100 PCIe + 2 RTX 3090 (NVLink pair)", """
nodes:
  - {name: a100, gpu: a100-80g-pcie, gpus_per_node: 2, inter_bandwidth: 10Gb/s}
  - {name: r3090, gpu: rtx3090, gpus_per_node: 2, nvlink: pairs, inter_bandwidth: 10Gb/s}
""", None, "gpt3-1.3b", 12, 16, 2048),
    ("A100 + 4090 + 2x3090 + 2 T4 (6 GPUs, 4 types)", """
nodes:
  - {name: a100, gpu: a100-80g-sxm, gpus_per_node: 1, inter_bandwidth: 10Gb/s}
  - {name: r4090, gpu: rtx4090, gpus_per_node: 1, inter_bandwidth: 10Gb/s}
  - {name: r3090, gpu: rtx3090, gpus_per_node: 2, nvlink: pairs, inter_bandwidth: 10Gb/s}
  - {name: t4, gpu: t4, gpus_per_node: 2, inter_bandwidth: 10Gb/s}
""", {"r3090": 2, "t4": 2}, "gpt3-1.3b", 12, 16, 2048),
    ("8 GPUs: 2 A100 + 2 RTX 4090 + 4 RTX 3090 (pairs), 10 Gb/s", """
nodes:
  - {name: a100, gpu: a100-80g-sxm, gpus_per_node: 2, inter_bandwidth: 10Gb/s}
  - {name: r4090, gpu: rtx4090, gpus_per_node: 2, inter_bandwidth: 10Gb/s}
  - {name: r3090, gpu: rtx3090, gpus_per_node: 4, nvlink: pairs, inter_bandwidth: 10Gb/s}
""", {"r3090": 2}, "gpt3-2.7b", 16, 32, 2048),
    ("8 RTX 4090, 2 machines on 25 Gb/s", """
nodes:
  - {name: box, gpu: rtx4090, gpus_per_node: 4, count: 2, inter_bandwidth: 25Gb/s}
""", {"box": 2}, "llama2-7b", 32, 32, 4096),
    ("16 GPUs: 8 A100 SXM + 2x4 RTX 3090 (pairs), 10 Gb/s", """
nodes:
  - {name: a100, gpu: a100-80g-sxm, gpus_per_node: 8, inter_bandwidth: 10Gb/s}
  - {name: r3090, gpu: rtx3090, gpus_per_node: 4, count: 2, nvlink: pairs, inter_bandwidth: 10Gb/s}
""", {"a100": 4, "r3090": 2}, "llama2-13b", 40, 32, 4096),
    ("16 GPUs: 8 L40S + 8 A10 (2 machines), 25 Gb/s", """
nodes:
  - {name: l40s, gpu: l40s, gpus_per_node: 8, inter_bandwidth: 25Gb/s}
  - {name: a10, gpu: a10, gpus_per_node: 8, inter_bandwidth: 25Gb/s}
""", {"l40s": 4, "a10": 4}, "llama2-7b", 32, 32, 4096),
]


def main() -> None:
    print("| cluster | model | optimum | search | quality | exhaustive time | search time |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, text, group_tp, model_name, layers, batch, seq in CASES:
        spec = parse_cluster(text)
        model = replace(load_model(model_name), num_layers=layers)
        shape = TrainingShape(batch, seq)
        started = time.perf_counter()
        optimum = exhaustive_best(spec, model, shape, micro_batch_sizes=(1, 2, 4, 8, 16),
                                  group_tp=group_tp)
        exhaustive_s = time.perf_counter() - started
        options = SearchOptions(group_tp=tuple((group_tp or {}).items()) or None)
        started = time.perf_counter()
        found = search(spec, model, shape, options).best
        search_s = time.perf_counter() - started
        best, mine = optimum.prediction.iteration_time_s, found.prediction.iteration_time_s
        print(f"| {name} | {model_name} ({layers} layers) | {best:.3f} s {optimum.layout()} | "
              f"{mine:.3f} s {found.layout()} | {best / mine:.3f} | {exhaustive_s:.0f} s | "
              f"{search_s:.2f} s |")


if __name__ == "__main__":
    main()
