"""potluck train --trace: every rank's real op timings of a few steps, in the simulator's format."""

from __future__ import annotations

import json

import pytest
from runtime_helpers import TINY_LLAMA, make_plan, pipe, run_plan

from potluck.errors import ConfigError
from potluck.runtime.launch.checks import check_local
from potluck.runtime.options import TrainOptions
from potluck.runtime.timing.recorder import TRACE_FILE, TraceWindow
from potluck.traces import read_trace

STEPS = 4
TRACED = 2
MICRO_BATCHES = 4


def two_stages():
    return make_plan(TINY_LLAMA, [pipe([(1, (0, 2)), (1, (2, 4))], 1, MICRO_BATCHES)])


@pytest.fixture(scope="module")
def traced(tmp_path_factory) -> tuple[list[float], object]:
    out = tmp_path_factory.mktemp("traced")
    losses = run_plan(two_stages(), steps=STEPS, out_dir=str(out), trace_steps=TRACED)
    return losses, out / TRACE_FILE


def test_the_trace_is_chrome_trace_json(traced) -> None:
    _, path = traced
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


def test_ops_follow_their_dependencies(traced) -> None:
    """A stage's forward starts after the previous stage's forward of that micro-batch ends,
    and the backward flows back the same way (up to the clocks' common origin)."""
    trace = read_trace(traced[1])
    ops = {(e.kind, e.step, e.stage, e.micro_batch): e for e in trace.events
           if e.kind in ("forward", "backward")}
    slack_s = 1e-3
    for (kind, step, stage, mb), event in ops.items():
        if kind == "forward" and stage == 1:
            assert event.start_s >= ops["forward", step, 0, mb].end_s - slack_s
        if kind == "backward" and stage == 0:
            assert event.start_s >= ops["backward", step, 1, mb].end_s - slack_s
        if kind == "backward":
            assert event.start_s >= ops["forward", step, stage, mb].end_s


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
