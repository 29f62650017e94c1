"""A cluster of several vendors is planned as islands of one vendor each, joined through host
memory: no synchronous plan joins NVIDIA and AMD GPUs (no backend does)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_plans_pass_runtime_checks import MODELS, _module, check_runs

from potluck import api
from potluck.cluster import Cluster, parse_cluster
from potluck.errors import ConfigError
from potluck.planner.cost import CostModel
from potluck.planner.evaluate import stage_shape
from potluck.planner.islands.exchange import outer_exchange
from potluck.planner.islands.planning import _one_job
from potluck.planner.islands.split import candidate_splits
from potluck.planner.search import SearchResult
from potluck.plans import Pipeline, Plan, Stage, TrainingShape, Transport
from potluck.plans.vendors import vendors_problem
from potluck.runtime.launch.gpus import world_backend

NV_AMD = parse_cluster("""
nodes:
  - {name: nv, gpu: rtx4090, gpus_per_node: 2, inter_bandwidth: 100Gb/s}
  - {name: amd, gpu: mi250, gpus_per_node: 2, inter_bandwidth: 100Gb/s}
""", "nv-amd.yaml")


def _vendors(plan, island: int) -> set[str]:
    cluster = Cluster(plan.cluster)
    return {cluster.device(d).type.vendor.value for k in plan.islands.members(island, plan.dp)
            for d in plan.pipelines[k].devices}


def test_a_fast_network_of_two_vendors_still_splits_by_vendor():
    """100 Gb/s between the machines is no gap and no slow network: one island per vendor."""
    splits = candidate_splits(Cluster(NV_AMD))
    assert [s.islands for s in splits] == [(("nv.0",), ("amd.0",))]


def test_potluck_plan_makes_each_vendor_an_island_over_host_memory():
    result = api.plan(NV_AMD, MODELS["tiny-llama"], global_batch=16, seq_len=128)
    best = result.best
    assert best.islands.split and best.islands.count == 2
    assert [_vendors(best, k) for k in range(2)] == [{"nvidia"}, {"amd"}]
    assert all(i.transport is Transport.HOST for i in best.islands.islands)
    assert vendors_problem(best) is None and world_backend(best, emulate=False) == "gloo"
    assert any("islands of one vendor each" in note for note in best.notes)
    for plan in result.plans:
        check_runs(plan, _module("tiny-llama"))
        assert vendors_problem(plan) is None


def test_a_host_staged_exchange_lasts_the_slowest_ranks_two_host_copies_longer():
    """Each GPU rank copies its pseudo-gradient down at the wire's width and the sum back in
    FP32 over its own host link: the exchange over the backend plus the slowest of those."""
    best = api.plan(NV_AMD, MODELS["tiny-llama"], global_batch=16, seq_len=128).best
    cluster, cost = Cluster(best.cluster), CostModel.for_plan(best)
    over_backend = replace(best, islands=replace(best.islands, islands=tuple(
        replace(island, transport=Transport.BACKEND) for island in best.islands.islands)))
    per_value = best.islands.compression.bytes_per_value + 4.0
    copies_s = [cost.stage_params(replace(stage_shape(best, k, i), parameter_shards=1),
                                  len(stage.devices)) * per_value
                / cluster.host_bandwidth_bytes_per_s(cluster.device(d))
                for k, pipeline in enumerate(best.pipelines)
                for i, stage in enumerate(pipeline.stages) for d in stage.devices]
    staged = outer_exchange(cluster, best, 1.0).exchange_s
    assert min(copies_s) > 0.0
    assert staged == pytest.approx(outer_exchange(cluster, over_backend, 1.0).exchange_s
                                   + max(copies_s))


def test_sync_pinned_on_two_vendors_is_one_line():
    with pytest.raises(ConfigError, match="share no backend") as err:
        api.plan(NV_AMD, MODELS["tiny-llama"], options=api.search_options(sync="sync"),
                 global_batch=16, seq_len=128)
    assert "\n" not in str(err.value)



NV_CPU = parse_cluster("""
nodes:
  - {name: nv, gpu: rtx4090, gpus_per_node: 2}
  - {name: box, gpu: cpu, gpus_per_node: 1}
""", "nv-cpu.yaml")


def test_where_no_island_of_one_vendor_holds_the_model_todays_search_plans():
    """A 1.3B model fits no 8 GB CPU box: no split by vendor, so today's search, which
    leaves the box out (one vendor: nothing to note)."""
    result = api.plan(NV_CPU, "gpt3-1.3b", global_batch=8, seq_len=256)
    assert not result.best.islands.split and result.best.unused_devices == ("box.0:0",)
    assert vendors_problem(result.best) is None
    assert not any("runs only emulated" in note for note in result.notes)


def test_a_plan_of_todays_search_that_joins_two_vendors_says_it_runs_only_emulated():
    model = MODELS["tiny-llama"]
    stages = tuple(Stage((d,), ((0, model.num_layers),)) for d in ("nv.0:0", "box.0:0"))
    mixed = Plan(NV_CPU, model, TrainingShape(4, 64), (Pipeline(stages[:1], 1, 2),
                                                       Pipeline(stages[1:], 1, 2)))
    noted = _one_job(SearchResult((mixed,), 1, 0.0), mixed=True)
    assert any("runs only emulated (--emulate)" in note and "in one synchronous job" in note
               for note in noted.notes)
