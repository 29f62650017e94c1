"""What each stage of a plan does per micro-batch, from the one cost model.

This is the simulator's only door to time and memory figures: every op
duration and byte count comes from :class:`potluck.planner.cost.CostModel`
(compute with its roofline, tensor-parallel collectives, activation and
gradient bytes, model states, the Adam step). Nothing here restates a
formula; it only cuts the cost model's per-stage figures into the pieces
the schedule runs: one :class:`ChunkWork` per virtual stage (chunk ``c`` of
stage ``i`` is virtual stage ``c * p + i``, which holds the embedding when it
is 0 and the head when it is the last).
"""

from __future__ import annotations

from dataclasses import dataclass

from potluck.cluster.topology import Device
from potluck.planner.cost import CostModel, StageShape
from potluck.planner.evaluate import stage_shape, stage_sharding
from potluck.plans import Pipeline, Plan


@dataclass(frozen=True)
class ChunkWork:
    """One virtual stage's work and memory per micro-batch, in seconds and bytes."""

    forward_s: float  # tensor-parallel collectives included
    forward_tp_s: float
    backward_s: float  # input and weight gradients, collectives included
    backward_tp_s: float
    weight_grad_s: float  # the part of the backward a zero-bubble schedule defers
    activation_bytes: float  # held from the forward to the end of the backward
    transient_bytes: float  # held during the backward only (full recomputation)


@dataclass(frozen=True)
class StageWorkload:
    """A pipeline stage: its devices, chunks, model states and optimizer step."""

    devices: tuple[Device, ...]
    chunks: tuple[ChunkWork, ...]
    static_bytes: float  # weights, gradients, optimizer states, runtime overhead
    optimizer_s: float
    send_bytes: float  # one micro-batch's activations (or gradients) this stage sends


@dataclass(frozen=True)
class PipelineWorkload:
    """One data-parallel replica as the simulator runs it."""

    index: int
    stages: tuple[StageWorkload, ...]
    micro_batches: int


def plan_workloads(plan: Plan, cost: CostModel) -> list[PipelineWorkload]:
    """Every pipeline of ``plan``, cut into chunks with the cost model's figures."""
    return [_pipeline(plan, cost, k, pipeline) for k, pipeline in enumerate(plan.pipelines)]


def _pipeline(plan: Plan, cost: CostModel, k: int, pipeline: Pipeline) -> PipelineWorkload:
    p, sharding = pipeline.pp, stage_sharding(plan)
    stages = []
    for i, stage in enumerate(pipeline.stages):
        devices = tuple(cost.cluster.device(d) for d in stage.devices)
        shape = stage_shape(plan, k, i)
        chunks = tuple(
            _chunk(cost, devices, shape.with_layers(end - start, first=(c == 0 and i == 0),
                                                    last=(c == len(stage.layer_ranges) - 1 and i == p - 1)))
            for c, (start, end) in enumerate(stage.layer_ranges)
        )
        params = cost.stage_params(shape, len(devices))
        static = (cost.model_state_bytes(devices[0].type, params, sharding)
                  + cost.overhead_bytes(devices[0].type))
        optimizer = cost.optimizer_step_s(devices[0].type, params, sharding)
        send = cost.send_bytes(devices[0].type, pipeline.micro_batch_size)
        stages.append(StageWorkload(devices, chunks, static, optimizer, send))
    return PipelineWorkload(k, tuple(stages), pipeline.num_micro_batches)


def _chunk(cost: CostModel, devices: tuple[Device, ...], shape: StageShape) -> ChunkWork:
    """One chunk (virtual stage) of ``shape.num_layers`` blocks."""
    device_type, tp = devices[0].type, len(devices)
    timing = cost.stage_time(devices, shape)
    work, compute_s = timing.work, timing.compute_s
    forward_tp = shape.num_layers * cost.tp_block_comm_s(devices, shape.micro_batch)
    backward_compute = compute_s - (work.forward_s - forward_tp)
    activations = cost.activation_bytes_per_micro_batch(device_type, tp, shape)
    if shape.last:  # the head's logits, kept for the loss's backward
        head_only = shape.with_layers(0, first=False)
        activations += cost.stage_peak_activation_bytes(device_type, tp, head_only, 0.0)
    body_only = shape.with_layers(shape.num_layers, first=False, last=False)
    transient = cost.stage_peak_activation_bytes(device_type, tp, body_only, 0.0)
    return ChunkWork(
        forward_s=work.forward_s, forward_tp_s=forward_tp, backward_s=work.backward_s,
        backward_tp_s=max(0.0, work.backward_s - backward_compute) if tp > 1 else 0.0,
        weight_grad_s=work.weight_grad_s,
        activation_bytes=activations, transient_bytes=transient,
    )
