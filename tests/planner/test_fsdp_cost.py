"""What FSDP-style frameworks change in the cost model: the fused loss, ZeRO-3's root unit,
its gradient accumulation into the shard and its backward collectives, each against a
hand-computed figure.

The device and model are test_cost.py's toy: 1000 GB/s of memory bandwidth (80% usable), a
GPT-style model of h = 1024, 4 blocks, vocabulary 8192, untied head, trained in BF16 on
sequences of 1024 tokens.
"""

import pytest
from test_cost import (
    EMBEDDING_PARAMS,
    HEAD_PARAMS,
    LAYERS,
    MEMORY_BW,
    SEQ,
    TOY,
    TOY_CLUSTER,
    VOCAB,
)

from potluck.cluster import Cluster, parse_cluster
from potluck.planner.cost import CostModel, StageShape
from potluck.planner.evaluate import stage_shape
from potluck.planner.formulas import StateSharding
from potluck.plans import Execution, Pipeline, Plan, Stage, TrainingShape

ZERO3 = StateSharding.of(4, 3)


def _cost(**traits) -> CostModel:
    return CostModel(Cluster(parse_cluster(TOY_CLUSTER)), TOY, SEQ, execution=Execution(**traits))


def _device():
    return Cluster(parse_cluster(TOY_CLUSTER)).device("box.0:0").type


def test_a_fused_loss_reads_the_logits_once_per_pass_where_eager_moves_12_bytes():
    """Eager: FP32 log-softmax and NLL, 12 bytes per logit in each pass. Fused (flash-attn's
    CrossEntropyLoss): 2 bytes (read the 16-bit logits) forward, 4 (read them, write their
    gradient) backward."""
    b, device = 2, _device()
    logits = b * SEQ * VOCAB
    eager = _cost().head_times(device, 1, b)
    fused = _cost(fused_loss=True).head_times(device, 1, b)
    assert eager.forward_s - fused.forward_s == pytest.approx((12 - 2) * logits / MEMORY_BW)
    assert eager.backward_s - fused.backward_s == pytest.approx((12 - 4) * logits / MEMORY_BW)
    assert fused.weight_grad_s == eager.weight_grad_s  # the projection's GEMMs are the same


def test_zero3_root_unit_holds_embedding_and_head_gathered_with_their_gradient():
    """FSDP1's root FlatParameter (torchtitan's fully_shard(model)): the embedding and head
    in 16 bits, and their full-size 16-bit gradient, for the whole step, on top of the two
    gathered blocks; a stage without them holds none."""
    device = _device()
    whole = StageShape(LAYERS, first=True, last=True)
    own, root = _cost(), _cost(zero3_root_unit=True)
    extra = root.zero_working_bytes(device, 1, whole, ZERO3) - own.zero_working_bytes(
        device, 1, whole, ZERO3)
    assert extra == pytest.approx(2 * 2 * (EMBEDDING_PARAMS + HEAD_PARAMS))
    middle = StageShape(2, pp=3)
    assert root.zero_working_bytes(device, 1, middle, ZERO3) == own.zero_working_bytes(
        device, 1, middle, ZERO3)
    zero2 = StateSharding.of(4, 2)  # gradients sharded, weights whole: no gathered root
    assert root.zero_working_bytes(device, 1, whole, zero2) == own.zero_working_bytes(
        device, 1, whole, zero2)


def test_zero3_sums_each_micro_batchs_gradients_into_the_shard():
    """Per micro-batch: no cast where the reduce-scatter moves 16 bits, then the shard's FP32
    sum (read 4 and the reduced 2, write 4) over 1/4 of the parameters; with an FP32
    reduce-scatter the 16-bit gradient is first cast (read 2, write 4)."""
    device, params = _device(), 1e9
    bf16 = _cost(grad_reduce_bytes=2).grad_accumulation_s(device, params, 4)
    fp32 = _cost(grad_reduce_bytes=4).grad_accumulation_s(device, params, 4)
    assert bf16 == pytest.approx(params * (4 + 2 + 4) / 4 / MEMORY_BW)
    assert fp32 == pytest.approx(params * (2 + 4 + (4 + 4 + 4) / 4) / MEMORY_BW)
    unsharded = _cost().grad_accumulation_s(device, params)
    assert unsharded == pytest.approx(params * 10 / MEMORY_BW)  # the FP32 main_grad add


def test_zero3_backward_gathers_and_reduce_scatters_on_one_ring():
    """Each block's weights gathered again (2 bytes each) and its gradient reduce-scattered
    (grad_reduce_bytes each), one after the other on the same ring; without overlap the
    reduction waits for the backward and only the gathers share it."""
    device, gather = _device(), 0.01
    assert _cost(grad_reduce_bytes=4).zero3_backward_comm_s(device, gather) == pytest.approx(
        gather * (1 + 4 / 2))
    assert _cost(grad_reduce_bytes=2).zero3_backward_comm_s(device, gather) == pytest.approx(
        2 * gather)
    assert _cost(overlap_grad_reduce=False).zero3_backward_comm_s(device, gather) == gather


def test_a_zero3_stage_knows_its_shards():
    spec = parse_cluster(TOY_CLUSTER, "toy.yaml")
    pipelines = tuple(Pipeline((Stage((d,), ((0, LAYERS),)),), 1, 1)
                      for d in ("box.0:0", "box.0:1", "box.1:0", "box.1:1"))
    plan = Plan(spec, TOY, TrainingShape(4, SEQ), pipelines, zero=3)
    assert stage_shape(plan, 0, 0).parameter_shards == 4
    assert stage_shape(Plan(spec, TOY, TrainingShape(4, SEQ), pipelines, zero=1),
                       0, 0).parameter_shards == 1


# 64 A100-SXM4 80GB with the memory the card holds (benchmarks/data/llmfoundry_a100_80g.yaml:
# 80 GiB less the driver's reservation); the interconnect does not matter for the fit
A100_80G_64 = """
devices:
  a100-80g-sxm: {memory: 85.36GB}
nodes:
  - {name: a100x8, gpu: a100-80g-sxm, gpus_per_node: 8, count: 8, inter_bandwidth: 1600Gb/s}
"""


@pytest.mark.parametrize(("model", "micro_batch", "recompute"), [
    ("llama2-13b", 2, "none"), ("llama2-70b", 2, "full")])
def test_torchtitans_published_fsdp_runs_fit(model, micro_batch, recompute):
    """torchtitan's FSDP2 runs on 64 A100 80GB (docs/performance.md at 6aac938, 2024-04:
    LLaMA 13B at local batch 2 without activation checkpointing, 2162 tokens/s per GPU; 70B at
    2 with full checkpointing, 353), sequences of 4096 (train_configs/llama_13b.toml,
    llama_70b.toml): ZeRO-3 layouts that ran, so they fit."""
    from potluck import api

    plan = api.plan(parse_cluster(A100_80G_64), model, global_batch=64 * micro_batch,
                    seq_len=4096, execution="torchtitan", zero=3, tp=1, pp=1, dp=64,
                    micro_batch_size=micro_batch, recompute=recompute, swap="none",
                    offload="none", top_k=1).best
    assert plan.zero == 3 and plan.dp == 64
    memory = plan.prediction.memory[0]
    assert memory.offloaded_bytes == 0 and memory.swapped_out_bytes == 0
