"""Training timelines in the Chrome trace format (opens in Perfetto or chrome://tracing).

One format for simulated and measured steps, so the two open side by side and
``potluck compare`` can read either: the simulator writes it
(:func:`potluck.sim.trace.simulation_trace`), the runtime's recorder writes it
(:mod:`potluck.runtime.timing.recorder`) and calibration reads it. A trace is a JSON
object::

    {"traceEvents": [...], "displayTimeUnit": "ms",
     "otherData": {"potluck_trace": 1, "source": "simulator" | "runtime", ...}}

- one process per device: ``pid`` is the device's position in the plan
  (``Plan.devices``), named by a ``process_name`` metadata event
  (``"box3090.0:1"``), sorted by ``process_sort_index``;
- threads per device (:class:`Stream`): ``tid`` 0 ``compute``, ``tid`` 1
  ``comm`` (and 2, 3, ... ``comm 2``, ... when transfers overlap: a thread's
  slices must nest);
- each op is a complete event (``"ph": "X"``) with ``ts``/``dur`` in
  microseconds, ``name`` the op kind (a :class:`~potluck.ops.OpKind` value:
  ``forward``, ``backward``, ``backward_input``, ``backward_weight``,
  ``optimizer`` on ``compute``; ``send_forward``, ``recv_forward``,
  ``send_backward``, ``recv_backward``, ``tp_allreduce``, ``dp_allreduce`` on
  ``comm``), ``cat`` the thread's name and ``args`` = ``{"pipeline", "stage",
  "micro_batch", "chunk", "step"}`` (-1 where it does not apply);
- memory as counter events (``"ph": "C"``, ``name`` ``memory``, ``args``
  ``{"GB": ...}``).

The simulator draws the tensor-parallel collectives of one forward or
backward as one ``tp_allreduce`` event covering the end of that op (their sum;
they are interleaved with the layers in reality). The runtime writes the same
events with ``"source": "runtime"`` and one ``step`` per measured iteration.
An event's ``kind`` is the name as written (a plain string), so a trace with
kinds this version does not know still reads.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from potluck.errors import ConfigError
from potluck.safe_files import write_text
from potluck.yamlio import MAX_LOG_BYTES, read_text

TRACE_VERSION = 1
_US = 1e6


class Stream(str, Enum):
    """Where an op runs on its device; the value names the trace thread (and ``cat``)."""

    COMPUTE = "compute"
    COMM = "comm"

    @property
    def tid(self) -> int:
        """The trace thread: 0 for compute, 1 for the first communication lane."""
        return 0 if self is Stream.COMPUTE else 1


COMPUTE, COMM = Stream.COMPUTE, Stream.COMM  # shorthands for building events


@dataclass(frozen=True)
class TraceEvent:
    """One op on one device's stream."""

    device: str
    stream: Stream
    kind: str  # the op's name in the trace: an OpKind value
    start_s: float
    duration_s: float
    pipeline: int = -1
    stage: int = -1
    micro_batch: int = -1
    chunk: int = -1
    step: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.stream, Stream):  # "compute" or "comm" as written
            object.__setattr__(self, "stream", Stream(self.stream))

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s


@dataclass
class Trace:
    """Devices in plan order, their events and memory, and what made the trace."""

    devices: list[str]
    events: list[TraceEvent] = field(default_factory=list)
    memory: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # device -> (s, bytes)
    metadata: dict[str, Any] = field(default_factory=dict)


def trace_json(trace: Trace) -> dict[str, Any]:
    """The Chrome trace JSON object of ``trace``."""
    pids = {device: pid for pid, device in enumerate(trace.devices)}
    tids = _comm_lanes(trace.events)
    lanes = max(tids.values(), default=COMM.tid)
    return {
        "traceEvents": list(_metadata_events(trace.devices, lanes)) + [
            _complete_event(event, pids[event.device], tids.get(id(event), event.stream.tid))
            for event in trace.events
        ] + list(_memory_events(trace.memory, pids)),
        "displayTimeUnit": "ms",
        "otherData": {"potluck_trace": TRACE_VERSION, **trace.metadata},
    }


def _comm_lanes(events: list[TraceEvent]) -> dict[int, int]:
    """Thread ids for communication events so that none overlaps another on its thread
    (trace viewers need the slices of a thread nested): tid 1, then 2, 3, ... as needed."""
    ends: dict[str, list[float]] = {}
    tids: dict[int, int] = {}
    for event in sorted((e for e in events if e.stream is COMM), key=lambda e: e.start_s):
        lanes = ends.setdefault(event.device, [])
        lane = next((i for i, end in enumerate(lanes) if end <= event.start_s), len(lanes))
        if lane == len(lanes):
            lanes.append(0.0)
        lanes[lane] = event.end_s
        tids[id(event)] = COMM.tid + lane
    return tids


def write_trace(trace: Trace, path: str | Path) -> None:
    """Write ``trace`` as Chrome trace JSON (atomically, never through a link)."""
    write_text(path, json.dumps(trace_json(trace), separators=(",", ":")))


def _thread_name(tid: int) -> str:
    if tid == COMPUTE.tid:
        return COMPUTE.value
    return COMM.value if tid == COMM.tid else f"{COMM.value} {tid}"


def _metadata_events(devices: list[str], last_tid: int) -> Iterator[dict[str, Any]]:
    for pid, device in enumerate(devices):
        yield {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": device}}
        yield {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
               "args": {"sort_index": pid}}
        for tid in range(last_tid + 1):
            yield {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                   "args": {"name": _thread_name(tid)}}


def _complete_event(event: TraceEvent, pid: int, tid: int) -> dict[str, Any]:
    return {
        "ph": "X", "name": event.kind, "cat": event.stream.value, "pid": pid, "tid": tid,
        "ts": event.start_s * _US, "dur": event.duration_s * _US,
        "args": {"pipeline": event.pipeline, "stage": event.stage,
                 "micro_batch": event.micro_batch, "chunk": event.chunk, "step": event.step},
    }


def _memory_events(memory: dict[str, list[tuple[float, float]]],
                   pids: dict[str, int]) -> Iterator[dict[str, Any]]:
    for device, points in memory.items():
        for time_s, held in points:
            yield {"ph": "C", "name": "memory", "pid": pids[device], "tid": 0,
                   "ts": time_s * _US, "args": {"GB": held / 1e9}}


def read_trace(path: str | Path) -> Trace:
    """Read a trace written by the simulator or the runtime; one-line errors if it is not one."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"trace file {str(path)!r} not found")
    try:
        data = json.loads(read_text(path, "trace", MAX_LOG_BYTES))
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}:{err.lineno}: not a JSON trace: {err.msg}") from None
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise ConfigError(f"{path}: not a Chrome trace (no traceEvents list)")
    return _parse(data["traceEvents"], data.get("otherData") or {}, path)


def _parse(raw: list, metadata: dict[str, Any], path: Path) -> Trace:
    names = {e["pid"]: e["args"]["name"] for e in raw
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    trace = Trace([names[pid] for pid in sorted(names)], metadata=dict(metadata))
    try:
        for event in raw:
            if event.get("ph") == "X":
                trace.events.append(_event(event, names))
            elif event.get("ph") == "C" and event.get("name") == "memory":
                points = trace.memory.setdefault(names[event["pid"]], [])
                points.append((event["ts"] / _US, event["args"]["GB"] * 1e9))
    except (KeyError, TypeError, ValueError) as err:
        raise ConfigError(f"{path}: malformed potluck trace event ({err!r})") from None
    return trace


def _event(raw: dict[str, Any], names: dict[int, str]) -> TraceEvent:
    args = raw.get("args") or {}
    return TraceEvent(
        device=names[raw["pid"]], stream=COMPUTE if raw.get("tid", 0) == COMPUTE.tid else COMM,
        kind=raw["name"],
        start_s=float(raw["ts"]) / _US, duration_s=float(raw["dur"]) / _US,
        pipeline=int(args.get("pipeline", -1)), stage=int(args.get("stage", -1)),
        micro_batch=int(args.get("micro_batch", -1)), chunk=int(args.get("chunk", -1)),
        step=int(args.get("step", 0)),
    )
