"""Search time against cluster size: 8 to 1024 GPUs of 3-4 GPU types, in even and uneven
machine counts.

Usage: taskset -c 0 python benchmarks/search_scale.py   (one core)

CPU time is the process's own (time.process_time): on a busy machine wall-clock time
also counts the time other processes held the core.
"""

from __future__ import annotations

import time

from potluck.cluster import parse_cluster
from potluck.model import load_model
from potluck.planner.search import search
from potluck.plans import TrainingShape

GROUPS = [  # (name, gpu, node size, network, extra)
    ("h100", "h100-sxm", 8, "400Gb/s", ""),
    ("a100", "a100-80g-sxm", 8, "200Gb/s", ""),
    ("r4090", "rtx4090", 8, "25Gb/s", ""),
    ("r3090", "rtx3090", 8, "25Gb/s", ", nvlink: pairs"),
]
CASES = [  # (GPUs per type, model, global batch, sequence length)
    ((0, 2, 2, 4), "gpt3-1.3b", 64, 2048),
    ((16, 16, 16, 16), "llama2-13b", 256, 4096),
    ((64, 64, 64, 64), "llama2-70b", 512, 4096),
    ((256, 256, 256, 256), "llama2-70b", 2048, 4096),
    ((192, 256, 384, 192), "llama3-70b", 2048, 4096),  # irregular: 24, 32, 48, 24 machines
]


def cluster_text(per_type: tuple[int, ...]) -> str:
    lines = ["nodes:"]
    for (name, gpu, size, network, extra), gpus in zip(GROUPS, per_type, strict=True):
        if gpus:
            node_size = min(size, gpus)
            lines.append(f"  - {{name: {name}, gpu: {gpu}, gpus_per_node: {node_size}, "
                         f"count: {gpus // node_size}, inter_bandwidth: {network}{extra}}}")
    return "\n".join(lines)


def main() -> None:
    print("| GPUs | types | model | search time | CPU time | candidates | best layout | "
          "predicted MFU |")
    print("|---:|---:|---|---:|---:|---:|---|---:|")
    for per_type, model, batch, seq in CASES:
        types = sum(1 for n in per_type if n)
        spec = parse_cluster(cluster_text(per_type))
        started, cpu_started = time.perf_counter(), time.process_time()
        result = search(spec, load_model(model), TrainingShape(batch, seq))
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
        best = result.best
        print(f"| {spec.num_gpus} | {types} | {model} | {elapsed:.2f} s | {cpu:.2f} s | "
              f"{result.candidates} | "
              f"{best.layout()} ({best.num_gpus} used) | {best.prediction.mfu:.1%} |")


if __name__ == "__main__":
    main()
