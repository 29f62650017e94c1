"""What `potluck simulate` writes: a valid Chrome trace, non-empty PNGs, a JSON summary."""

from __future__ import annotations

import json

import pytest
from simkit import SLOW_NETWORK, cluster, flat_model, make_plan
from typer.testing import CliRunner

from potluck.cli import app
from potluck.cluster import parse_cluster
from potluck.errors import ConfigError
from potluck.model import load_model
from potluck.planner.evaluate import predict
from potluck.planner.search import SearchOptions, search
from potluck.plans import Schedule, TrainingShape, save_plan
from potluck.sim import simulate
from potluck.sim.outputs import write_outputs
from potluck.sim.trace import simulation_trace
from potluck.traces import read_trace, trace_json

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def result():
    plan = make_plan(cluster(SLOW_NETWORK), flat_model(8), pp=4, micro_batches=8, tp=2, dp=2,
                     schedule=Schedule.INTERLEAVED, virtual_stages=2)
    return simulate(plan)


def test_trace_is_chrome_trace_json_with_one_process_per_device(result) -> None:
    data = trace_json(simulation_trace(result))
    events = json.loads(json.dumps(data))["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert list(names.values()) == list(result.plan.devices)
    complete = [e for e in events if e["ph"] == "X"]
    assert complete and all(
        {"name", "cat", "pid", "tid", "ts", "dur", "args"} <= e.keys() and e["dur"] >= 0
        for e in complete)
    assert {e["args"]["stage"] for e in complete if e["cat"] == "compute"} == {0, 1, 2, 3}
    assert {"forward", "backward", "send_forward", "recv_backward", "tp_allreduce",
            "dp_allreduce", "optimizer"} <= {e["name"] for e in complete}
    assert any(e["ph"] == "C" and e["name"] == "memory" for e in events)


def test_slices_of_a_thread_never_overlap(result) -> None:
    """Trace viewers need each thread's slices nested; overlapping transfers get more threads."""
    events = [e for e in trace_json(simulation_trace(result))["traceEvents"] if e["ph"] == "X"]
    by_thread: dict = {}
    for e in events:
        by_thread.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in by_thread.values():
        spans.sort()
        assert all(a[1] <= b[0] + 1e-6 for a, b in zip(spans, spans[1:], strict=False))


def test_trace_reads_back(result, tmp_path) -> None:
    files = write_outputs(result, tmp_path)
    trace = read_trace(files.trace)
    assert trace.devices == list(result.plan.devices)
    assert trace.metadata["source"] == "simulator"
    assert max(e.end_s for e in trace.events) == pytest.approx(result.iteration_time_s)
    forwards = [e for e in trace.events if e.kind == "forward" and e.device == trace.devices[0]]
    assert len(forwards) == 8 * 2  # micro-batches x chunks


def test_pictures_are_non_empty_pngs(result, tmp_path) -> None:
    files = write_outputs(result, tmp_path)
    for path in (files.timeline, files.memory):
        data = path.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000


def test_a_file_that_is_not_a_trace_is_one_clear_error(tmp_path) -> None:
    path = tmp_path / "trace.json"
    path.write_text('{"events": []}')
    with pytest.raises(ConfigError, match="not a Chrome trace"):
        read_trace(path)


def test_cli_simulate_json(result, tmp_path) -> None:
    plan_file = tmp_path / "plan.json"
    save_plan(result.plan, plan_file)
    out = CliRunner().invoke(app, ["simulate", str(plan_file), "--out", str(tmp_path / "sim"),
                                   "--json"])
    assert out.exit_code == 0, out.output
    summary = json.loads(out.stdout)
    assert summary["iteration_time_s"] == pytest.approx(result.iteration_time_s)
    assert 0 < summary["bubble_fraction"] < 1
    assert len(summary["per_device"]) == result.plan.num_gpus
    assert {"busy_s", "idle_s"} <= summary["per_device"][0].keys()
    assert (tmp_path / "sim" / "timeline.png").is_file()


def test_cli_simulate_under_another_schedule(result, tmp_path) -> None:
    plan = make_plan(cluster(), flat_model(8), pp=2, micro_batches=4)
    plan_file = tmp_path / "plan.json"
    save_plan(plan, plan_file)
    runs = {}
    for schedule in ("gpipe", "1f1b"):
        out = CliRunner().invoke(app, ["simulate", str(plan_file), "--schedule", schedule,
                                       "--out", str(tmp_path / schedule), "--json"])
        assert out.exit_code == 0, out.output
        runs[schedule] = json.loads(out.stdout)["schedule"]
    assert runs == {"gpipe": "gpipe", "1f1b": "1f1b"}


def test_cli_errors_are_one_line(tmp_path) -> None:
    out = CliRunner().invoke(app, ["simulate", str(tmp_path / "missing.json")])
    assert out.exit_code != 0
    assert isinstance(out.exception, ConfigError) and "not found" in str(out.exception)


def test_stages_without_tensor_parallelism_spend_exactly_no_time_in_it() -> None:
    """A TP degree of 1 has no TP collectives: 0 s, not float noise like -8.9e-16 s."""
    spec = parse_cluster("nodes: [{name: b, gpu: rtx3090, gpus_per_node: 3}]", "b.yaml")
    plan = search(spec, load_model("gpt3-1.3b"), TrainingShape(64, 2048),
                  SearchOptions(tp=1, pp=3)).best
    assert [d.tp_comm_s for d in simulate(plan).devices] == [0.0] * 3


def test_a_devices_predicted_all_reduce_is_its_wait_after_its_backward_as_the_runtime_records(
        result) -> None:
    """The runtime's trace times ``dp_allreduce`` as a rank's wait for its gradient
    reductions after its schedule (their exposed part); the prediction drew the whole
    overlapped span, as long as the backward it hides behind. One event per device: from its
    last backward's end to its last reduction's end, the longest near the cost model's dp_s
    (the simulator shares links between reductions in time, the cost model by formula)."""
    events = simulation_trace(result).events
    last_backward = {}
    for e in events:
        if e.kind == "backward":
            last_backward[e.device] = max(last_backward.get(e.device, 0.0), e.end_s)
    reductions = [e for e in events if e.kind == "dp_allreduce"]
    assert sorted(e.device for e in reductions) == sorted(result.plan.devices)
    for e in reductions:
        assert e.start_s == pytest.approx(last_backward[e.device])
    assert max(e.duration_s for e in reductions) == pytest.approx(
        predict(result.plan).breakdown.dp_s, rel=0.05)
