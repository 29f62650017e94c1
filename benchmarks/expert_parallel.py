"""What expert parallelism buys mixture-of-experts models, as potluck predicts it.

For each case the search plans with expert parallelism off (``--ep 1``, the best of the
search pinned to ZeRO 0, 1 and 2, since the search stops at the first memory level that
fits) and with the degree left to it; the table shows both best plans, the share of the iteration spent
in the token all-to-alls (``EP``) and the peak device memory. Predictions only: the
all-to-all price (pairwise exchange over the busiest link or network card, uniform
routing) has not been checked against a measured run.

Usage: python benchmarks/expert_parallel.py
"""

from __future__ import annotations

from potluck.cluster import load_cluster, parse_cluster
from potluck.examples import example_path
from potluck.model import load_model
from potluck.planner.options import SearchOptions
from potluck.planner.search import search
from potluck.plans import Plan, TrainingShape

CASES = [  # (name, cluster, model, batch, seq)
    ("demo: 8 RTX 3090 + 4 RTX 4090 + 2 A100, 10 Gb/s", "demo", "qwen3-30b-a3b", 64, 2048),
    ("demo: 8 RTX 3090 + 4 RTX 4090 + 2 A100, 10 Gb/s", "demo", "mixtral-8x7b", 64, 2048),
    ("2x8 A100 SXM, 100 Gb/s", """
nodes:
  - {name: a100, gpu: a100-80g-sxm, gpus_per_node: 8, count: 2, inter_bandwidth: 100Gb/s}
""", "qwen3-30b-a3b", 128, 4096),
    ("2x8 A100 SXM, 100 Gb/s", """
nodes:
  - {name: a100, gpu: a100-80g-sxm, gpus_per_node: 8, count: 2, inter_bandwidth: 100Gb/s}
""", "mixtral-8x7b", 128, 4096),
    ("4x4 RTX 4090, 25 Gb/s", """
nodes:
  - {name: r4090, gpu: rtx4090, gpus_per_node: 4, count: 4, inter_bandwidth: 25Gb/s}
""", "qwen3-30b-a3b", 64, 2048),
]


def _cell(plan: Plan) -> str:
    p = plan.prediction
    share = p.breakdown.ep_s / p.iteration_time_s
    return (f"{p.iteration_time_s:.2f} s {plan.layout()}, zero {plan.zero}, EP {share:.0%}, "
            f"{p.peak_memory_bytes / 1e9:.0f} GB")


def main() -> None:
    print("| cluster | model | without EP | search's choice | gain |")
    print("|---|---|---|---|---:|")
    for name, text, model_name, batch, seq in CASES:
        spec = load_cluster(example_path("mixed.yaml")) if text == "demo" else parse_cluster(text)
        model, shape = load_model(model_name), TrainingShape(batch, seq)
        plain = min((search(spec, model, shape, SearchOptions(ep=1, zero=zero)).best
                     for zero in (0, 1, 2)), key=lambda p: p.prediction.iteration_time_s)
        chosen = search(spec, model, shape).best
        gain = plain.prediction.iteration_time_s / chosen.prediction.iteration_time_s
        print(f"| {name} | {model_name} | {_cell(plain)} | {_cell(chosen)} | {gain:.2f}x |",
              flush=True)


if __name__ == "__main__":
    main()
