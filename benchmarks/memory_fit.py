"""Fitting big models on 12-24 GB cards: plans, and swapping against full recomputation.

    python benchmarks/memory_fit.py [--steps 3] [--global-batch 8] [--no-emulate]

1. Plans for llama2-13b on one machine of 4 RTX 3090 (NVLink pairs, 256 GB host
   memory) and llama2-7b on two machines of 4 RTX 3060 12 GB joined by 10 Gb/s:
   layout, per-stage memory choices, peak device memory, host memory, predicted
   throughput.
2. llama2-7b (sequence 4096, batch 8) pinned to one pipeline of four RTX 3090 with the
   optimizer offloaded, where every stage fits only with recomputation or swapping:
   full recomputation, recomputation chosen per stage, potluck's choice (swapping
   where it pays), host swap on every stage, and plain host offload (the same swap
   with copies on the compute stream, as ``torch.autograd.graph.save_on_cpu``).
   Predicted tokens/s and, unless ``--no-emulate``, the step time measured on four
   CPU ranks of this machine emulating the GPUs (each op stretched to its device's
   predicted time, one dilation shared by every run), as gains over full
   recomputation.
3. ``docs/img/memory_per_stage.png``: predicted device memory per stage of those plans
   and of the same pipeline keeping everything (which does not fit): the 1F1B imbalance,
   and swapping flattening it.

Prints Markdown tables.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from potluck import api
from potluck.cluster.spec import parse_cluster
from potluck.model.counts import Recompute
from potluck.plans import Plan
from potluck.runtime.options import TrainOptions
from potluck.runtime.training import train

GB = 1e9
BOX3090 = "nodes: [{name: box3090, gpu: rtx3090, gpus_per_node: 4, nvlink: pairs, host_memory: 256GB}]\n"
TWO3060 = ("nodes: [{name: box3060, gpu: rtx3060, gpus_per_node: 4, count: 2, "
           "inter_bandwidth: 10Gb/s}]\n")
FIGURE = Path(__file__).resolve().parents[1] / "docs" / "img" / "memory_per_stage.png"
PINNED = {"tp": 1, "pp": 4, "dp": 1, "micro_batch_size": 1, "zero": 0, "offload": "optimizer"}
SETTINGS = {  # name: (flags, execution traits)
    "full recomputation": ({"recompute": "full", "swap": "none"}, {}),
    "recomputation per stage": ({"swap": "none"}, {}),
    "potluck's choice": ({}, {}),
    "host swap, every stage": ({"recompute": "none", "swap": "host"}, {}),
    "plain host offload": ({"recompute": "none", "swap": "host"}, {"overlap_swap": False}),
}


def stage_choices(plan: Plan) -> str:
    return "; ".join(plan.stage_memory(k, j).describe(plan.recompute)
                     for k, pipeline in enumerate(plan.pipelines) for j in range(pipeline.pp))


def plans_table() -> None:
    cases = [("4x RTX 3090, NVLink pairs, 256 GB host", BOX3090, "llama2-13b", 4096),
             ("2x (4x RTX 3060 12 GB), 10 Gb/s", TWO3060, "llama2-7b", 2048)]
    print("| cluster | model, seq | layout | stages | peak GB / GPU GB | host GB per machine "
          "| tokens/s |")
    print("|---|---|---|---|---:|---|---:|")
    for name, text, model, seq_len in cases:
        cluster = parse_cluster(text, "bench.yaml")
        plan = api.plan(cluster, model, global_batch=64, seq_len=seq_len).best
        p = plan.prediction
        capacity = plan.cluster.device_types[0].memory_bytes
        host = ", ".join(f"{h.used_bytes / GB:.0f} of {h.capacity_bytes / GB:.0f}"
                         for h in p.host_memory)
        print(f"| {name} | {model}, {seq_len} | {plan.layout()} µb "
              f"{plan.pipelines[0].micro_batch_size} | {stage_choices(plan)} | "
              f"{p.peak_memory_bytes / GB:.1f} / {capacity / GB:.0f} | {host} | "
              f"{p.tokens_per_s:,.0f} |")


def swap_plans(global_batch: int) -> dict[str, Plan]:
    cluster = parse_cluster(BOX3090, "box3090.yaml")
    plans = {}
    for name, (flags, traits) in SETTINGS.items():
        execution = replace(api.as_execution(None, cluster), **traits)
        plans[name] = api.plan(cluster, "llama2-7b", global_batch=global_batch, seq_len=4096,
                               execution=execution, **PINNED, **flags).best
    return plans


def emulated_step_s(plan: Plan, steps: int, dilation: float | None) -> tuple[float, float]:
    """Median emulated step time (the first step warms up) and the dilation used."""
    options = TrainOptions(steps=steps, emulate=True, stand_in="tiny", dilation=dilation,
                           progress=False)
    history = train(plan, options)
    timed = history[1:] or history
    measured = sorted(m.step_time_s for m in timed)[len(timed) // 2]
    return measured, history[-1].predicted_step_time_s / plan.prediction.iteration_time_s


def gains_table(plans: dict[str, Plan], steps: int, emulate: bool) -> None:
    base = plans["full recomputation"]
    print("| setting | stages | tokens/s | predicted gain | emulated gain |")
    print("|---|---|---:|---:|---:|")
    dilation, base_measured = None, None
    for name, plan in plans.items():
        predicted_gain = base.prediction.iteration_time_s / plan.prediction.iteration_time_s
        measured = "-"
        if emulate and name != "plain host offload":  # the runtime swaps overlapped only
            step_s, dilation = emulated_step_s(plan, steps, dilation)
            base_measured = base_measured or step_s
            measured = f"{base_measured / step_s:.2f}x"
        print(f"| {name} | {stage_choices(plan)} | {plan.prediction.tokens_per_s:,.0f} | "
              f"{predicted_gain:.2f}x | {measured} |")


def keep_everything(plan: Plan) -> Plan:
    """``plan`` with no stage recomputing or swapping, re-predicted (it need not fit)."""
    from potluck.planner.evaluate import predict
    from potluck.plans.memory import Offload, StageMemory

    kept = StageMemory(Recompute.NONE, offload=Offload.OPTIMIZER)
    pipelines = tuple(replace(p, stages=tuple(replace(s, memory=kept) for s in p.stages))
                      for p in plan.pipelines)
    bare = replace(plan, pipelines=pipelines, recompute=Recompute.NONE, prediction=None)
    return replace(bare, prediction=predict(bare))


def plot(plans: dict[str, Plan]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plans = {"nothing recomputed or swapped (does not fit)": keep_everything(
        plans["host swap, every stage"]), **plans}
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / len(plans)
    for index, (name, plan) in enumerate(plans.items()):
        memory = plan.prediction.memory
        ax.bar([m.stage + index * width for m in memory], [m.total_bytes / GB for m in memory],
               width, label=name)
    ax.axhline(plan.cluster.device_types[0].memory_bytes / GB, color="black", lw=0.8)
    ax.set_xticks([s + 0.4 - width / 2 for s in range(4)], [f"stage {s}" for s in range(4)])
    ax.set_ylabel("predicted device memory (GB)")
    ax.set_title("llama2-7b, seq 4096, 1F1B over 4x RTX 3090 (line: 24 GB)")
    ax.legend(fontsize=6, loc="upper right")
    fig.tight_layout()
    fig.savefig(FIGURE, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--global-batch", type=int, default=8,
                        help="sequences per step of the swap comparison (emulated steps last "
                             "about global batch x 1.4 s each)")
    parser.add_argument("--no-emulate", action="store_true")
    args = parser.parse_args()
    plans_table()
    print()
    plans = swap_plans(args.global_batch)
    gains_table(plans, args.steps, not args.no_emulate)
    plot(plans)
    print(f"\nwrote {FIGURE}")


if __name__ == "__main__":
    main()
