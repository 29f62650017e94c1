"""Overhead of a one-rank potluck run against a plain PyTorch loop (target: under 10%).

Same model (a LLaMA-style model built from a config, deterministic init), same
data, same AdamW and clipping; one process, CPU (or the first GPU if there is
one). Steps of the two alternate, so background load affects both alike;
prints the median step time of each after warm-up and the overhead.

    python benchmarks/runtime_overhead.py [--hidden 256] [--layers 4] [--steps 20]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch
import torch.nn.functional as F

from potluck.cluster.spec import parse_cluster
from potluck.model.spec import PRESETS
from potluck.plans import DType, Pipeline, Plan, Stage, TrainingShape
from potluck.runtime import Trainer, build_model, materialize, parallelize, start
from potluck.runtime.loop.batches import RandomTokens

WARMUP = 3


def plain_step(spec, device: torch.device):
    """One step of a plain PyTorch loop, as a closure over its model and optimizer."""
    model = build_model(spec)
    materialize([model], device, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), foreach=False)

    def step(rows: torch.Tensor) -> float:
        rows = rows.to(device)
        logits = model(rows[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), rows[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    return step


def potluck_step(spec, data, device_type: str):
    """One step of potluck's trainer on a one-device plan, as a closure; and its session."""
    cluster = parse_cluster(f"nodes:\n  - {{name: one, gpu: {device_type}, gpus_per_node: 1}}\n")
    shape = TrainingShape(data.global_batch_size, data.seq_len, DType.FP32)
    stage = Stage(("one.0:0",), ((0, spec.num_layers),))
    plan = Plan(cluster, spec, shape, (Pipeline((stage,), data.global_batch_size, 1),))
    session = start(plan)
    trainer = Trainer(parallelize(build_model(spec), session), lr=3e-4)
    return (lambda rows: trainer.step(rows).loss), session


def median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def timed(step, rows: torch.Tensor) -> float:
    start_s = time.perf_counter()
    step(rows)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start_s


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    spec = replace(PRESETS["tiny-llama"], hidden_size=args.hidden, num_layers=args.layers,
                   ffn_hidden_size=4 * args.hidden, num_heads=8, num_kv_heads=8)
    data = RandomTokens(spec.vocab_size, args.seq_len, args.batch)
    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    plain = plain_step(spec, device)
    ours, session = potluck_step(spec, data, "a100-80g-sxm" if gpu else "cpu")
    plain_times, our_times = [], []
    try:
        for step in range(args.steps):  # alternate, so background load hits both alike
            rows = data.global_batch(step)
            plain_times.append(timed(plain, rows))
            our_times.append(timed(ours, rows))
    finally:
        session.close()
    plain_s, ours_s = median(plain_times[WARMUP:]), median(our_times[WARMUP:])
    print(f"model: hidden {args.hidden}, {args.layers} layers, batch {args.batch}x{args.seq_len}, "
          f"{device}")
    print(f"plain PyTorch loop: {plain_s * 1e3:.1f} ms/step")
    print(f"potluck, one rank:  {ours_s * 1e3:.1f} ms/step")
    print(f"overhead: {100 * (ours_s / plain_s - 1):+.1f}% (target < 10%)")


if __name__ == "__main__":
    main()
