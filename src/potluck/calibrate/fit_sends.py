"""Fitting the pipeline's links of an emulated run from its padded forward and backward.

The emulator pads a rank's forward to its stage's forward plus the send to the
next stage, and its backward to the stage's backward plus the send to the
previous one (:func:`potluck.runtime.timing.emulate.stage_targets`). Once the device
types' compute is fitted, what is left of each device's forward and of its
backward is its sends: ``m x s_c x S_c`` for the link class ``c`` the send
crosses, where ``S_c`` is the send at the link's current figures and ``s_c``
the factor its transfers are off by (bandwidth divided by it, latency
multiplied, as :func:`~potluck.calibrate.fit_links.scaled_links` applies it).
Every forward and every backward is one linear equation in the ``s_c``; least
squares solves them. The first stage's backward and the last stage's forward
send nothing, so they tell compute from transfers; fitting devices and sends
in turn (:func:`potluck.calibrate.fit.fit_run`) converges on both.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from potluck.calibrate.fit_links import LinkFit, LinkKey, current_links, link_key, scaled_links
from potluck.calibrate.measure import BACKWARD_KINDS, op_s
from potluck.ops import OpKind
from potluck.planner.cost import CostModel
from potluck.planner.evaluate import stage_op_times, stage_send_s
from potluck.plans import Plan
from potluck.traces import Trace

SCALE_RANGE = (1e-3, 1e4)
SOURCE = "pipeline sends padded into the emulated forward and backward"
MIN_SHARE = 0.02  # a link class whose sends are under 2% of the ops they pad is kept as is


def fit_sends(plan: Plan, measured: Trace) -> tuple[LinkFit, ...]:
    """One factor per pipeline link class of ``plan`` (at its current figures) that makes
    the emulated forwards and backwards what was measured."""
    rows = _equations(plan, measured)
    keys = sorted({key for terms, _, _ in rows for key in terms}, key=LinkKey.describe)
    keys = [key for key in keys if _share(rows, key) >= MIN_SHARE]
    if not keys:
        return ()
    matrix = np.array([[terms.get(key, 0.0) for key in keys] for terms, _, _ in rows])
    target = np.array([rest for _, rest, _ in rows])
    scales, *_ = np.linalg.lstsq(matrix, target, rcond=None)
    links = current_links(plan.cluster, keys)
    low, high = SCALE_RANGE
    return tuple(fit for key, scale in zip(keys, scales, strict=True) if key in links
                 for fit in scaled_links({key: links[key]}, float(np.clip(scale, low, high)), SOURCE))


Terms = dict[LinkKey, float]


def _equations(plan: Plan, measured: Trace) -> list[tuple[Terms, float, float]]:
    """Per device and direction: the sends' seconds per link class at current figures, the
    measured seconds less the predicted compute, and the measured seconds."""
    cost = CostModel.for_plan(plan)
    cluster = cost.cluster
    forward, backward = op_s(measured, (OpKind.FORWARD,)), op_s(measured, BACKWARD_KINDS)
    times = stage_op_times(plan)
    rows = []
    for k, pipeline in enumerate(plan.pipelines):
        m = pipeline.num_micro_batches
        for i, stage in enumerate(pipeline.stages):
            for device in stage.devices:
                for seen, compute_s, peer in ((forward, times[k][i].forward_s, i + 1),
                                              (backward, times[k][i].backward_s, i - 1)):
                    if device not in seen:
                        continue
                    terms: Terms = defaultdict(float)
                    if 0 <= peer < pipeline.pp:
                        a = cluster.device(stage.devices[0])
                        b = cluster.device(pipeline.stages[peer].devices[0])
                        terms[link_key(cluster, a, b)] += m * stage_send_s(plan, k, i, peer, cost)
                    rows.append((dict(terms), seen[device] - m * compute_s, seen[device]))
    return rows


def _share(rows: list[tuple[Terms, float, float]], key: LinkKey) -> float:
    """The part of the measured ops that ``key``'s sends would take at current figures."""
    sends = sum(terms.get(key, 0.0) for terms, _, _ in rows)
    measured = sum(seconds for terms, _, seconds in rows if key in terms)
    return sends / measured if measured > 0 else 0.0
