"""The islands' outer cycle as the simulator draws it: one period of H inner steps, each
fragment's or push's exchange on the link between the islands, and what training waits for,
which over the period must be the exchange owner's amortized figure."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from potluck.cluster import Cluster, parse_cluster
from potluck.model import PRESETS
from potluck.planner.islands.exchange import outer_exchange
from potluck.plans import Island, Islands, Pipeline, Plan, Stage, SyncMethod, TrainingShape
from potluck.sim import simulate
from potluck.sim.outputs import render_summary, write_outputs
from potluck.traces import read_trace

GPT = PRESETS["gpt3-125m"]
# two desktops over 1 Gb/s: the whole exchange takes ~4 s, an inner step ~0.12 s
TWO_DESKTOPS = parse_cluster(
    "nodes: [{name: desk, gpu: rtx4090, gpus_per_node: 1, count: 2, inter_bandwidth: 1Gb/s}]")


def _plan(islands: Islands | None = None) -> Plan:
    pipelines = tuple(Pipeline((Stage((f"desk.{k}:0",), ((0, GPT.num_layers),)),), 4, 2)
                      for k in (0, 1))
    return Plan(TWO_DESKTOPS, GPT, TrainingShape(16, 1024), pipelines,
                islands=islands or Islands())


def _split(**kwargs) -> Plan:
    kwargs.setdefault("sync", SyncMethod.DILOCO)
    return _plan(Islands(islands=(Island((0,)), Island((1,))), **kwargs))


CASES = {
    "diloco F=1": dict(inner_steps=10),
    "diloco F=2, exchange longer than the overlap": dict(inner_steps=10, fragments=2),
    "diloco F=2, exchange shorter than the overlap": dict(inner_steps=100, fragments=2),
    "diloco F=2, H not a multiple of F": dict(inner_steps=5, fragments=2),
    "bounded staleness 0": dict(sync=SyncMethod.BOUNDED, inner_steps=10),
    "bounded staleness 1": dict(sync=SyncMethod.BOUNDED, inner_steps=10, staleness=1),
}


@pytest.fixture(scope="module")
def results():
    return {name: simulate(_split(**kwargs)) for name, kwargs in CASES.items()}


@pytest.mark.parametrize("name", CASES)
def test_the_wait_over_one_period_is_the_owners_exposed_part(results, name) -> None:
    result = results[name]
    cycle, h = result.outer_cycle, result.plan.islands.inner_steps
    owner = outer_exchange(Cluster(TWO_DESKTOPS), result.plan, cycle.step_s)
    assert cycle.waited_s / h == pytest.approx(owner.exposed_per_step_s, rel=1e-9, abs=1e-12)
    assert sum(s.waited_s for s in cycle.sends) / h == pytest.approx(owner.exposed_per_step_s,
                                                                      rel=1e-9, abs=1e-12)
    assert result.iteration_time_s == pytest.approx(cycle.step_s + cycle.waited_s / h)
    for send in cycle.sends:  # a fragment takes the owner's whole exchange over F
        assert send.end_s - send.start_s == pytest.approx(
            owner.exchange_s / result.plan.islands.fragments)


@pytest.mark.parametrize("name", CASES)
def test_inner_steps_follow_each_other_and_wait_only_where_an_exchange_is_applied(
        results, name) -> None:
    cycle = results[name].outer_cycle
    h = len(cycle.steps)
    assert [s.step for s in cycle.steps] == list(range(1, h + 1))
    assert cycle.steps[0].start_s == 0.0
    for before, after in zip(cycle.steps, cycle.steps[1:], strict=False):
        assert after.start_s == pytest.approx(before.end_s)
    for step in cycle.steps:
        assert step.end_s - step.start_s == pytest.approx(cycle.step_s + step.waited_s)
    applied = {(s.applied_after_step - 1) % h + 1 for s in cycle.sends}
    assert {s.step for s in cycle.steps if s.waited_s > 1e-12} <= applied
    for send in cycle.sends:  # sent once the step is computed, never before
        sent = cycle.steps[send.sent_after_step - 1]
        assert send.start_s >= sent.end_s - sent.waited_s - 1e-12


def test_diloco_sends_each_fragment_at_its_staggered_step_and_applies_it_h_over_f_later(
        results) -> None:
    blocking = results["diloco F=1"].outer_cycle
    assert [(s.fragment, s.sent_after_step, s.applied_after_step) for s in blocking.sends] \
        == [(0, 10, 10)]
    assert blocking.steps[-1].waited_s == pytest.approx(blocking.sends[0].end_s
                                                        - blocking.sends[0].start_s)
    streamed = results["diloco F=2, exchange longer than the overlap"].outer_cycle
    assert [(s.fragment, s.sent_after_step, s.applied_after_step) for s in streamed.sends] \
        == [(1, 5, 10), (0, 10, 15)]
    assert all(s.waited_s > 0.0 for s in streamed.sends)
    hidden = results["diloco F=2, exchange shorter than the overlap"].outer_cycle
    assert [s.applied_after_step for s in hidden.sends] == [100, 150]
    assert hidden.waited_s == 0.0


def test_bounded_applies_a_push_staleness_pushes_later(results) -> None:
    now = results["bounded staleness 0"].outer_cycle
    assert [(s.sent_after_step, s.applied_after_step) for s in now.sends] == [(10, 10)]
    stale = results["bounded staleness 1"].outer_cycle
    assert [(s.sent_after_step, s.applied_after_step) for s in stale.sends] == [(10, 20)]
    assert 0.0 < stale.waited_s < now.waited_s


def test_the_text_output_names_each_fragment_and_the_trace_has_an_exchange_lane(
        results, tmp_path) -> None:
    result = results["diloco F=2, exchange longer than the overlap"]
    files = write_outputs(result, tmp_path)
    text = _rendered(result, files)
    assert "outer cycle (diloco, H=10, " in text
    assert "fragment  sent after step  exchange s  applied after step  waited s" in text
    rows = [line.split() for line in text.splitlines() if line.split()[:2] in (["1", "5"],
                                                                               ["0", "10"])]
    assert [row[3] for row in rows] == ["10", "15"]
    assert str(files.outer) in text
    trace = read_trace(files.outer)
    assert trace.devices == ["inner steps", "outer exchange"]
    exchanges = [e for e in trace.events if e.device == "outer exchange"]
    assert {e.kind for e in exchanges} == {"outer_sync"}
    assert [(e.chunk, e.step) for e in exchanges] == [(1, 5), (0, 10)]
    assert sum(1 for e in trace.events if e.kind == "inner_step") == 10
    assert json.loads(json.dumps(result.summary()))["outer_cycle"]["sends"][0]["fragment"] == 1


def test_a_plan_without_islands_draws_nothing_and_shows_what_it_showed(tmp_path) -> None:
    result = simulate(_plan())
    assert result.outer_cycle is None and result.outer_s == 0.0
    files = write_outputs(result, tmp_path)
    assert files.outer is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["memory.png", "timeline.png",
                                                          "trace.json"]
    text = _rendered(result, files)
    assert "outer" not in text
    assert text.rstrip().endswith(f"wrote {files.timeline}, {files.memory}, {files.trace} "
                                  "(open in ui.perfetto.dev)")
    assert "outer_cycle" not in result.summary()


def _rendered(result, files) -> str:
    out = io.StringIO()
    render_summary(Console(file=out, width=1000, color_system=None), result, files)
    return out.getvalue()


def test_beyond_staleness_one_the_link_carries_one_push_per_period() -> None:
    """Staleness cannot hide more than the link carries: with 2 pushes in flight the drawn
    period is the exchange itself, and the owner charges that wait too."""
    result = simulate(_split(sync=SyncMethod.BOUNDED, inner_steps=10, staleness=2))
    cycle = result.outer_cycle
    exchange = outer_exchange(Cluster(TWO_DESKTOPS), result.plan, cycle.step_s)
    assert cycle.period_s == pytest.approx(exchange.exchange_s)
    assert cycle.waited_s == pytest.approx(exchange.exchange_s - 10 * cycle.step_s)
    assert cycle.waited_s == pytest.approx(10 * exchange.exposed_per_step_s)
    assert [(s.sent_after_step, s.applied_after_step) for s in cycle.sends] == [(10, 30)]
