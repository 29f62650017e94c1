"""A balanced plan against the even split, on an emulated 2 fast + 2 slow GPU cluster.

Plans ``--model`` for 2x A100-80GB + 2x RTX 3090 twice (the planner's plan and
``--partition uniform``), then runs both with ``--emulate`` on CPU ranks of
this machine: the tiny stand-in model computes, each op is stretched to the
plan's device speed times one dilation shared by both runs. Prints measured
against predicted step time for each (target: within 15%) and the measured
speedup of the planner's plan (target: at least 1.3x).

    python benchmarks/emulated_balance.py [--model gpt3-1.3b] [--steps 6]
"""

from __future__ import annotations

import argparse

from potluck import api
from potluck.cluster.spec import parse_cluster
from potluck.runtime.options import TrainOptions
from potluck.runtime.training import train

CLUSTER = ("nodes:\n"
           "  - {name: fast, gpu: a100-80g-sxm, gpus_per_node: 2}\n"
           "  - {name: slow, gpu: rtx3090, gpus_per_node: 2}\n")


def run(plan, steps: int, dilation: float | None) -> tuple[float, float, float]:
    """Median measured step time, dilated predicted step time, and the dilation."""
    options = TrainOptions(steps=steps, emulate=True, stand_in="tiny", dilation=dilation,
                           progress=False)
    history = train(plan, options)
    history = history[1:] or history  # the first timed step warms up
    measured = sorted(m.step_time_s for m in history)[len(history) // 2]
    predicted = history[-1].predicted_step_time_s
    return measured, predicted, predicted / plan.prediction.iteration_time_s


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gpt3-1.3b")
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    cluster = parse_cluster(CLUSTER, "2xa100+2x3090.yaml")
    shape = {"global_batch": args.global_batch, "seq_len": args.seq_len}
    plans = {
        "planner": api.plan(cluster, args.model, **shape).best,
        "uniform": api.plan(cluster, args.model, partition="uniform", **shape).best,
    }
    # Calibrate each, then run both with the larger dilation so their times compare.
    dilation = max(run(plan, 4, None)[2] for plan in plans.values())
    print(f"{args.model} on 2x A100-80GB + 2x RTX 3090, dilation {dilation:.2f}")
    measured = {}
    for name, plan in plans.items():
        step_s, predicted_s, _ = run(plan, args.steps, dilation)
        measured[name] = step_s
        print(f"  {name:8s} {plan.layout():24s} measured {step_s:6.2f} s, predicted "
              f"{predicted_s:6.2f} s, measured/predicted {step_s / predicted_s:.2f}")
    predicted_speedup = (plans["uniform"].prediction.iteration_time_s
                         / plans["planner"].prediction.iteration_time_s)
    print(f"  speedup of the planner's plan: measured {measured['uniform'] / measured['planner']:.2f}x,"
          f" predicted {predicted_speedup:.2f}x (target >= 1.3x)")


if __name__ == "__main__":
    main()
