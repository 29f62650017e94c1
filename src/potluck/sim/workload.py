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
from potluck.planner.evaluate import (
    PlanEvaluation,
    offloaded_steps_s,
    peer_held_bytes,
    stage_shape,
    stage_sharding,
)
from potluck.plans import Pipeline, Plan
from potluck.plans.memory import Swap


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
    swapped_bytes: float = 0.0  # off the device from the forward's end to the backward's start
    swap_s: float = 0.0  # one pass's swap transfer (out after the forward, back before the backward)
    gather_s: float = 0.0  # ZeRO-3: one pass's all-gather of the chunk's weights


@dataclass(frozen=True)
class StageWorkload:
    """A pipeline stage: its devices, chunks, model states and optimizer step."""

    devices: tuple[Device, ...]
    chunks: tuple[ChunkWork, ...]
    static_bytes: float  # weights, gradients, optimizer states, runtime overhead
    optimizer_s: float
    send_bytes: float  # one micro-batch's activations (or gradients) this stage sends
    swap_lane: str = ""  # the link its swap crosses: ``<device>->host``, ``<device>-><peer>``
    offloaded: bool = False  # its optimizer steps on the host


@dataclass(frozen=True)
class PipelineWorkload:
    """One data-parallel replica as the simulator runs it."""

    index: int
    stages: tuple[StageWorkload, ...]
    micro_batches: int


def plan_workloads(plan: Plan, cost: CostModel) -> list[PipelineWorkload]:
    """Every pipeline of ``plan``, cut into chunks with the cost model's figures."""
    evaluation = PlanEvaluation(cost, plan)
    held = peer_held_bytes(cost, plan)
    host_steps = offloaded_steps_s(cost, plan)
    return [_pipeline(plan, cost, k, pipeline, evaluation, held, host_steps)
            for k, pipeline in enumerate(plan.pipelines)]


def _pipeline(plan: Plan, cost: CostModel, k: int, pipeline: Pipeline,
              evaluation: PlanEvaluation, held: dict[str, float],
              host_steps: dict[tuple[int, int], float]) -> PipelineWorkload:
    p = pipeline.pp
    stages = []
    all_devices = evaluation.devices[k]
    for i, stage in enumerate(pipeline.stages):
        devices = all_devices[i]
        sharding = stage_sharding(plan, k, i)
        shape = stage_shape(plan, k, i)
        neighbours = tuple(d for j in (i - 1, i + 1) if 0 <= j < p for d in all_devices[j])
        gather_s = evaluation._gather_s(k, i, shape)
        chunks, offset = [], 0
        for c, (start, end) in enumerate(stage.layer_ranges):
            n = end - start
            chunk_shape = shape.with_layers(n, first=(c == 0 and i == 0),
                                            last=(c == len(stage.layer_ranges) - 1 and i == p - 1),
                                            offset=offset)
            share = gather_s * n / shape.num_layers if shape.num_layers else 0.0
            chunks.append(_chunk(cost, devices, chunk_shape, neighbours, share))
            offset += n
        params = cost.stage_params(shape, len(devices))
        static = (cost.model_state_bytes(devices[0].type, params, sharding)
                  + cost.zero_working_bytes(devices[0].type, len(devices), shape, sharding)
                  + cost.overhead_bytes(devices[0].type)
                  + max(held.get(d.id, 0.0) for d in devices))
        optimizer = host_steps.get((k, i)) or cost.optimizer_step_s(devices[0].type, params,
                                                                    sharding)
        send = cost.send_bytes(devices[0].type, pipeline.micro_batch_size)
        stages.append(StageWorkload(devices, tuple(chunks), static, optimizer, send,
                                    _swap_lane(devices[0].id, shape), shape.offload))
    return PipelineWorkload(k, tuple(stages), pipeline.num_micro_batches)


def _swap_lane(device: str, shape: StageShape) -> str:
    if not shape.swapped:
        return ""
    if shape.swap is Swap.HOST:
        return f"{device}->host"
    if shape.swap is Swap.HYBRID:
        return f"{device}->host+{shape.swap_peer}"
    return f"{device}->{shape.swap_peer}"


def _chunk(cost: CostModel, devices: tuple[Device, ...], shape: StageShape,
           neighbours: tuple[Device, ...] = (), gather_s: float = 0.0) -> ChunkWork:
    """One chunk (virtual stage) of ``shape.num_layers`` blocks."""
    device_type, tp = devices[0].type, len(devices)
    timing = cost.stage_time(devices, shape, 0.0, neighbours, gather_s)
    work = timing.work
    activations = cost.activation_bytes_per_micro_batch(device_type, tp, shape)
    if shape.last:  # the head's logits, kept for the loss's backward
        head_only = shape.with_layers(0, first=False)
        activations += cost.stage_peak_activation_bytes(device_type, tp, head_only, 0.0)
    body_only = shape.with_layers(shape.num_layers, first=False, last=False)
    transient = cost.stage_peak_activation_bytes(device_type, tp, body_only, 0.0)
    return ChunkWork(
        forward_s=work.forward_s, forward_tp_s=timing.forward_tp_s, backward_s=work.backward_s,
        backward_tp_s=timing.backward_tp_s,
        weight_grad_s=work.weight_grad_s,
        activation_bytes=activations, transient_bytes=transient,
        swapped_bytes=cost.swapped_bytes_per_micro_batch(device_type, tp, shape),
        swap_s=cost.swap_transfer_s(devices[0], tp, shape), gather_s=gather_s,
    )
