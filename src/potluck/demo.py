"""``potluck demo``: plan a mixed cluster, then dry-run the plan here and compare.

Needs no downloads and no GPU. Two parts:

1. plan llama2-7b for the built-in mixed lab (``examples/mixed.yaml``: 3090 pairs,
   4090s, A100s on 10 Gb/s) and compare with the Megatron-style even split;
2. plan llama2-7b for 2x A100 + 2x RTX 3090 (``examples/two-fast-two-slow.yaml``)
   and train that plan for a few steps on CPU processes of this machine, one per device
   of the plan (``--emulate``): the ranks compute a tiny stand-in with the same number
   of blocks on short sequences of the corpus that ships with potluck, each op stretched
   to its device's predicted time, so the measured step time can be compared with the
   prediction.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from potluck import api
from potluck.errors import InfeasibleError
from potluck.examples import example_path
from potluck.plans import Plan

if TYPE_CHECKING:
    from potluck.runtime.options import TrainOptions

DEMO_MODEL = "llama2-7b"
LAB_SHAPE = {"global_batch": 64, "seq_len": 4096}
RUN_SHAPE = {"global_batch": 8, "seq_len": 256}
# The dry run's length. Each emulated step takes the plan's predicted step times the
# dilation, which the slowest op of the stand-in on this CPU sets: the stand-in computes
# short sequences of STAND_IN_SEQ_LEN tokens (its slowest op, and with it every step,
# shrinks with them), and 6 steps are enough for the summary, which averages the second
# half, to compare measured with predicted.
RUN_STEPS = 6
STAND_IN_SEQ_LEN = 32


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


def dry_run(plan: Plan, steps: int = RUN_STEPS, *,
            before_launch: Callable[[Plan, TrainOptions], None] | None = None
            ) -> api.TrainResult:
    """Train ``plan`` emulated on this machine's CPU with the tiny stand-in model
    (``before_launch`` as for :func:`potluck.api.run_plan`)."""
    options = api.train_options(steps=steps, emulate=True, stand_in="tiny",
                                seq_len=STAND_IN_SEQ_LEN)
    return api.run_plan(plan, options, before_launch=before_launch)
