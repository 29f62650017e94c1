"""The cost model: time and memory of whole plans, checked against hand-computed values."""

import pytest

from potluck.cluster import Cluster, parse_cluster
from potluck.model import counts, load_model
from potluck.model.counts import Recompute
from potluck.planner import formulas
from potluck.planner.cost import GPU_RUNTIME_OVERHEAD_BYTES, CostModel, StageShape, effective_dtype
from potluck.planner.evaluate import predict
from potluck.plans import DType, Pipeline, Plan, Stage, TrainingShape

TWO_BOXES = """
nodes:
  - {name: box, gpu: rtx3090, gpus_per_node: 4, count: 2, nvlink: pairs, inter_bandwidth: 10Gb/s}
"""


def _plan(spec, model, pipelines, recompute=Recompute.NONE, zero1=False, seq_len=1024):
    batch = sum(p.batch_share for p in pipelines)
    return Plan(spec, model, TrainingShape(batch, seq_len), tuple(pipelines), recompute=recompute,
                zero1=zero1)


def _stage(devices, start, end):
    return Stage(tuple(devices), ((start, end),))


def test_a_single_device_plan_is_micro_batches_times_forward_plus_backward(small_model):
    spec = parse_cluster("nodes: [{name: a, gpu: a100-80g-sxm, gpus_per_node: 1}]")
    cost = CostModel(Cluster(spec), small_model, 1024)
    plan = _plan(spec, small_model, [Pipeline((_stage(["a.0:0"], 0, 8),), 2, 4)])
    prediction = predict(plan, cost)
    device = Cluster(spec).devices[0]
    shape = StageShape(8, first=True, last=True, micro_batch=2)
    work = cost.stage_time((device,), shape).work
    params = cost.stage_params(shape, 1)
    optimizer = formulas.adam_step_time_s(params, device.type.memory_bandwidth_bytes_per_s)
    assert prediction.iteration_time_s == pytest.approx(4 * work.total_s + optimizer)
    assert prediction.tokens_per_s == pytest.approx(8 * 1024 / prediction.iteration_time_s)
    assert prediction.breakdown.bubble_s == pytest.approx(0.0, abs=1e-12)


def test_memory_of_a_single_device_is_states_activations_and_overhead(small_model):
    spec = parse_cluster("nodes: [{name: a, gpu: a100-80g-sxm, gpus_per_node: 1}]")
    cost = CostModel(Cluster(spec), small_model, 1024)
    plan = _plan(spec, small_model, [Pipeline((_stage(["a.0:0"], 0, 8),), 2, 4)])
    memory = predict(plan, cost).memory[0]
    m, s, b = small_model, 1024, 2
    params = counts.total_params(m)
    activations = (8 * counts.block_activation_bytes(m, b, s, 1, Recompute.NONE, flash_attention=True)
                   + counts.embedding_activation_bytes(m, b, s, 1)
                   + counts.head_activation_bytes(m, b, s, 1))
    # FP32 weights + their 16-bit autocast copy (6), FP32 gradients (4), Adam moments (8)
    assert memory.weights_bytes == pytest.approx(6 * params)
    assert memory.weights_bytes + memory.grads_bytes + memory.optimizer_bytes == pytest.approx(18 * params)
    assert memory.activations_bytes == pytest.approx(activations)
    assert memory.total_bytes == pytest.approx(18 * params + activations + GPU_RUNTIME_OVERHEAD_BYTES)


def test_first_stages_hold_more_activations_under_1f1b(small_model):
    spec = parse_cluster(TWO_BOXES)
    ids = [d.id for d in Cluster(spec).devices]
    stages = tuple(_stage([ids[i]], 2 * i, 2 * i + 2) for i in range(4))
    plan = _plan(spec, small_model, [Pipeline(stages, 1, 8)])
    memory = predict(plan, CostModel(Cluster(spec), small_model, 1024)).memory
    activations = [m.activations_bytes for m in memory]
    per_micro_batch = 2 * counts.block_activation_bytes(small_model, 1, 1024, 1, Recompute.NONE,
                                                         flash_attention=True)
    assert activations[1] - activations[2] == pytest.approx(per_micro_batch)
    assert activations[0] > activations[1] > activations[2]


def test_zero1_shards_optimizer_states_over_replicas(small_model):
    spec = parse_cluster(TWO_BOXES)
    ids = [d.id for d in Cluster(spec).devices]
    pipelines = [Pipeline((_stage([i], 0, 8),), 1, 2) for i in ids[:4]]
    plain = predict(_plan(spec, small_model, pipelines), CostModel(Cluster(spec), small_model, 1024))
    sharded = predict(
        _plan(spec, small_model, pipelines, zero1=True), CostModel(Cluster(spec), small_model, 1024))
    params = counts.total_params(small_model)
    assert plain.memory[0].optimizer_bytes == pytest.approx(8 * params)  # Adam moments
    assert sharded.memory[0].optimizer_bytes == pytest.approx(8 * params / 4)


def test_tensor_parallel_over_an_nvlink_pair_beats_crossing_pcie(small_model):
    cluster = Cluster(parse_cluster(TWO_BOXES))
    d = cluster.by_id
    cost = CostModel(cluster, small_model, 1024)
    bridged = cost.tp_block_comm_s((d["box.0:0"], d["box.0:1"]), 1)
    across = cost.tp_block_comm_s((d["box.0:1"], d["box.0:2"]), 1)
    num_bytes = 1024 * small_model.hidden_size * 2
    assert bridged == pytest.approx(2 * formulas.ring_allreduce_time_s(num_bytes, 2, 53e9, 5e-6))
    assert across > 3 * bridged


def test_data_parallel_over_the_network_costs_the_gradient_all_reduce(small_model):
    spec = parse_cluster(TWO_BOXES)
    cluster = Cluster(spec)
    cost = CostModel(cluster, small_model, 1024)
    one_node = [Pipeline((_stage([f"box.0:{i}"], 0, 8),), 1, 1) for i in (0, 1)]
    two_nodes = [Pipeline((_stage([f"box.{n}:0"], 0, 8),), 1, 1) for n in (0, 1)]
    local = predict(_plan(spec, small_model, one_node), cost).breakdown.dp_s
    remote = predict(_plan(spec, small_model, two_nodes), cost)
    grads = 2 * counts.total_params(small_model)
    allreduce = formulas.ring_allreduce_time_s(grads, 2, 1.25e9, 30e-6)
    work = cost.stage_time((cluster.devices[0],), StageShape(8, first=True, last=True)).work
    assert remote.breakdown.dp_s == pytest.approx(allreduce - work.backward_s, rel=1e-6)
    assert local < remote.breakdown.dp_s


def test_uneven_batch_shares_make_the_slower_replica_the_critical_path(small_model):
    spec = parse_cluster(TWO_BOXES)
    pipelines = [Pipeline((_stage(["box.0:0"], 0, 8),), 1, 6),
                 Pipeline((_stage(["box.0:1"], 0, 8),), 1, 2)]
    prediction = predict(_plan(spec, small_model, pipelines), CostModel(Cluster(spec), small_model, 1024))
    work = CostModel(Cluster(spec), small_model, 1024).stage_time(
        (Cluster(spec).devices[0],), StageShape(8, first=True, last=True)).work
    assert prediction.iteration_time_s >= 6 * work.total_s


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


def test_mfu_counts_model_flops_against_the_peak_of_the_devices_used():
    model = load_model("gpt3-1.3b")
    spec = parse_cluster("nodes: [{name: a, gpu: a100-80g-sxm, gpus_per_node: 1}]")
    plan = _plan(spec, model, [Pipeline((_stage(["a.0:0"], 0, 24),), 4, 4)], seq_len=2048)
    prediction = predict(plan, CostModel(Cluster(spec), model, 2048))
    flops = counts.model_flops_per_token(model, 2048) * prediction.tokens_per_s
    assert prediction.mfu == pytest.approx(flops / 312e12)
    assert prediction.tflops_per_gpu == pytest.approx(flops / 1e12)
    assert 0.3 < prediction.mfu < 0.87  # below the device's best GEMM efficiency


def test_flash_attention_keeps_no_scores_and_materialized_attention_costs_memory_traffic(small_model):
    from potluck.plans import Execution

    spec = parse_cluster("nodes: [{name: a, gpu: a100-80g-sxm, gpus_per_node: 1}]")
    flash = CostModel(Cluster(spec), small_model, 4096)
    eager = CostModel(Cluster(spec), small_model, 4096, execution=Execution(flash_attention=False))
    device = Cluster(spec).devices[0].type
    s2_terms = counts.block_activation_bytes(small_model, 1, 4096, 1, Recompute.NONE)
    assert counts.block_activation_bytes(small_model, 1, 4096, 1, Recompute.NONE,
                                         flash_attention=True) < s2_terms
    assert (eager.block_times(device, 1, 1, Recompute.NONE).forward_s
            > flash.block_times(device, 1, 1, Recompute.NONE).forward_s)


def test_gradient_reduction_after_the_backward_pass_is_fully_exposed(small_model):
    from potluck.plans import Execution

    spec = parse_cluster(TWO_BOXES)
    pipelines = [Pipeline((_stage([f"box.{n}:0"], 0, 8),), 1, 1) for n in (0, 1)]
    plan = _plan(spec, small_model, pipelines)
    blocking = Execution(overlap_grad_reduce=False, grad_reduce_bytes=4)
    exposed = predict(plan, CostModel(Cluster(spec), small_model, 1024, execution=blocking))
    grads = 4 * counts.total_params(small_model)
    assert exposed.breakdown.dp_s == pytest.approx(
        formulas.ring_allreduce_time_s(grads, 2, 1.25e9, 30e-6), rel=1e-6)


def test_zero1_pays_the_parameter_all_gather_after_the_optimizer(small_model):
    spec = parse_cluster(TWO_BOXES)
    pipelines = [Pipeline((_stage([f"box.{n}:0"], 0, 8),), 1, 1) for n in (0, 1)]
    cost = CostModel(Cluster(spec), small_model, 1024)
    plain = predict(_plan(spec, small_model, pipelines), cost).breakdown.optimizer_s
    sharded = predict(_plan(spec, small_model, pipelines, zero1=True), cost).breakdown.optimizer_s
    params = counts.total_params(small_model)
    gather = formulas.ring_allgather_time_s(2 * params, 2, 1.25e9, 30e-6)
    bandwidth = Cluster(spec).devices[0].type.memory_bandwidth_bytes_per_s
    adam_half = formulas.adam_step_time_s(params / 2, bandwidth)
    assert plain == pytest.approx(formulas.adam_step_time_s(params, bandwidth), rel=1e-6)
    assert sharded == pytest.approx(adam_half + gather, rel=1e-6)
    assert sharded > plain


def test_zero1_reduce_scatters_gradients_to_their_owners(small_model):
    """With ZeRO-1 each owner needs only its own parameters' sums: a reduce-scatter, half
    the all-reduce (exposed in full here: the reduction waits for the backward pass)."""
    from potluck.plans import Execution

    spec = parse_cluster(TWO_BOXES)
    pipelines = [Pipeline((_stage([f"box.{n}:0"], 0, 8),), 1, 1) for n in (0, 1)]
    blocking = Execution(overlap_grad_reduce=False, grad_reduce_bytes=4)
    cost = CostModel(Cluster(spec), small_model, 1024, execution=blocking)
    sharded = predict(_plan(spec, small_model, pipelines, zero1=True), cost)
    grads = 4 * counts.total_params(small_model)
    assert sharded.breakdown.dp_s == pytest.approx(
        formulas.ring_allgather_time_s(grads, 2, 1.25e9, 30e-6), rel=1e-6)
