"""The trace of a simulated iteration: a :class:`~potluck.sim.result.SimulationResult` as a
:class:`~potluck.traces.Trace` (the format the runtime's recorder also writes).

Every compute op of a pipeline is drawn on each device of its stage; the
tensor-parallel collectives of one forward or backward as one ``tp_allreduce``
covering the end of that op; a send as ``send_*`` on the sending stage's
devices and the matching ``recv_*`` on the receiving stage's; then the
gradient all-reduces, one ``dp_allreduce`` per device for the part it waits for (from its
last backward's end to its last group's end, as the runtime records its wait for them: the
part that overlaps the backward is hidden in it), and the optimizer steps; then the state
transfers of issue 13 (``swap_out``, ``swap_in``, ``param_allgather``) on each device of
their stage's comm stream.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from potluck.ops import OpKind
from potluck.traces import COMM, COMPUTE, Trace, TraceEvent

_RECEIVE = {OpKind.SEND_FORWARD: OpKind.RECV_FORWARD, OpKind.SEND_BACKWARD: OpKind.RECV_BACKWARD}


def simulation_trace(result: Any) -> Trace:
    """The trace of a :class:`~potluck.sim.result.SimulationResult`."""
    plan = result.plan
    trace = Trace(list(plan.devices), metadata={
        "source": "simulator", "layout": plan.layout(), "schedule": result.schedule.value,
        "iteration_time_s": result.iteration_time_s, "bubble_fraction": result.bubble_fraction,
    })
    for k, pipeline in enumerate(plan.pipelines):
        stages = [stage.devices for stage in pipeline.stages]
        trace.events.extend(_pipeline_events(result.pipelines[k].ops, k, stages))
        for i, devices in enumerate(stages):
            points = list(zip(result.memory[k][i].times_s, result.memory[k][i].bytes, strict=True))
            trace.memory.update(dict.fromkeys(devices, points))
    trace.events.extend(_step_events(result, plan))
    for t in getattr(result, "state_transfers", ()):
        for device in plan.pipelines[t.pipeline].stages[t.stage].devices:
            trace.events.append(TraceEvent(device, COMM, t.kind.value, t.start_s,
                                           t.end_s - t.start_s, t.pipeline, t.stage,
                                           t.micro_batch, t.chunk))
    return trace


def _pipeline_events(ops: Iterable, k: int, stages: list[tuple[str, ...]]) -> Iterator[TraceEvent]:
    for op in ops:
        if op.peer == -1:
            for device in stages[op.stage]:
                yield TraceEvent(device, COMPUTE, op.kind, op.start_s, op.end_s - op.start_s,
                                 k, op.stage, op.micro_batch, op.chunk)
                if op.tp_s > 0:
                    yield TraceEvent(device, COMM, OpKind.TP_ALLREDUCE.value, op.end_s - op.tp_s,
                                     op.tp_s, k, op.stage, op.micro_batch, op.chunk)
            continue
        receive = _RECEIVE[op.kind].value
        for stage, kind in ((op.stage, op.kind), (op.peer, receive)):
            for device in stages[stage]:
                yield TraceEvent(device, COMM, kind, op.start_s, op.end_s - op.start_s,
                                 k, stage, op.micro_batch, op.chunk)


def _exposed_reductions(result: Any) -> dict[tuple[int, int], tuple[float, float]]:
    """Per stage, one span over every gradient group it is in, from its gradients complete to
    its last group's end: as the runtime waits for all of them in one ``dp_allreduce``."""
    spans: dict[tuple[int, int], tuple[float, float]] = {}
    for sync in result.gradient_syncs:
        for member, start_s, end_s in sync.exposed():
            first_s, last_s = spans.get(member, (start_s, end_s))
            spans[member] = (min(first_s, start_s), max(last_s, end_s))
    return spans


def _step_events(result: Any, plan: Any) -> Iterator[TraceEvent]:
    for (k, i), (start_s, end_s) in _exposed_reductions(result).items():
        for device in plan.pipelines[k].stages[i].devices:
            yield TraceEvent(device, COMM, OpKind.DP_ALLREDUCE.value, start_s, end_s - start_s,
                             k, i)
    for step in result.optimizer_steps:
        for device in plan.pipelines[step.pipeline].stages[step.stage].devices:
            yield TraceEvent(device, COMPUTE, OpKind.OPTIMIZER.value, step.start_s,
                             step.end_s - step.start_s, step.pipeline, step.stage)
