"""Gain of potluck's balanced plans over the Megatron-style even split (--partition uniform).

The uniform baseline searches the same layouts with one TP degree for all stages, an
even split of layers over stages and of the batch over replicas; it also gets the ZeRO
stage potluck's plan chose (the faster of that and its own search's), so that the gain
is the partition's, not sharding's.

Usage: python benchmarks/partition_gain.py
"""

from __future__ import annotations

from potluck.cluster import parse_cluster
from potluck.model import load_model
from potluck.planner.options import Partition, SearchOptions
from potluck.planner.search import search
from potluck.plans import TrainingShape

CASES = [  # (name, cluster, model, batch, seq)
    ("4 A100 SXM + 4 RTX 4090, 100 Gb/s (1.6x per-GPU speed)", """
nodes:
  - {name: a100, gpu: a100-80g-sxm, gpus_per_node: 4, inter_bandwidth: 100Gb/s}
  - {name: r4090, gpu: rtx4090, gpus_per_node: 4, inter_bandwidth: 100Gb/s}
""", "llama2-7b", 64, 4096),
    ("4 RTX 4090 + 4 RTX 3090 (pairs), 10 Gb/s (2.3x)", """
nodes:
  - {name: r4090, gpu: rtx4090, gpus_per_node: 4, inter_bandwidth: 10Gb/s}
  - {name: r3090, gpu: rtx3090, gpus_per_node: 4, nvlink: pairs, inter_bandwidth: 10Gb/s}
""", "gpt3-2.7b", 64, 2048),
    ("2 A100 SXM + 4 RTX 3090 (pairs), 10 Gb/s (3.8x)", """
nodes:
  - {name: a100, gpu: a100-80g-sxm, gpus_per_node: 2, inter_bandwidth: 10Gb/s}
  - {name: r3090, gpu: rtx3090, gpus_per_node: 4, nvlink: pairs, inter_bandwidth: 10Gb/s}
""", "gpt3-1.3b", 64, 2048),
    ("demo cluster: 8 RTX 3090 + 4 RTX 4090 + 2 A100, 10 Gb/s", "demo", "llama2-7b", 64, 4096),
    ("8 H100 SXM + 8 A100 SXM, 400 Gb/s (3.2x)", """
nodes:
  - {name: h100, gpu: h100-sxm, gpus_per_node: 8, inter_bandwidth: 400Gb/s}
  - {name: a100, gpu: a100-80g-sxm, gpus_per_node: 8, inter_bandwidth: 400Gb/s}
""", "llama2-13b", 128, 4096),
    ("identical: 8 A100 SXM", "nodes: [{name: a100, gpu: a100-80g-sxm, gpus_per_node: 8}]",
     "llama2-7b", 64, 4096),
    ("identical: 2x4 RTX 4090, 25 Gb/s",
     "nodes: [{name: b, gpu: rtx4090, gpus_per_node: 4, count: 2, inter_bandwidth: 25Gb/s}]",
     "gpt3-1.3b", 64, 2048),
]


def main() -> None:
    from potluck.cluster import load_cluster
    from potluck.examples import example_path

    print("| cluster | model | potluck | uniform | gain |")
    print("|---|---|---:|---:|---:|")
    for name, text, model_name, batch, seq in CASES:
        spec = load_cluster(example_path("mixed.yaml")) if text == "demo" else parse_cluster(text)
        model, shape = load_model(model_name), TrainingShape(batch, seq)
        balanced = search(spec, model, shape).best
        uniform = min((search(spec, model, shape, SearchOptions(partition=Partition.UNIFORM, zero=z)).best
                       for z in (None, balanced.zero)),
                      key=lambda plan: plan.prediction.iteration_time_s)
        b, u = balanced.prediction.iteration_time_s, uniform.prediction.iteration_time_s
        print(f"| {name} | {model_name} | {b:.2f} s {balanced.layout()} | "
              f"{u:.2f} s {uniform.layout()} | {u / b:.2f}x |")


if __name__ == "__main__":
    main()
