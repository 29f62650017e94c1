"""The exchange across islands on emulated time: each rank's clock stretches it to the
planner's prediction over the slow link (planner/islands/exchange.py), blocking or overlapped."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from potluck import api
from potluck.cluster import Cluster
from potluck.cluster.spec import parse_cluster
from potluck.ops import OpKind
from potluck.planner.islands.exchange import outer_exchange
from potluck.plans import Compression, Islands
from potluck.runtime.layout import Layout
from potluck.runtime.timing.clock import CommOp
from potluck.runtime.timing.emulate import EmulationClock, OpTargets
from potluck.runtime.timing.recorder import TRACE_FILE
from potluck.runtime.timing.targets import RankTargets, rank_targets
from potluck.traces import read_trace

TWO_MACHINES = parse_cluster(
    "nodes:\n"
    "  - {name: left, gpu: cpu, gpus_per_node: 1}\n"
    "  - {name: right, gpu: cpu, gpus_per_node: 1}\n"
    "links:\n"
    "  - {between: [left, right], bandwidth: 10Mb/s, latency: 1ms}\n", "two.yaml")


def _diloco(**islands):
    plan = api.plan(TWO_MACHINES, "tiny-llama", global_batch=4, seq_len=32, dtype="fp32",
                    options=api.search_options(sync="diloco", tp=1, pp=1, top_k=1)).best
    return replace(plan, islands=replace(plan.islands, **islands))


class _Done:
    def wait(self) -> None:
        return None


def test_a_ranks_exchange_targets_add_up_to_the_planners_exchange():
    """Every parameter unit's share, summed, is the planner's whole exchange over the link."""
    plan = _diloco(compression=Compression.NONE)
    whole_s = outer_exchange(Cluster(plan.cluster), plan, 1.0).exchange_s
    targets = rank_targets(plan, Layout(plan, 0, plan.devices)).outer_s
    assert whole_s > 0.5  # an FP32 pseudo-gradient over 10 Mb/s
    assert sum(targets.values()) == pytest.approx(whole_s)
    synchronous = replace(plan, islands=Islands())
    assert rank_targets(synchronous, Layout(synchronous, 0, plan.devices)).outer_s == {}


def test_an_exchange_lasts_its_dilated_time_and_overlaps_what_runs_meanwhile():
    """Waiting at once (blocking DiLoCo) lasts the dilated prediction; two exchanges queue on
    the outer channel; one started before the inner steps it overlaps is waited for less."""
    clock = EmulationClock(RankTargets({0: OpTargets(0.0, 0.0)}, outer_s={"block.0": 0.05}),
                           dilation=2.0)
    op = CommOp(OpKind.OUTER_SYNC, -1, ("block.0",))
    began = time.perf_counter()
    clock.start_comm(op, _Done()).wait()
    blocking_s = time.perf_counter() - began
    assert blocking_s >= 0.1
    began = time.perf_counter()
    first, second = clock.start_comm(op, _Done()), clock.start_comm(op, _Done())
    second.wait()
    assert time.perf_counter() - began >= 0.2
    first.wait()
    started = clock.start_comm(op, _Done())
    time.sleep(0.1)  # the inner steps it overlaps
    began = time.perf_counter()
    started.wait()
    assert time.perf_counter() - began < blocking_s


def test_an_emulated_outer_step_takes_the_exchanges_time_on_the_link(tmp_path):
    """Two one-rank islands over 10 Mb/s, H=2, blocking FP32 exchange, dilation 1: the step
    with the outer step lasts at least the planner's exchange; the inner step before it
    does not (it is a small fraction of it); the trace shows the exchange on each rank."""
    plan = _diloco(inner_steps=2, fragments=1, compression=Compression.NONE)
    whole_s = outer_exchange(Cluster(plan.cluster), plan, 1.0).exchange_s
    options = api.train_options(steps=2, emulate=True, dilation=1.0, progress=False,
                                out=tmp_path, trace_steps=2)
    history = api.run_plan(plan, options).history
    assert [m.outer_step for m in history] == [0, 1]
    assert history[1].step_time_s >= whole_s
    assert history[0].step_time_s < whole_s
    exchanges = [e for e in read_trace(tmp_path / TRACE_FILE).events if e.kind == "outer_sync"]
    assert len({e.device for e in exchanges}) == 2
    assert all(e.step == 1 for e in exchanges)
    assert max(e.duration_s for e in exchanges) >= whole_s * 0.5
