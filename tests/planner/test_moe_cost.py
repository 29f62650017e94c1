"""What the cost model charges a mixture of experts: all experts' memory, the active ones'
FLOPs, every expert's weights read by the grouped GEMM, and the router's extra kernels."""

from __future__ import annotations

import pytest

from potluck.cluster import Cluster, parse_cluster
from potluck.model import counts
from potluck.model.loading import load_model, model_from_hf_config
from potluck.planner import formulas, gemm
from potluck.planner.compute import ComputeModel
from potluck.planner.evaluate import predict
from potluck.plans import Execution, Pipeline, Plan, Stage, TrainingShape

A100 = parse_cluster("nodes:\n  - name: box\n    gpu: a100-80g-sxm\n    gpus_per_node: 8\n",
                     "a100.yaml")


def _moe(experts: int, top_k: int = 2) -> object:
    return model_from_hf_config({
        "model_type": "mixtral", "hidden_size": 1024, "intermediate_size": 2048,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8,
        "num_local_experts": experts, "num_experts_per_tok": top_k, "vocab_size": 32000,
        "bos_token_id": 1, "eos_token_id": 2}, f"moe-{experts}")


def test_grouped_gemm_of_one_group_is_the_plain_gemm():
    args = (1e14, 2e12, 2, 108)
    assert gemm.grouped_gemm_time_s(1, 4096, 1024, 2048, *args) == pytest.approx(
        gemm.gemm_time_s(4096, 1024, 2048, *args))


def test_grouped_gemm_reads_every_group_and_pads_each_to_whole_tiles():
    args = (1e14, 2e12, 2, 108)
    one = gemm.gemm_time_s(64 * 8, 1024, 2048, *args)
    grouped = gemm.grouped_gemm_time_s(64, 8, 1024, 2048, *args)
    # 64 groups of 8 rows: 64 weight matrices read instead of one, rows padded to tiles
    weights_s = 2 * 64 * 1024 * 2048 / (2e12 * formulas.MEMORY_BANDWIDTH_EFFICIENCY)
    assert grouped >= weights_s > one


def test_experts_cost_memory_in_full_and_compute_by_top_k():
    few, many = _moe(8), _moe(64)
    assert counts.block_forward_flops(few, 1, 2048) == pytest.approx(
        counts.block_forward_flops(many, 1, 2048) - 2 * 2048 * 1024 * 56)  # the router's columns
    assert counts.block_params(many) > 7 * counts.block_params(few) / 2
    device = Cluster(A100).devices[0].type
    small, large = (ComputeModel(m, 2048).block_times(device, 1, 1, counts.Recompute.NONE)
                    for m in (few, many))
    assert large.forward_s > small.forward_s  # 64 experts' weights read for the same tokens


def test_a_moe_block_has_a_higher_host_floor_than_a_dense_one():
    dense = load_model("llama2-7b")
    moe = _moe(8)
    execution = Execution()
    assert (ComputeModel(moe, 16, execution=execution).block_host_s
            > ComputeModel(dense, 16, execution=execution).block_host_s == execution.block_host_s)


def test_a_moe_plan_holds_every_expert_in_memory():
    model = load_model("mixtral-8x7b")
    stage = Stage(devices=("box.0:0",), layer_ranges=((0, 32),))
    plan = Plan(A100, model, TrainingShape(8, 1024), (Pipeline((stage,), 1, 8),))
    weights = predict(plan).memory[0].weights_bytes
    assert weights >= 2 * counts.total_params(model)  # 46.7B parameters, not the 12.9B active
