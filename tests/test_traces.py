"""The trace format the simulator, the runtime and calibration share (potluck.traces)."""

from __future__ import annotations

import json

import pytest

from potluck.errors import ConfigError
from potluck.ops import OpKind
from potluck.traces import COMM, COMPUTE, Stream, Trace, TraceEvent, read_trace, write_trace

DEVICES = ["box.0:0", "box.0:1"]
EVENTS = [
    TraceEvent("box.0:0", COMPUTE, OpKind.FORWARD.value, 0.0, 0.01, 0, 0, 0, 0, 1),
    TraceEvent("box.0:0", COMM, OpKind.SEND_FORWARD.value, 0.01, 0.002, 0, 0, 0, 0, 1),
    TraceEvent("box.0:1", COMM, OpKind.RECV_FORWARD.value, 0.01, 0.002, 0, 1, 0, 0, 1),
    TraceEvent("box.0:0", COMM, OpKind.DP_ALLREDUCE.value, 0.011, 0.004, 0, 0, step=1),
]


def test_a_written_trace_reads_back_event_for_event(tmp_path) -> None:
    path = tmp_path / "trace.json"
    write_trace(Trace(DEVICES, EVENTS, {"box.0:0": [(0.0, 2e9)]}, {"source": "runtime"}), path)
    trace = read_trace(path)
    assert trace.devices == DEVICES and trace.metadata["source"] == "runtime"
    assert trace.events == EVENTS and trace.memory == {"box.0:0": [(0.0, 2e9)]}


def test_threads_and_names_are_the_streams_and_op_kinds_as_written(tmp_path) -> None:
    path = tmp_path / "trace.json"
    write_trace(Trace(DEVICES, EVENTS), path)
    raw = json.loads(path.read_text())["traceEvents"]
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in raw if e["name"] == "thread_name"}
    assert threads[(0, 0)] == "compute" and threads[(0, 1)] == "comm"
    assert threads[(0, 2)] == "comm 2"  # the overlapping send and all-reduce take two lanes
    ops = [(e["name"], e["cat"], e["tid"]) for e in raw if e["ph"] == "X"]
    assert ops == [("forward", "compute", 0), ("send_forward", "comm", 1),
                   ("recv_forward", "comm", 1), ("dp_allreduce", "comm", 2)]


def test_a_stream_may_be_given_by_its_name() -> None:
    event = TraceEvent("box.0:0", "comm", "tp_allreduce", 0.0, 1.0)
    assert event.stream is Stream.COMM and event.kind == OpKind.TP_ALLREDUCE


def test_a_trace_is_never_written_through_a_link_and_leaves_no_temporary_file(tmp_path):
    trace = Trace(["cpu.0:0"], [TraceEvent("cpu.0:0", COMPUTE, "forward", 0.0, 1.0)])
    victim = tmp_path / "victim.txt"
    victim.write_text("mine\n")
    (tmp_path / "trace.json").symlink_to(victim)
    with pytest.raises(ConfigError, match="trace.json is a symbolic link"):
        write_trace(trace, tmp_path / "trace.json")
    assert victim.read_text() == "mine\n"
    write_trace(trace, tmp_path / "other.json")
    assert read_trace(tmp_path / "other.json").devices == ["cpu.0:0"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.json", "trace.json", "victim.txt"]
