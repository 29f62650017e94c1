"""``potluck demo``: plan a mixed cluster, then dry-run the plan here and compare.

Needs no downloads and no GPU. Two parts:

1. plan llama2-7b for the built-in mixed lab (``examples/mixed.yaml``: 3090 pairs,
   4090s, A100s on 10 Gb/s) and compare with the Megatron-style even split;
2. plan llama2-7b for 2x A100 + 2x RTX 3090 (``examples/two-fast-two-slow.yaml``)
   and train that plan for a few dozen steps on four CPU processes of this machine
   (``--emulate``): the ranks compute a tiny stand-in with the same number of blocks
   on the corpus that ships with potluck, each op stretched to its device's predicted
   time, so the measured step time can be compared with the prediction.
"""

from __future__ import annotations

from dataclasses import dataclass

from potluck import api
from potluck.errors import InfeasibleError
from potluck.examples import example_path
from potluck.plans import Plan

DEMO_MODEL = "llama2-7b"
LAB_SHAPE = {"global_batch": 64, "seq_len": 4096}
RUN_SHAPE = {"global_batch": 8, "seq_len": 256}
RUN_STEPS = 24


@dataclass(frozen=True)
class PlanComparison:
    """potluck's plan and the even split for one cluster (None: the even split does not fit)."""

    balanced: Plan
    uniform: Plan | None

    @property
    def speedup(self) -> float | None:
        if self.uniform is None:
            return None
        return self.uniform.prediction.iteration_time_s / self.balanced.prediction.iteration_time_s


def compare_with_even_split(cluster: str, model: str, shape: dict[str, int]) -> PlanComparison:
    path = example_path(cluster)
    balanced = api.plan(path, model, **shape).best
    try:
        uniform = api.plan(path, model, partition="uniform", **shape).best
    except InfeasibleError:
        uniform = None
    return PlanComparison(balanced, uniform)


def plan_lab() -> PlanComparison:
    return compare_with_even_split("mixed.yaml", DEMO_MODEL, LAB_SHAPE)


def plan_dry_run() -> PlanComparison:
    return compare_with_even_split("two-fast-two-slow.yaml", DEMO_MODEL, RUN_SHAPE)


def dry_run(plan: Plan, steps: int = RUN_STEPS) -> api.TrainResult:
    """Train ``plan`` emulated on this machine's CPU with the tiny stand-in model."""
    return api.run_plan(plan, api.train_options(steps=steps, emulate=True, stand_in="tiny"))
