"""What expert parallelism changes in the cost model and the search: a device holds and
updates its share of the routed experts, runs fewer experts on more rows each, sums their
gradients with the replicas of its shard only, and pays two all-to-alls per block and pass,
priced by pairwise exchange over the busiest link or network card."""

from __future__ import annotations

import pytest

from potluck import api
from potluck.cluster import Cluster, parse_cluster
from potluck.errors import ConfigError
from potluck.model import counts
from potluck.model.loading import load_model, model_from_hf_config
from potluck.planner import formulas
from potluck.planner.cost import CostModel
from potluck.planner.evaluate import gradient_groups, predict
from potluck.planner.network import Network
from potluck.plans import (
    Pipeline,
    Plan,
    Stage,
    TrainingShape,
    check_plan,
    plan_from_dict,
    plan_to_dict,
)

TWO_BOXES = parse_cluster(
    "nodes:\n  - name: box\n    gpu: a100-80g-sxm\n    gpus_per_node: 4\n    count: 2\n"
    "    inter_bandwidth: 10Gb/s\n", "two.yaml")


def _moe(experts: int = 8) -> object:
    return model_from_hf_config({
        "model_type": "mixtral", "hidden_size": 1024, "intermediate_size": 2048,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8,
        "num_local_experts": experts, "num_experts_per_tok": 2, "vocab_size": 32000,
        "bos_token_id": 1, "eos_token_id": 2}, f"moe-{experts}")


def _plan(model, devices: list[str], ep: int, micro_batches: int = 4) -> Plan:
    pipelines = tuple(Pipeline((Stage((d,), ((0, model.num_layers),)),), 1, micro_batches)
                      for d in devices)
    shape = TrainingShape(len(devices) * micro_batches, 1024)
    return Plan(TWO_BOXES, model, shape, pipelines, expert_parallel=ep)


def test_a_device_holds_its_share_of_the_experts_and_all_of_the_rest():
    model = _moe()
    devices = ["box.0:0", "box.0:1"]
    whole, split = (predict(_plan(model, devices, ep)).memory[0] for ep in (1, 2))
    experts = model.num_layers * counts.routed_expert_params(model) / 2
    bytes_per_param = whole.weights_bytes / counts.total_params(model)
    assert whole.weights_bytes - split.weights_bytes == pytest.approx(experts * bytes_per_param)
    assert whole.optimizer_bytes - split.optimizer_bytes == pytest.approx(
        experts * whole.optimizer_bytes / counts.total_params(model))


def test_fewer_experts_per_device_read_fewer_weights_for_the_same_rows():
    model = _moe(64)
    ep1, ep4 = counts.block_gemms(model), counts.block_gemms(model, 4)
    routed = [(a, b) for a, b in zip(ep1, ep4, strict=True) if a.groups > 1]
    assert routed and all(b.groups == a.groups // 4 for a, b in routed)
    rows = 4096
    for a, b in routed:  # the same rows in all, four times as many per expert
        assert b.shape(rows, 1)[0] == 4 * a.shape(rows, 1)[0]


def test_the_exchange_crosses_the_network_card_once_per_peer_on_another_machine():
    cluster = Cluster(TWO_BOXES)
    network = Network(cluster)
    a, b, c = cluster.device("box.0:0"), cluster.device("box.1:0"), cluster.device("box.0:1")
    link = cluster.link(a, b)
    num_bytes = 8e6
    expected = formulas.pairwise_alltoall_time_s(num_bytes, 2, link.bandwidth_bytes_per_s,
                                                 link.latency_s)
    assert network.alltoall_s(num_bytes, [a, b]) == pytest.approx(expected)
    assert expected == pytest.approx(link.latency_s + num_bytes / 2 / link.bandwidth_bytes_per_s)
    # two members of one machine both send half their bytes through its one card
    crossing = network.alltoall_s(num_bytes, [a, c, b, cluster.device("box.1:1")])
    assert crossing == pytest.approx(
        3 * link.latency_s + 2 * 2 * (num_bytes / 4) / link.bandwidth_bytes_per_s)
    assert network.alltoall_s(num_bytes, [a, c]) < crossing / 10  # NVLink, not the network


def test_the_exchange_is_charged_per_block_and_shown_in_the_breakdown():
    model = _moe()
    near, far = (predict(_plan(model, devices, 2)) for devices in
                 (["box.0:0", "box.0:1"], ["box.0:0", "box.1:0"]))
    assert 0 < near.breakdown.ep_s < far.breakdown.ep_s
    assert far.iteration_time_s > near.iteration_time_s
    assert predict(_plan(model, ["box.0:0", "box.0:1"], 1)).breakdown.ep_s == 0


def test_expert_gradients_are_summed_over_the_replicas_of_their_shard():
    model = _moe()
    plan = _plan(model, ["box.0:0", "box.0:1", "box.1:0", "box.1:1"], 2)
    groups = gradient_groups(CostModel.for_plan(plan), plan)
    members = sorted(tuple(k for k, _ in g.members) for g in groups)
    assert members == [(0, 1, 2, 3), (0, 2), (1, 3)]
    experts = model.num_layers * counts.routed_expert_params(model) / 2
    by_members = {tuple(k for k, _ in g.members): g.grad_bytes for g in groups}
    assert by_members[(0, 2)] == by_members[(1, 3)] == pytest.approx(2 * experts)  # bf16


def test_a_pinned_degree_plans_lockstep_replicas_and_a_dense_model_is_refused():
    model = _moe()
    result = api.plan(TWO_BOXES, model, global_batch=16, seq_len=512, ep=2, top_k=2)
    for plan in result.plans:
        assert plan.ep == 2
        check_plan(plan)  # lockstep groups, experts divided
        assert plan_from_dict(plan_to_dict(plan)).ep == 2  # kept in the plan file
    with pytest.raises(ConfigError, match="has none") as err:
        api.plan(TWO_BOXES, load_model("llama3.2-1b"), global_batch=16, seq_len=512, ep=2)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="does not divide"):
        api.plan(TWO_BOXES, model, global_batch=16, seq_len=512, ep=3)


def test_the_search_chooses_expert_parallelism_where_it_is_faster():
    """Qwen3-30B-A3B on the demo cluster: pairs of replicas splitting its 128 experts beat
    one deep pipeline (each device holds half the experts: fewer stages, a shorter
    optimizer step); the search goes past its first memory level to find them."""
    result = api.plan("src/potluck/examples/mixed.yaml", "qwen3-30b-a3b", top_k=2)
    assert result.best.ep > 1
    pinned = api.plan("src/potluck/examples/mixed.yaml", "qwen3-30b-a3b", ep=1, top_k=1)
    assert result.best.prediction.iteration_time_s < pinned.best.prediction.iteration_time_s
