"""A cluster of several vendors is planned as islands of one vendor each, joined through host
memory: no synchronous plan joins NVIDIA and AMD GPUs (no backend does)."""

from __future__ import annotations

import pytest
from test_plans_pass_runtime_checks import MODELS, _module, check_runs

from potluck import api
from potluck.cluster import Cluster, parse_cluster
from potluck.errors import ConfigError
from potluck.planner.islands.split import candidate_splits
from potluck.plans import Transport
from potluck.plans.feasibility import vendors_problem
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


def test_sync_pinned_on_two_vendors_is_one_line():
    with pytest.raises(ConfigError, match="share no backend") as err:
        api.plan(NV_AMD, MODELS["tiny-llama"], options=api.search_options(sync="sync"),
                 global_batch=16, seq_len=128)
    assert "\n" not in str(err.value)
