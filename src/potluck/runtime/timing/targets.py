"""What each op of one rank should take on the plan's devices: the emulation's targets.

Every figure comes from the one cost model (:mod:`potluck.planner.cost`,
:mod:`potluck.planner.evaluate`), for the rank's stage on its device:

- **compute ops**, per virtual stage and micro-batch: the forward and the backward
  (TP collectives included). Where torch's schedule blocks on its transfers (no split
  channels) the send to the next stage is padded into the forward and the send back into
  the backward, as the cost model charges them; with split channels the transfers run
  beside the compute on their own channels (:attr:`RankTargets.sends_s`). A stage that
  runs the explicit TP executor has its blocks' parts and all-reduces timed apart
  (:attr:`RankTargets.explicit`), so its ops keep only the rest (embedding, head, host);
- **the gradient reduction** left exposed after the schedule and **the optimizer step**:
  the plan's (its slowest stage's, with ZeRO's parameter all-gather); under the priority
  schedule the rank's own step, and its parameter all-gather per bucket
  (:attr:`RankTargets.gathers_s`, by the bucket's parameter units);
- **the exchange across islands** (diloco, bounded): one whole exchange's time from the
  planner's owner (:func:`potluck.planner.islands.exchange.outer_exchange`: every fragment at
  the compression's width, a ring over the slowest link between islands), each parameter
  unit its share by parameters (:attr:`RankTargets.outer_s`). Every rank times the units it
  sends; ranks that hold different units (pipeline stages, TP shards) send at once, each at
  the link's full speed, where the planner has them share it: with pp or tp above 1 the
  emulated exchange is that much shorter than predicted.

A rank with several virtual stages splits its stage's times by layer count; zero bubble's
input and weight backward get half each.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from potluck.ops import OpKind
from potluck.placement import parameter_units, unit_params
from potluck.planner.cost import CostModel, ExplicitTP
from potluck.plans import Plan, Prediction
from potluck.runtime.layout import Layout


@dataclass(frozen=True)
class OpTargets:
    """Predicted seconds of one micro-batch of one virtual stage on its device."""

    forward_s: float
    backward_s: float


@dataclass(frozen=True)
class RankTargets:
    """Everything one rank's emulation clock pads to."""

    stages: dict[int, OpTargets]
    dp_sync_s: float = 0.0
    optimizer_s: float = 0.0
    explicit: dict[int, ExplicitTP] = field(default_factory=dict)  # by virtual stage
    sends_s: dict[tuple[OpKind, int], float] = field(default_factory=dict)  # split channels
    first_layers: dict[int, int] = field(default_factory=dict)  # of each explicit chunk
    gathers_s: dict[str, float] = field(default_factory=dict)  # priority: per parameter unit
    outer_s: dict[str, float] = field(default_factory=dict)  # islands: per parameter unit


def predict(plan: Plan) -> Prediction:
    """The plan's own prediction, or the cost model's if the plan carries none."""
    if plan.prediction is not None:
        return plan.prediction
    from potluck.planner.evaluate import predict as cost_model_prediction

    return cost_model_prediction(plan)


def rank_targets(plan: Plan, layout: Layout) -> RankTargets:
    """This rank's targets (see the module docstring)."""
    cost = CostModel.for_plan(plan)
    breakdown = predict(plan).breakdown
    explicit = explicit_targets(plan, layout, cost)
    firsts = {stage_id: start for (start, _), stage_id
              in zip(layout.role.layer_ranges, layout.role.virtual_stage_ids, strict=True)}
    targets = RankTargets(stage_targets(plan, layout, cost, explicit), breakdown.dp_s,
                          breakdown.optimizer_s, explicit, first_layers=firsts,
                          outer_s=outer_targets(plan, cost))
    if plan.comm.split_p2p_channels:
        targets = replace(targets, sends_s=send_targets(plan, layout, cost))
    if plan.comm.dp_priority_schedule:
        targets = replace(targets, optimizer_s=own_step_s(plan, layout, cost),
                          gathers_s=gather_targets(plan, layout, cost))
    return targets


def stage_targets(plan: Plan, layout: Layout, cost: CostModel | None = None,
                  explicit: dict[int, ExplicitTP] | None = None) -> dict[int, OpTargets]:
    """This rank's predicted op times, by virtual stage id."""
    from potluck.planner.evaluate import stage_op_times, stage_send_s

    cost = cost or CostModel.for_plan(plan)
    explicit = explicit if explicit is not None else explicit_targets(plan, layout, cost)
    role = layout.role
    times = stage_op_times(plan)[role.pipeline][role.stage]
    forward_s, backward_s = times.forward_s, times.backward_s
    if not plan.comm.split_p2p_channels:  # torch's schedule blocks on its transfers
        if role.stage < role.pp - 1:
            forward_s += stage_send_s(plan, role.pipeline, role.stage, role.stage + 1, cost)
        if role.stage > 0:
            backward_s += stage_send_s(plan, role.pipeline, role.stage, role.stage - 1, cost)
    forward_s -= sum(tp.forward_s() for tp in explicit.values())
    backward_s -= sum(tp.backward_s() for tp in explicit.values())
    layers = sum(end - start for start, end in role.layer_ranges)
    targets = {}
    for (start, end), stage_id in zip(role.layer_ranges, role.virtual_stage_ids, strict=True):
        share = (end - start) / layers
        targets[stage_id] = OpTargets(max(0.0, forward_s * share), max(0.0, backward_s * share))
    return targets


def explicit_targets(plan: Plan, layout: Layout, cost: CostModel) -> dict[int, ExplicitTP]:
    """Per virtual stage of an explicit TP stage, its chunk's pieces (none otherwise)."""
    from potluck.planner.evaluate import stage_devices, stage_shape
    from potluck.plans import explicit_tp

    role = layout.role
    if not explicit_tp(plan, role.pipeline, role.stage):
        return {}
    devices = stage_devices(cost, plan)[role.pipeline][role.stage]
    shape, offset, pieces = stage_shape(plan, role.pipeline, role.stage), 0, {}
    for (start, end), stage_id in zip(role.layer_ranges, role.virtual_stage_ids, strict=True):
        chunk = shape.with_layers(end - start, offset=offset)
        pieces[stage_id] = cost.explicit_tp_times(devices, chunk)
        offset += end - start
    return pieces


def send_targets(plan: Plan, layout: Layout, cost: CostModel) -> dict[tuple[OpKind, int], float]:
    """Split channels: each transfer this rank's virtual stages send or receive, by the
    kind of op that names it and the virtual stage that posts it."""
    from potluck.planner.evaluate import stage_send_s

    role = layout.role
    p, k = role.pp, role.pipeline
    sends = {}
    for stage_id in role.virtual_stage_ids:
        here = stage_id % p
        for kind, other, outgoing in ((OpKind.SEND_FORWARD, stage_id + 1, True),
                                      (OpKind.RECV_FORWARD, stage_id - 1, False),
                                      (OpKind.SEND_BACKWARD, stage_id - 1, True),
                                      (OpKind.RECV_BACKWARD, stage_id + 1, False)):
            if 0 <= other < role.num_virtual_stages and other % p != here:
                sender, receiver = (here, other % p) if outgoing else (other % p, here)
                sends[(kind, stage_id)] = stage_send_s(plan, k, sender, receiver, cost)
    return sends


def own_step_s(plan: Plan, layout: Layout, cost: CostModel) -> float:
    """The priority schedule: this rank's own optimizer step (its host step if offloaded)."""
    from potluck.planner.evaluate import offloaded_steps_s, stage_shape, stage_sharding

    role = layout.role
    ref = (role.pipeline, role.stage)
    offloaded = offloaded_steps_s(cost, plan)
    if ref in offloaded:
        return offloaded[ref]
    shape = stage_shape(plan, *ref)
    device = cost.cluster.device(role.device)
    return cost.optimizer_step_s(device.type, cost.stage_params(shape, role.tp),
                                 stage_sharding(plan, *ref))


def gather_targets(plan: Plan, layout: Layout, cost: CostModel) -> dict[str, float]:
    """The priority schedule: each parameter unit's share of this rank's parameter
    all-gather, in proportion to its parameters (a bucket takes its units' shares)."""
    from potluck.planner.evaluate import parameter_gathers_s, stage_shape

    ref = (layout.role.pipeline, layout.role.stage)
    gather_s = parameter_gathers_s(cost, plan).get(ref, 0.0)
    if gather_s <= 0.0:
        return {}
    per_param = gather_s / cost.stage_params(stage_shape(plan, *ref), 1)
    return {unit: per_param * unit_params(cost.model, unit) for unit in parameter_units(plan.model)}


def outer_targets(plan: Plan, cost: CostModel) -> dict[str, float]:
    """Islands that synchronize rarely: each parameter unit's share of one whole exchange
    across islands, in proportion to its parameters (none without such islands)."""
    from potluck.planner.islands.exchange import outer_exchange

    exchange_s = outer_exchange(cost.cluster, plan, predict(plan).iteration_time_s).exchange_s
    if exchange_s <= 0.0:
        return {}
    units = parameter_units(plan.model)
    total = sum(unit_params(cost.model, unit) for unit in units)
    return {unit: exchange_s * unit_params(cost.model, unit) / total for unit in units}

