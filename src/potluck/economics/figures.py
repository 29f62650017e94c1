"""The dollar figures of one plan: price per hour, per million tokens, to train N tokens.

Two measures of cost-effectiveness sit side by side:

- RCC, raw compute per dollar (the seed talk's measure): the peak dense
  16-bit TFLOPS of the GPUs over what they cost per hour;
- what training delivers per dollar: tokens per dollar, and the model TFLOPS
  the plan actually achieves over the same price. Communication, pipeline
  bubbles and memory limits all lower it; RCC sees none of them.

``usd_per_million_tokens = usd_per_hour / (tokens_per_s * 3600 / 1e6)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from potluck.cluster.topology import Cluster
from potluck.economics.prices import Pricing, plan_usd_per_hour
from potluck.planner.gemm import peak_flops
from potluck.plans import Plan

SECONDS_PER_HOUR = 3600.0
T = TypeVar("T")


@dataclass(frozen=True)
class CostFigures:
    """Dollars and speed of one plan."""

    usd_per_hour: float
    tokens_per_s: float
    peak_tflops: float  # sum of the used GPUs' dense peak TFLOPS in the dtype each trains in
    achieved_tflops: float  # model FLOPs per second the plan reaches, all GPUs together
    gpus: int
    tokens: int  # the training run the time and total refer to

    @property
    def tokens_per_hour(self) -> float:
        return self.tokens_per_s * SECONDS_PER_HOUR

    @property
    def usd_per_million_tokens(self) -> float:
        return self.usd_per_hour / (self.tokens_per_hour / 1e6)

    @property
    def tokens_per_usd(self) -> float:
        return _per_usd(self.tokens_per_hour, self.usd_per_hour)

    @property
    def hours_to_train(self) -> float:
        return self.tokens / self.tokens_per_hour

    @property
    def total_usd(self) -> float:
        return self.usd_per_hour * self.hours_to_train

    @property
    def tflops_per_usd(self) -> float:
        """RCC: peak TFLOPS per dollar-per-hour."""
        return _per_usd(self.peak_tflops, self.usd_per_hour)

    @property
    def achieved_tflops_per_usd(self) -> float:
        """Model TFLOPS the plan reaches per dollar-per-hour."""
        return _per_usd(self.achieved_tflops, self.usd_per_hour)

    def meets(self, deadline_hours: float | None) -> bool:
        return deadline_hours is None or self.hours_to_train <= deadline_hours


def _per_usd(amount: float, usd_per_hour: float) -> float:
    """``amount`` per dollar-per-hour; free GPUs (price 0 in a cluster file) give infinity."""
    return amount / usd_per_hour if usd_per_hour > 0 else float("inf")


def plan_figures(plan: Plan, pricing: Pricing, tokens: int) -> CostFigures:
    """The cost figures of a plan that has a prediction."""
    prediction = plan.prediction
    if prediction is None:
        raise ValueError("plan_figures needs a plan with a prediction (from the search)")
    cluster = Cluster(plan.cluster)
    dtype = plan.training.dtype
    peak_tflops = sum(peak_flops(cluster.device(d).type, dtype) for d in plan.devices) / 1e12
    return CostFigures(
        usd_per_hour=plan_usd_per_hour(plan, pricing),
        tokens_per_s=prediction.tokens_per_s,
        peak_tflops=peak_tflops,
        achieved_tflops=prediction.tflops_per_gpu * plan.num_gpus,
        gpus=plan.num_gpus,
        tokens=tokens,
    )


def cheapest(options: list[tuple[T, CostFigures]], deadline_hours: float | None = None
             ) -> tuple[T, CostFigures] | None:
    """The option with the lowest USD per token that meets the deadline (faster wins ties)."""
    eligible = [o for o in options if o[1].meets(deadline_hours)]
    if not eligible:
        return None
    return min(eligible, key=lambda o: (o[1].usd_per_million_tokens, o[1].hours_to_train))
