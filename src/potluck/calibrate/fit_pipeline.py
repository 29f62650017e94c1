"""Fitting the pipeline's link latency to the measured step time.

A pipelined step waits on its stage-to-stage transfers: torch's 1F1B blocks
on every batch of sends and receives, and the cost model charges each stage
its transfers per micro-batch. In the trace a receive's wait also holds the
sender's lateness and the pipeline bubble, so the transfers cannot be read
off one by one; the step can. With compute, optimizer and all-reduce
bandwidth fitted, the input left that moves the cost model's step time is
the per-message latency of the pipeline's link class (the one whose transfers
take longest): it is set by bisection so that the cost model's step time is
the measured one, the all-reduce bandwidth of that class refitted for each
trial latency. On a CPU with more ranks than cores this latency is mostly
the time a rank waiting for a message takes to be scheduled again.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace

from potluck.calibrate.fit_links import LinkFit, LinkKey, current_link, fit_links, link_key
from potluck.cluster.spec import ClusterSpec
from potluck.planner.cost import CostModel
from potluck.plans import Plan
from potluck.sim.trace import Trace

MAX_LATENCY_S = 1.0
BISECTION_STEPS = 40


def pipeline_link(plan: Plan) -> LinkKey | None:
    """The link class whose stage-to-stage transfers take the longest in ``plan``."""
    cost = CostModel.for_plan(plan)
    cluster = cost.cluster
    seconds: dict[LinkKey, float] = defaultdict(float)
    for pipeline in plan.pipelines:
        for sender, receiver in zip(pipeline.stages, pipeline.stages[1:], strict=False):
            a, b = cluster.device(sender.devices[0]), cluster.device(receiver.devices[0])
            seconds[link_key(cluster, a, b)] += cost.send_s((a,), (b,), pipeline.micro_batch_size)
    return max(seconds, key=seconds.__getitem__) if seconds else None


def with_latency(plan: Plan, measured: Trace, key: LinkKey, latency_s: float
                 ) -> tuple[LinkFit, ...]:
    """The all-reduce fit with ``key``'s latency fixed at ``latency_s``."""
    links = fit_links(plan, measured, {key: latency_s})
    others = tuple(link for link in links if link.key != key)
    fitted = next((link for link in links if link.key == key), None)
    if fitted is None:
        link = current_link(plan.cluster, key)
        fitted = LinkFit(key, link.bandwidth_bytes_per_s if link else 0.0, latency_s, 0)
    return (*others, replace(fitted, latency_s=latency_s))


def fit_pipeline(plan: Plan, measured: Trace, step_s: float,
                 apply: Callable[[tuple[LinkFit, ...]], ClusterSpec]
                 ) -> tuple[tuple[LinkFit, ...], str]:
    """Links with the pipeline's latency fitted to ``step_s`` (``apply(links)`` gives the
    cluster spec they make); with a note when the step cannot be matched."""
    key = pipeline_link(plan)
    if key is None:
        return fit_links(plan, measured), ""

    def step_at(latency_s: float) -> float:
        spec = apply(with_latency(plan, measured, key, latency_s))
        calibrated = replace(plan, cluster=spec)
        return CostModel.for_plan(calibrated).evaluate(calibrated).iteration_time_s

    low, high = 0.0, MAX_LATENCY_S
    if step_at(low) >= step_s:
        return with_latency(plan, measured, key, low), (
            f"{key.describe()}: the step is no slower than predicted without any latency; "
            "latency set to 0")
    if step_at(high) <= step_s:
        return with_latency(plan, measured, key, high), (
            f"{key.describe()}: latency capped at {MAX_LATENCY_S:g} s")
    for _ in range(BISECTION_STEPS):
        middle = 0.5 * (low + high)
        low, high = (middle, high) if step_at(middle) < step_s else (low, middle)
    return with_latency(plan, measured, key, 0.5 * (low + high)), ""

