"""Memory of each device over the simulated iteration.

A device holds its model states (weights, gradients, optimizer states) and
runtime overhead throughout, plus the activations of every micro-batch in
flight on each of its chunks: allocated when the chunk's forward starts,
freed when the backward that consumes them ends (the schedule's
:attr:`~potluck.schedules.PipelineSchedule.frees_activations_after`: the weight
backward under zero bubble, since it still reads the layer inputs). With full
recomputation a backward also holds one block's full activations while it
runs. A swapping chunk's swapped activations leave the device when its forward ends
and come back when its backward starts (the memory contract of issue 13); stashes a
device holds for its peers count at their peak throughout. All byte counts come from
the cost model (:mod:`potluck.sim.workload`);
the simulator only decides when they are held, so its peaks check the cost
model's in-flight estimates (``p - i`` micro-batches on stage ``i`` under 1F1B).
"""

from __future__ import annotations

from collections.abc import Iterable

from potluck.ops import OpKind
from potluck.sim.result import MemoryTrace, OpRecord
from potluck.sim.workload import StageWorkload


def stage_memory(ops: Iterable[OpRecord], stage: int, work: StageWorkload,
                 frees_on: OpKind) -> MemoryTrace:
    """Bytes on each device of ``stage`` over time, from its executed ops; a chunk's
    activations are freed when ``frees_on`` (the schedule's) ends."""
    changes: list[tuple[float, float]] = []
    for op in ops:
        if op.stage != stage or op.peer != -1:
            continue
        chunk = work.chunks[op.chunk]
        if op.kind is OpKind.FORWARD:
            changes.append((op.start_s, chunk.activation_bytes))
            if chunk.swapped_bytes:
                changes.append((op.end_s, -chunk.swapped_bytes))
        elif op.kind in (OpKind.BACKWARD, OpKind.BACKWARD_INPUT):
            if chunk.swapped_bytes:
                changes.append((op.start_s, chunk.swapped_bytes))
            if chunk.transient_bytes:
                changes.append((op.start_s, chunk.transient_bytes))
                changes.append((op.end_s, -chunk.transient_bytes))
        if op.kind is frees_on:
            changes.append((op.end_s, -chunk.activation_bytes))
    changes.sort()  # at equal times frees (negative) come before allocations
    times, held = [0.0], [work.static_bytes]
    for time_s, delta in changes:
        if time_s == times[-1] and len(times) > 1:
            held[-1] += delta
        else:
            times.append(time_s)
            held.append(held[-1] + delta)
    return MemoryTrace(tuple(times), tuple(held))
