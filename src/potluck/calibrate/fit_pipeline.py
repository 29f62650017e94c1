"""Fitting the pipeline's link to the measured step time, where nothing else tells it.

A pipelined step waits on its stage-to-stage transfers: torch's 1F1B blocks
on every batch of sends and receives, and the cost model charges each stage
its transfers per micro-batch. In the trace a receive's wait also holds the
sender's lateness and the pipeline bubble, so the transfers cannot be read
off one by one; the step can. Where gradient all-reduces cross the pipeline's
slowest link class they tell its figures (:mod:`potluck.calibrate.fit_links`)
and the step is left alone (a residual there is as much the wait for the
slowest replica as it is transfers). Otherwise, with compute and optimizer
fitted, the transfers are what is left: their time is scaled by the one
factor ``s`` (bandwidth divided by it, latency multiplied) for which the cost
model's step time is the measured one, found by bisection. One message size
cannot tell latency from bandwidth, so the scale keeps the ratio the figures
had.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace

from potluck.calibrate.fit_links import LinkFit, LinkKey, current_links, link_key, scaled_links
from potluck.calibrate.solve import log_bisect
from potluck.cluster.spec import ClusterSpec
from potluck.planner.cost import CostModel
from potluck.planner.evaluate import predict
from potluck.plans import Plan

SCALE_RANGE = (1e-3, 1e4)
FROM_STEP = "pipeline transfers, from the step time"


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


def fit_pipeline(plan: Plan, links: tuple[LinkFit, ...], step_s: float,
                 apply: Callable[[tuple[LinkFit, ...]], ClusterSpec]
                 ) -> tuple[tuple[LinkFit, ...], str]:
    """``links`` (fitted to the all-reduces) and the pipeline's link scaled to match
    ``step_s`` (``apply(links)`` gives the cluster they make); a note when it cannot."""
    key = pipeline_link(plan)
    if key is None or any(link.key == key for link in links):
        return links, ""

    current = current_links(plan.cluster, [key])

    def step_at(scale: float) -> float:
        trial = (*links, *scaled_links(current, scale, FROM_STEP))
        calibrated = replace(plan, cluster=apply(trial))
        return predict(calibrated).iteration_time_s

    low, high = SCALE_RANGE
    if step_at(low) >= step_s:
        return links, (f"{key.describe()}: the step is faster than predicted with nearly free "
                       "transfers; its figures are kept")
    if step_at(high) <= step_s:
        return (*links, *scaled_links(current, high, FROM_STEP)), (
            f"{key.describe()}: transfer time capped")
    scale = log_bisect(step_at, step_s, low, high)
    return (*links, *scaled_links(current, scale, FROM_STEP)), ""
