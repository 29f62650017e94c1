"""The cost model: time and memory of whole plans, checked against hand-computed values.

The expected values are worked out here from first principles, not with the cost model:
a made-up device with round figures (``toy``: 100 TFLOP/s at 50% matmul efficiency,
1000 GB/s of memory bandwidth, 32 SMs), two machines of two joined by 8 Gb/s, and a small
GPT-style model (h = 1024, ffn = 4h, 8 heads, vocabulary 8192, no biases, no dropout,
untied head) trained on sequences of 1024 tokens in BF16. Shapes are chosen so that every
GEMM is compute-bound and fills whole waves of the 32 SMs (so wave quantization costs
nothing), and a block's forward is far above the kernel-dispatch floor.
"""

import pytest

from potluck.cluster import Cluster, parse_cluster
from potluck.model import load_model
from potluck.model.counts import Recompute
from potluck.model.spec import MlpKind, ModelSpec, NormKind
from potluck.planner import compute, formulas
from potluck.planner.cost import CostModel
from potluck.planner.evaluate import predict
from potluck.planner.gemm import effective_dtype
from potluck.plans import DType, Execution, Pipeline, Plan, Stage, TrainingShape

TWO_BOXES = """
nodes:
  - {name: box, gpu: rtx3090, gpus_per_node: 4, count: 2, nvlink: pairs, inter_bandwidth: 10Gb/s}
"""

# ---- the toy device, cluster and model, and their costs by hand ---------------------------

TOY_CLUSTER = """
devices:
  toy: {tflops: 100, memory: 80GB, memory_bandwidth: 1000GB/s, matmul_efficiency: 0.5, sm_count: 32}
nodes:
  - {name: box, gpu: toy, gpus_per_node: 2, count: 2, nvlink: none, intra_bandwidth: 20GB/s,
     intra_latency: 10us, inter_bandwidth: 8Gb/s, inter_latency: 50us}
"""
H, FFN, HEADS, VOCAB, SEQ, LAYERS = 1024, 4096, 8, 8192, 1024, 4
TOY = ModelSpec(name="toy", family="gpt2", hidden_size=H, num_layers=LAYERS, num_heads=HEADS,
                num_kv_heads=HEADS, ffn_hidden_size=FFN, vocab_size=VOCAB, max_seq_len=SEQ,
                mlp=MlpKind.GELU, norm=NormKind.LAYERNORM)

GEMM_FLOPS = 100e12 * 0.5  # achievable FLOP/s: peak x matmul efficiency
FLASH_FLOPS = GEMM_FLOPS * 0.73 / 0.87  # FlashAttention-2's forward: 73% of peak where GEMMs reach 87%
MEMORY_BW = 1000e9 * 0.8  # plan on 80% of the advertised memory bandwidth
NETWORK_BW, NETWORK_LATENCY = 8e9 / 8, 50e-6  # 8 Gb/s between the machines
PCIE_BW, PCIE_LATENCY = 20e9, 10e-6  # inside a machine
RUNTIME_OVERHEAD = 1e9  # CUDA context, cuBLAS and NCCL workspaces on every GPU

# Parameters: Q, K, V and output projections 4h^2; fc1 and fc2 2*h*ffn; two LayerNorms of 2h.
BLOCK_PARAMS = 4 * H * H + 2 * H * FFN + 2 * 2 * H  # 12,587,008
EMBEDDING_PARAMS = VOCAB * H
HEAD_PARAMS = 2 * H + VOCAB * H  # final LayerNorm, output projection (not tied)
MODEL_PARAMS = LAYERS * BLOCK_PARAMS + EMBEDDING_PARAMS + HEAD_PARAMS  # 67,127,296

# Bytes per parameter: BF16 weights (2), their gradients summed over micro-batches in FP32 (4),
# the FP32 master and Adam's two FP32 moments (12). Adam's step reads and writes about 36 bytes
# per parameter.
WEIGHT_BYTES, GRAD_BYTES, ADAM_BYTES, ADAM_TRAFFIC = 2, 4, 12, 36
STATE_BYTES = WEIGHT_BYTES + GRAD_BYTES + ADAM_BYTES  # 18


def block_s(b: int) -> tuple[float, float, float]:
    """One block's forward, backward and weight-gradient seconds for ``b`` sequences, on one toy."""
    tokens = b * SEQ
    # QKV, output projection, fc1, fc2: 2 FLOPs per multiply-add. All compute-bound: the QKV
    # GEMM of one sequence does 6.4 GFLOP (129 us) and moves 14.7 MB (18 us). Output tiles of
    # 256 x 128: 4b row tiles x (24, 8, 32, 8) column tiles, whole waves of 32 SMs.
    gemms = 2 * tokens * (H * 3 * H + H * H + H * FFN + FFN * H) / GEMM_FLOPS
    # FlashAttention: QK^T and AV, 2*b*s^2*h FLOPs each, half of them masked (causal); 2.1 GFLOP
    # per sequence (51 us) against 8 bytes per token and hidden unit read and written (10 us).
    attention = 4 * b * SEQ**2 * H * 0.5 / FLASH_FLOPS
    # Eager element-wise traffic in BF16: two LayerNorms 12 B per element, two residual adds 6,
    # the attention output's transpose 4, GPT-2's GeLU (eight ops) 36 B per ffn element.
    elementwise = ((2 * 12 + 2 * 6 + 4) * tokens * H + 36 * tokens * FFN) / MEMORY_BW
    forward = gemms + attention + elementwise
    # Backward: the GEMMs twice (input and weight gradients), the element-wise traffic twice,
    # FlashAttention's backward 2.5x its forward FLOPs at 63% of peak instead of 73% (measured
    # at 16k keys per query), slowed at 512 causal keys per query by its fixed start per key
    # block, worth 256 keys: 512 / (512 + 256) of the rate it has at 16384 / (16384 + 256).
    rolloff = (512 / (512 + 256)) / (16384 / (16384 + 256))
    backward = 2 * gemms + attention * 2.5 * 0.73 / 0.63 / rolloff + 2 * elementwise
    return forward, backward, gemms


def head_s(b: int) -> tuple[float, float]:
    """The head's forward and backward seconds: output projection (4b x 64 tiles of 256 x 128), and the
    loss reading and writing the FP32 logits about three times (12 bytes per logit)."""
    tokens = b * SEQ
    projection = 2 * tokens * H * VOCAB / GEMM_FLOPS
    loss = 12 * tokens * VOCAB / MEMORY_BW
    return projection + loss, 2 * projection + loss


def adam_s(params: float) -> float:
    return ADAM_TRAFFIC * params / MEMORY_BW


def accumulate_s(params: float) -> float:
    """Each micro-batch's 16-bit weight gradients (read 2 bytes per parameter) added into
    their FP32 sum (read 4, write 4): 10 bytes per parameter."""
    return 10 * params / MEMORY_BW


def ring_allreduce_s(num_bytes: float, ranks: int, bandwidth: float, latency: float) -> float:
    """Ring all-reduce (Patarasuk & Yuan 2009): 2(g-1)/g * n/W + 2(g-1) * alpha."""
    return 2 * (ranks - 1) / ranks * num_bytes / bandwidth + 2 * (ranks - 1) * latency


def block_activation_bytes(b: int) -> float:
    """What one eager Hugging Face GPT-2 block keeps for its backward per micro-batch (SDPA,
    no dropout), in 16-bit bytes: per token and hidden unit the two LayerNorms' inputs and
    outputs 2*2*2, the fused QKV output 3*2 (Q, K and V are views of it: training keeps no
    key/value cache), the attention output 2, gelu_new's four tensors and its output 5*2*4
    (ffn = 4h): 56; per token the LayerNorms' mean and rstd 2*2*2 and a log-sum-exp per head
    2*HEADS."""
    return 56 * b * SEQ * H + (8 + 2 * HEADS) * b * SEQ


def head_activation_bytes(b: int) -> float:
    """The final LayerNorm's input, output (the projection's input), mean and rstd, the
    logits and the loss's log-softmax output (4 bytes per logit in all)."""
    return 2 * 2 * b * SEQ * H + 2 * 2 * b * SEQ + 4 * b * SEQ * VOCAB


def toy_plan(pipelines, zero=0):
    spec = parse_cluster(TOY_CLUSTER, "toy.yaml")
    batch = sum(p.batch_share for p in pipelines)
    return Plan(spec, TOY, TrainingShape(batch, SEQ), tuple(pipelines), zero=zero)


def toy_device():
    return Cluster(parse_cluster(TOY_CLUSTER, "toy.yaml")).device("box.0:0").type


def test_one_block_forward_and_backward_on_a_compute_bound_device():
    forward, backward, gemms = block_s(1)
    times = CostModel(Cluster(parse_cluster(TOY_CLUSTER)), TOY, SEQ).block_times(
        toy_device(), 1, 1, Recompute.NONE)
    assert times.forward_s == pytest.approx(forward, rel=1e-9)
    assert times.backward_s == pytest.approx(backward, rel=1e-9)
    assert times.weight_grad_s == pytest.approx(gemms, rel=1e-9)
    # forward: 515 us of GEMMs, 51 us of attention, 241 us of element-wise traffic, far above
    # the dispatch floor of 24 eager kernels x 8 us = 192 us; backward: 2 x 515 + 219 + 2 x 241
    # (FlashAttention's backward: 148 us at its long-sequence rate, 1.48x that at 512 keys)
    assert times.forward_s == pytest.approx(808e-6, rel=1e-3)
    assert times.backward_s == pytest.approx(1732e-6, rel=1e-3)


def test_a_tiny_block_costs_what_dispatching_its_eager_kernels_costs():
    """The host launches 24 eager kernels per block forward at 8 us each (twice as many in the
    backward): a floor that a block of 64 tokens and hidden size 64 (6.3 MFLOP, 0.1 us) hits."""
    tiny = ModelSpec(name="tiny", family="gpt2", hidden_size=64, num_layers=1, num_heads=4,
                     num_kv_heads=4, ffn_hidden_size=256, vocab_size=64, max_seq_len=64,
                     mlp=MlpKind.GELU, norm=NormKind.LAYERNORM)
    times = CostModel(Cluster(parse_cluster(TOY_CLUSTER)), tiny, 64).block_times(
        toy_device(), 1, 1, Recompute.NONE)
    assert times.forward_s == pytest.approx(24 * 8e-6)
    assert times.backward_s == pytest.approx(2 * 24 * 8e-6)


def test_a_single_device_plan_is_micro_batches_times_forward_plus_backward():
    """One stage holding everything: 4 micro-batches of 2 sequences, then Adam over the model."""
    plan = toy_plan([Pipeline((_stage(["box.0:0"], 0, LAYERS),), 2, 4)])
    prediction = predict(plan)
    (block_forward, block_backward, _), (head_forward, head_backward) = block_s(2), head_s(2)
    micro_batch = (LAYERS * (block_forward + block_backward) + head_forward + head_backward
                   + accumulate_s(MODEL_PARAMS))
    iteration = 4 * micro_batch + adam_s(MODEL_PARAMS)
    assert prediction.iteration_time_s == pytest.approx(iteration, rel=1e-9)
    assert prediction.tokens_per_s == pytest.approx(8 * SEQ / iteration, rel=1e-9)
    assert prediction.breakdown.bubble_s == pytest.approx(0.0, abs=1e-12)


def test_1f1b_of_two_unequal_stages_with_a_send_between_machines():
    """Stage 0 (embedding, 1 block) on one machine, stage 1 (3 blocks, head) on the other,
    4 micro-batches of one sequence. SC'21: T = sum_i (f_i + b_i) + (m - 1) max_i (f_i + b_i);
    torch's 1F1B waits for its transfers, so each stage's f + b gains one send per micro-batch
    (half of it the transfer in, half the transfer out)."""
    plan = toy_plan([Pipeline((_stage(["box.0:0"], 0, 1), _stage(["box.1:0"], 1, 4)), 1, 4)])
    prediction = predict(plan)
    (block_forward, block_backward, _), (head_forward, head_backward) = block_s(1), head_s(1)
    last_params = 3 * BLOCK_PARAMS + HEAD_PARAMS  # more than the first stage's
    first = block_forward + block_backward + accumulate_s(BLOCK_PARAMS + EMBEDDING_PARAMS)
    last = 3 * (block_forward + block_backward) + head_forward + head_backward + accumulate_s(
        last_params)
    send = NETWORK_LATENCY + SEQ * H * 2 / NETWORK_BW  # one sequence's BF16 activations: 2.15 ms
    pipeline = (first + send) + (last + send) + (4 - 1) * (last + send)
    assert prediction.iteration_time_s == pytest.approx(pipeline + adam_s(last_params), rel=1e-9)
    assert list(prediction.stage_times_s[0]) == pytest.approx([first, last], rel=1e-9)
    breakdown = prediction.breakdown  # on the critical path: the last stage paces the pipeline
    assert breakdown.compute_s == pytest.approx(4 * last, rel=1e-9)
    assert breakdown.pp_s == pytest.approx(4 * send, rel=1e-9)
    assert breakdown.bubble_s == pytest.approx(first + send, rel=1e-9)
    assert breakdown.optimizer_s == pytest.approx(adam_s(last_params), rel=1e-9)


def test_memory_of_a_stage_is_states_activations_in_flight_and_overhead():
    """The same two stages: under 1F1B stage i of p holds p - i micro-batches (Korthikanti
    et al. 2022), so stage 0 keeps two micro-batches' activations and stage 1 one."""
    plan = toy_plan([Pipeline((_stage(["box.0:0"], 0, 1), _stage(["box.1:0"], 1, 4)), 1, 4)])
    first, last = predict(plan).memory
    first_params = BLOCK_PARAMS + EMBEDDING_PARAMS
    # the embedding's output is the first block's input, which the block counts
    first_activations = 2 * block_activation_bytes(1)
    assert first.weights_bytes == pytest.approx(WEIGHT_BYTES * first_params)
    assert first.grads_bytes == pytest.approx(GRAD_BYTES * first_params)
    assert first.optimizer_bytes == pytest.approx(ADAM_BYTES * first_params)
    assert first.activations_bytes == pytest.approx(first_activations)
    assert first.total_bytes == pytest.approx(
        STATE_BYTES * first_params + first_activations + RUNTIME_OVERHEAD)
    last_params = 3 * BLOCK_PARAMS + HEAD_PARAMS
    # one micro-batch of 3 blocks, plus the head
    last_activations = 3 * block_activation_bytes(1) + head_activation_bytes(1)
    assert last.total_bytes == pytest.approx(
        STATE_BYTES * last_params + last_activations + RUNTIME_OVERHEAD)


def test_a_single_device_holds_every_state_one_micro_batch_and_the_logits():
    plan = toy_plan([Pipeline((_stage(["box.0:0"], 0, LAYERS),), 2, 4)])
    memory = predict(plan).memory[0]
    activations = LAYERS * block_activation_bytes(2) + head_activation_bytes(2)
    assert memory.weights_bytes == pytest.approx(WEIGHT_BYTES * MODEL_PARAMS)
    assert memory.weights_bytes + memory.grads_bytes + memory.optimizer_bytes == pytest.approx(
        STATE_BYTES * MODEL_PARAMS)
    assert memory.activations_bytes == pytest.approx(activations)
    assert memory.total_bytes == pytest.approx(
        STATE_BYTES * MODEL_PARAMS + activations + RUNTIME_OVERHEAD)


def test_a_data_parallel_ring_shares_the_network_cards_of_two_machines():
    """Two replicas, each a TP pair inside one machine: TP rank r's gradient ring joins
    box.0:r and box.1:r, so two rings cross each machine's card at once and each gets half
    of its 8 Gb/s. The reduction runs after the backward pass here, fully exposed."""
    blocking = Execution(overlap_grad_reduce=False)
    pairs = [Pipeline((_stage([f"box.{n}:0", f"box.{n}:1"], 0, LAYERS),), 1, 1) for n in (0, 1)]
    shared = predict(toy_plan(pairs), _cost(blocking)).breakdown.dp_s
    # each TP rank holds half the parameters; BF16 gradients: 2 bytes each
    assert shared == pytest.approx(
        ring_allreduce_s(2 * MODEL_PARAMS / 2, 2, NETWORK_BW / 2, NETWORK_LATENCY), rel=1e-9)
    assert shared == pytest.approx(MODEL_PARAMS / 0.5e9 + 2 * 50e-6, rel=1e-9)  # 134 ms
    singles = [Pipeline((_stage([f"box.{n}:0"], 0, LAYERS),), 1, 1) for n in (0, 1)]
    alone = predict(toy_plan(singles), _cost(blocking)).breakdown.dp_s
    # one ring with every gradient, the cards to itself: the same bandwidth term
    assert alone == pytest.approx(
        ring_allreduce_s(2 * MODEL_PARAMS, 2, NETWORK_BW, NETWORK_LATENCY), rel=1e-9)


def test_data_parallel_over_the_network_costs_the_gradient_all_reduce():
    """Overlapped with the last micro-batch's backward pass: only the rest is exposed."""
    one_node = [Pipeline((_stage([f"box.0:{i}"], 0, LAYERS),), 1, 1) for i in (0, 1)]
    two_nodes = [Pipeline((_stage([f"box.{n}:0"], 0, LAYERS),), 1, 1) for n in (0, 1)]
    local = predict(toy_plan(one_node)).breakdown.dp_s
    remote = predict(toy_plan(two_nodes)).breakdown.dp_s
    backward = LAYERS * block_s(1)[1] + head_s(1)[1] + accumulate_s(MODEL_PARAMS)
    grads = 2 * MODEL_PARAMS  # BF16
    assert remote == pytest.approx(
        ring_allreduce_s(grads, 2, NETWORK_BW, NETWORK_LATENCY) - backward, rel=1e-9)
    assert ring_allreduce_s(grads, 2, PCIE_BW, PCIE_LATENCY) < backward  # hidden over PCIe
    assert local == pytest.approx(0.0, abs=1e-12) and remote > 0


def test_uneven_batch_shares_make_the_slower_replica_the_critical_path():
    """6 micro-batches on one replica, 2 on the other: the ring starts when the first is done."""
    pipelines = [Pipeline((_stage(["box.0:0"], 0, LAYERS),), 1, 6),
                 Pipeline((_stage(["box.0:1"], 0, LAYERS),), 1, 2)]
    prediction = predict(toy_plan(pipelines))
    (block_forward, block_backward, _), (head_forward, head_backward) = block_s(1), head_s(1)
    micro_batch = (LAYERS * (block_forward + block_backward) + head_forward + head_backward
                   + accumulate_s(MODEL_PARAMS))
    # the gradient ring over PCIe (6.7 ms) hides under the last backward pass (9.0 ms)
    backward = LAYERS * block_backward + head_backward + accumulate_s(MODEL_PARAMS)
    assert ring_allreduce_s(2 * MODEL_PARAMS, 2, PCIE_BW, PCIE_LATENCY) < backward
    assert prediction.iteration_time_s == pytest.approx(
        6 * micro_batch + adam_s(MODEL_PARAMS), rel=1e-9)


def test_zero1_shards_optimizer_states_over_replicas():
    pipelines = [Pipeline((_stage([d], 0, LAYERS),), 1, 2)
                 for d in ("box.0:0", "box.0:1", "box.1:0", "box.1:1")]
    plain = predict(toy_plan(pipelines)).memory[0]
    sharded = predict(toy_plan(pipelines, zero=1)).memory[0]
    assert plain.optimizer_bytes == pytest.approx(ADAM_BYTES * MODEL_PARAMS)
    assert sharded.optimizer_bytes == pytest.approx(ADAM_BYTES * MODEL_PARAMS / 4)
    assert sharded.weights_bytes == plain.weights_bytes and sharded.grads_bytes == plain.grads_bytes


def test_gradient_reduction_after_the_backward_pass_is_fully_exposed():
    pipelines = [Pipeline((_stage([f"box.{n}:0"], 0, LAYERS),), 1, 1) for n in (0, 1)]
    blocking = Execution(overlap_grad_reduce=False, grad_reduce_bytes=4)
    exposed = predict(toy_plan(pipelines), _cost(blocking)).breakdown.dp_s
    # FP32 gradients over one 8 Gb/s hop: 2 * 1/2 * 4P / 1 GB/s + 2 * 50 us
    assert exposed == pytest.approx(4 * MODEL_PARAMS / NETWORK_BW + 2 * NETWORK_LATENCY, rel=1e-9)


def test_zero1_pays_the_parameter_all_gather_after_the_optimizer():
    pipelines = [Pipeline((_stage([f"box.{n}:0"], 0, LAYERS),), 1, 1) for n in (0, 1)]
    plain = predict(toy_plan(pipelines)).breakdown.optimizer_s
    sharded = predict(toy_plan(pipelines, zero=1)).breakdown.optimizer_s
    # each replica steps half the parameters, then the halves are all-gathered in BF16: half a
    # ring all-reduce, (g-1)/g * n/W + (g-1) * alpha
    gather = 1 / 2 * 2 * MODEL_PARAMS / NETWORK_BW + NETWORK_LATENCY
    assert plain == pytest.approx(adam_s(MODEL_PARAMS), rel=1e-9)
    assert sharded == pytest.approx(adam_s(MODEL_PARAMS / 2) + gather, rel=1e-9)
    assert sharded > plain


def test_zero1_reduce_scatters_gradients_to_their_owners():
    """With ZeRO-1 each owner needs only its own parameters' sums: a reduce-scatter, half
    the all-reduce (exposed in full here: the reduction waits for the backward pass)."""
    pipelines = [Pipeline((_stage([f"box.{n}:0"], 0, LAYERS),), 1, 1) for n in (0, 1)]
    blocking = Execution(overlap_grad_reduce=False, grad_reduce_bytes=4)
    sharded = predict(toy_plan(pipelines, zero=1), _cost(blocking))
    half_allreduce = 0.5 * (4 * MODEL_PARAMS / NETWORK_BW + 2 * NETWORK_LATENCY)
    assert sharded.breakdown.dp_s == pytest.approx(half_allreduce, rel=1e-9)


def test_mfu_counts_model_flops_against_the_peak_of_the_devices_used():
    plan = toy_plan([Pipeline((_stage(["box.0:0"], 0, LAYERS),), 2, 4)])
    prediction = predict(plan)
    # SC'21: per token, 2 FLOPs per weight of every matmul plus 4*s*h for attention's scores
    # and values (the full square), times 3 for the backward
    per_token = 3 * (LAYERS * (2 * (4 * H * H + 2 * H * FFN) + 4 * SEQ * H) + 2 * H * VOCAB)
    flops = per_token * prediction.tokens_per_s
    assert prediction.mfu == pytest.approx(flops / 100e12, rel=1e-9)
    assert prediction.tflops_per_gpu == pytest.approx(flops / 1e12, rel=1e-9)


def test_mfu_of_a_real_model_stays_below_the_best_gemm_efficiency():
    model = load_model("gpt3-1.3b")
    spec = parse_cluster("nodes: [{name: a, gpu: a100-80g-sxm, gpus_per_node: 1}]")
    plan = _plan(spec, model, [Pipeline((_stage(["a.0:0"], 0, 24),), 4, 4)], seq_len=2048)
    assert 0.3 < predict(plan).mfu < 0.87


# ---- properties on real models and GPUs --------------------------------------------------


def test_first_stages_hold_more_activations_under_1f1b(small_model):
    spec = parse_cluster(TWO_BOXES)
    ids = [d.id for d in Cluster(spec).devices]
    stages = tuple(_stage([ids[i]], 2 * i, 2 * i + 2) for i in range(4))
    plan = _plan(spec, small_model, [Pipeline(stages, 1, 8)])
    activations = [m.activations_bytes for m in predict(plan).memory]
    # one micro-batch more on stage 1 than on stage 2: two eager GPT-2 blocks (SDPA keeps no
    # s^2 scores) of 56 bytes per token and hidden unit plus two one-byte residual dropout
    # masks, and per token 8 bytes of LayerNorm statistics and 2 per head
    per_block = 58 * 1024 * 2048 + (8 + 2 * 16) * 1024
    assert activations[1] - activations[2] == pytest.approx(2 * per_block)
    assert activations[0] > activations[1] > activations[2]


def test_tensor_parallel_over_an_nvlink_pair_beats_crossing_pcie(small_model):
    cluster = Cluster(parse_cluster(TWO_BOXES))
    d = cluster.by_id
    cost = CostModel(cluster, small_model, 1024)
    bridged = cost.tp_block_comm_s((d["box.0:0"], d["box.0:1"]), 1)
    across = cost.tp_block_comm_s((d["box.0:1"], d["box.0:2"]), 1)
    # two all-reduces of one sequence's BF16 activations (1024 x 2048 x 2 bytes) per block
    # (SC'21), each 2 * 1/2 * n / W + 2 * alpha over the 3090's 53 GB/s bridge, 5 us latency
    assert bridged == pytest.approx(2 * (1024 * 2048 * 2 / 53e9 + 2 * 5e-6))
    assert across > 3 * bridged


def test_recomputation_trades_time_for_memory(small_model):
    spec = parse_cluster("nodes: [{name: a, gpu: a100-80g-sxm, gpus_per_node: 1}]")
    cost = CostModel(Cluster(spec), small_model, 1024)
    results = {}
    for mode in Recompute:
        plan = _plan(spec, small_model, [Pipeline((_stage(["a.0:0"], 0, 8),), 4, 1)], recompute=mode)
        results[mode] = predict(plan, cost)
    times = [results[m].iteration_time_s for m in (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)]
    memory = [results[m].peak_memory_bytes for m in (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)]
    assert times == sorted(times) and memory == sorted(memory, reverse=True)


def test_devices_without_bf16_train_in_fp16_and_cpus_in_fp32():
    from potluck.cluster.catalog import catalog

    assert effective_dtype(catalog()["v100-32g"], DType.BF16) is DType.FP16
    assert effective_dtype(catalog()["a100-80g-sxm"], DType.BF16) is DType.BF16
    assert effective_dtype(catalog()["cpu"], DType.BF16) is DType.FP32


def test_faster_devices_compute_faster(small_model):
    from potluck.cluster.catalog import catalog

    cost = CostModel(Cluster(parse_cluster(TWO_BOXES)), small_model, 2048)
    times = [cost.block_times(catalog()[name], 1, 4, Recompute.NONE).forward_s
             for name in ("rtx3090", "rtx4090", "a100-80g-sxm", "h100-sxm")]
    assert times == sorted(times, reverse=True)


def test_flash_attention_keeps_no_scores_and_materialized_attention_costs_memory_traffic(small_model):
    from potluck.model import counts

    spec = parse_cluster("nodes: [{name: a, gpu: a100-80g-sxm, gpus_per_node: 1}]")
    flash = CostModel(Cluster(spec), small_model, 4096)
    eager = CostModel(Cluster(spec), small_model, 4096, execution=Execution(flash_attention=False))
    device = Cluster(spec).devices[0].type
    s2_terms = counts.block_activation_bytes(small_model, 1, 4096, 1, Recompute.NONE)
    assert counts.block_activation_bytes(small_model, 1, 4096, 1, Recompute.NONE,
                                         flash_attention=True) < s2_terms
    assert (eager.block_times(device, 1, 1, Recompute.NONE).forward_s
            > flash.block_times(device, 1, 1, Recompute.NONE).forward_s)


def _plan(spec, model, pipelines, recompute=Recompute.NONE, zero=0, seq_len=1024):
    batch = sum(p.batch_share for p in pipelines)
    return Plan(spec, model, TrainingShape(batch, seq_len), tuple(pipelines), recompute=recompute,
                zero=zero)


def _stage(devices, start, end):
    return Stage(tuple(devices), ((start, end),))


def _cost(execution: Execution) -> CostModel:
    return CostModel(Cluster(parse_cluster(TOY_CLUSTER)), TOY, SEQ, execution=execution)


def test_the_default_host_floor_is_24_eager_kernels_at_8_us_each():
    assert Execution().block_host_s == pytest.approx(
        compute.OPS_PER_BLOCK_FORWARD * formulas.KERNEL_DISPATCH_S)


def test_a_block_issued_by_a_slow_host_runs_at_the_host_pace():
    """A framework whose host takes 3.9 ms to issue a block's forward (AMP's profile of
    Megatron-LM v1.1.5 under DeepSpeed, one layer at micro-batch 1 on a V100) floors the toy
    block's 0.81 ms forward at 3.9 ms and its 1.66 ms backward at 7.8 ms."""
    slow_host = Execution(block_host_s=3.9e-3)
    times = _cost(slow_host).block_times(toy_device(), 1, 1, Recompute.NONE)
    assert times.forward_s == pytest.approx(3.9e-3)
    assert times.backward_s == pytest.approx(7.8e-3)
    assert times.weight_grad_s == pytest.approx(block_s(1)[2], rel=1e-9)
