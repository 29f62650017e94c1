"""potluck train --trace: every rank's real op timings of a few steps, in the simulator's format."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import pytest
from runtime_helpers import LR, TINY_LLAMA, make_plan, pipe, run_plan

from potluck.errors import ConfigError
from potluck.runtime.launch.checks import check_local
from potluck.runtime.launch.local import run_local
from potluck.runtime.options import TrainOptions
from potluck.runtime.timing.recorder import TRACE_FILE, OpRecorder, TraceWindow
from potluck.runtime.training import train_rank
from potluck.traces import read_trace

STEPS = 4
TRACED = 2
MICRO_BATCHES = 4


def two_stages():
    return make_plan(TINY_LLAMA, [pipe([(1, (0, 2)), (1, (2, 4))], 1, MICRO_BATCHES)])


@dataclass(frozen=True)
class TraceClock:
    """When a rank reached the tracing barrier and its trace's time 0, on the machine's
    monotonic clock (``time.perf_counter``: one clock for every process of this machine)."""

    arrived_s: float
    origin_s: float


def _traced_rank(plan, options) -> tuple[list[float], TraceClock]:
    """A rank's losses and its trace clock (noted around :meth:`OpRecorder.start`)."""
    clocks = []
    start = OpRecorder.start

    def noting_start(recorder, window, step):
        arrived_s = time.perf_counter()
        start(recorder, window, step)
        mark = recorder.timer.mark()
        clocks.append(TraceClock(arrived_s, mark - recorder.timer.seconds(mark)))

    OpRecorder.start = noting_start  # this rank's process only; it ends with the run
    losses = [m.loss for m in train_rank(plan, options)]
    return losses, clocks[0]


@pytest.fixture(scope="module")
def traced(tmp_path_factory) -> tuple[list[float], object, list[TraceClock]]:
    out = tmp_path_factory.mktemp("traced")
    plan = two_stages()
    options = TrainOptions(steps=STEPS, lr=LR, progress=False, timeout_s=60, out_dir=str(out),
                           trace_steps=TRACED)
    results = run_local(_traced_rank, plan.devices, (plan, options), timeout_s=120)
    return results[0][0], out / TRACE_FILE, [clock for _, clock in results]


def test_the_trace_is_chrome_trace_json(traced) -> None:
    path = traced[1]
    data = json.loads(path.read_text())
    assert data["otherData"]["source"] == "runtime"
    complete = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert complete and all({"pid", "tid", "ts", "dur", "name", "args"} <= e.keys()
                            for e in complete)
    assert all(e["dur"] >= 0 for e in complete)


def test_every_stage_runs_every_micro_batch_of_the_traced_steps(traced) -> None:
    trace = read_trace(traced[1])
    steps = {e.step for e in trace.events}
    assert steps == {STEPS - TRACED, STEPS - 1}  # the last steps: the run is short
    for kind in ("forward", "backward"):
        seen = {(e.step, e.stage, e.micro_batch) for e in trace.events if e.kind == kind}
        assert seen == {(step, stage, mb) for step in steps for stage in (0, 1)
                        for mb in range(MICRO_BATCHES)}
    kinds = {e.kind for e in trace.events}
    assert {"optimizer", "recv_forward", "recv_backward"} <= kinds


def test_every_rank_starts_its_clock_after_all_ranks_reached_the_barrier(traced) -> None:
    """The ranks' times share an origin: none starts its clock before every rank is ready."""
    clocks = traced[2]
    assert max(c.arrived_s for c in clocks) <= min(c.origin_s for c in clocks)


def test_ops_follow_their_dependencies(traced) -> None:
    """A stage's forward starts after the previous stage's forward of that micro-batch ends,
    and the backward flows back the same way.

    Across ranks the times are compared on the machine's clock: each rank's trace time
    plus its origin. The origins differ by the time the ranks took to leave the barrier,
    which on a busy machine is several milliseconds, more than an op of this tiny model."""
    trace, clocks = read_trace(traced[1]), traced[2]
    ops = {(e.kind, e.step, e.stage, e.micro_batch): e for e in trace.events
           if e.kind in ("forward", "backward")}

    def start_s(key):  # on the machine's clock; rank = stage in this plan
        return ops[key].start_s + clocks[key[2]].origin_s

    def end_s(key):
        return ops[key].end_s + clocks[key[2]].origin_s

    for key in ops:
        kind, step, stage, mb = key
        if kind == "forward" and stage == 1:
            assert start_s(key) >= end_s(("forward", step, 0, mb)), key
        if kind == "backward" and stage == 0:
            assert start_s(key) >= end_s(("backward", step, 1, mb)), key
        if kind == "backward":
            assert ops[key].start_s >= ops["forward", step, stage, mb].end_s, key


def test_tracing_never_changes_the_losses(traced) -> None:
    assert traced[0] == run_plan(two_stages(), steps=STEPS)


def test_the_window_follows_the_warm_up_and_fits_the_run() -> None:
    assert TraceWindow.after_warmup(0, 20, 3) == TraceWindow(2, 3)
    assert TraceWindow.after_warmup(0, 4, 3) == TraceWindow(1, 3)
    assert TraceWindow.after_warmup(5, 6, 3) == TraceWindow(5, 1)  # resumed near the end
    assert 4 in TraceWindow(2, 3) and 5 not in TraceWindow(2, 3)


def test_tracing_needs_a_run_directory() -> None:
    with pytest.raises(ConfigError, match="--out DIR"):
        check_local(two_stages(), TrainOptions(trace_steps=3))


def test_an_emulated_trace_shows_the_padded_times(tmp_path) -> None:
    from potluck.cluster.spec import parse_cluster
    from potluck.runtime.layout import Layout
    from potluck.runtime.timing.emulate import stage_targets

    cluster = parse_cluster("nodes:\n  - {name: box, gpu: rtx3090, gpus_per_node: 2}\n")
    plan = make_plan(TINY_LLAMA, [pipe([(1, (0, 4))], 1, 2), pipe([(1, (0, 4))], 1, 2)],
                     cluster=cluster, device_ids=["box.0:0", "box.0:1"])
    target = stage_targets(plan, Layout.for_local_ranks(plan, 0))[0]
    dilation = 0.02 / target.forward_s  # a 20 ms emulated forward
    run_plan(plan, steps=3, out_dir=str(tmp_path), trace_steps=1, emulate=True, dilation=dilation)
    trace = read_trace(tmp_path / TRACE_FILE)
    assert trace.metadata["emulated"] and trace.metadata["dilation"] == pytest.approx(dilation)
    forwards = [e.duration_s for e in trace.events if e.kind == "forward"]
    backwards = [e.duration_s for e in trace.events if e.kind == "backward"]
    assert len(forwards) == 4 and min(forwards) >= 0.02 * 0.99
    assert min(backwards) >= dilation * target.backward_s * 0.99
    assert {"dp_allreduce", "optimizer"} <= {e.kind for e in trace.events}
