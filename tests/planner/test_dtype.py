"""The dtype a plan trains in: which dtype each device computes in, at which peak, with
which states, gradients and MFU."""

from __future__ import annotations

import json

import pytest

from potluck import api
from potluck.cluster import parse_cluster
from potluck.cluster.catalog import DeviceType
from potluck.cluster.execution import Execution
from potluck.cluster.topology import Cluster
from potluck.errors import ConfigError
from potluck.model import load_model
from potluck.planner import formulas
from potluck.planner.compute import ComputeModel
from potluck.planner.cost import CostModel
from potluck.planner.formulas import StateSharding
from potluck.planner.gemm import achievable_flops, effective_dtype, peak_flops
from potluck.plans import DType, plan_from_dict, plan_to_json
from potluck.report import dtype_notes

# explicit figures (not the catalog's): 16-bit 100 TFLOPS, TF32 50, FP32 20
AMPERE = DeviceType("amp", tflops=100.0, memory_bytes=80e9, memory_bandwidth_bytes_per_s=2e12,
                    matmul_efficiency=0.5, fp32_tflops=20.0, tf32_tflops=50.0)
VOLTA = DeviceType("volta", tflops=100.0, memory_bytes=32e9, memory_bandwidth_bytes_per_s=2e12,
                   bf16=False, matmul_efficiency=0.5, fp32_tflops=15.0)
NO_FP32 = DeviceType("mystery", tflops=100.0, memory_bytes=32e9)
CPU = DeviceType("cpu", tflops=0.2, memory_bytes=8e9, bf16=False)

CLUSTER = """
nodes:
  - {name: a, gpu: amp, gpus_per_node: 2}
devices:
  amp: {tflops: 100, fp32_tflops: 20, tf32_tflops: 50, memory: 80GB, matmul_efficiency: 0.5}
"""


@pytest.mark.parametrize(("device", "requested", "computed"), [
    (AMPERE, DType.TF32, DType.TF32),
    (AMPERE, DType.FP32, DType.FP32),
    (AMPERE, DType.BF16, DType.BF16),
    (VOLTA, DType.TF32, DType.FP32),  # no TF32 tensor cores before Ampere
    (VOLTA, DType.BF16, DType.FP16),
    (VOLTA, DType.FP16, DType.FP16),
    (CPU, DType.BF16, DType.FP32),
    (CPU, DType.FP16, DType.FP32),
    (CPU, DType.TF32, DType.FP32),
])
def test_each_device_computes_in_the_dtype_it_supports(device, requested, computed):
    assert effective_dtype(device, requested) is computed


@pytest.mark.parametrize(("device", "requested", "tflops"), [
    (AMPERE, DType.BF16, 100.0), (AMPERE, DType.FP16, 100.0), (AMPERE, DType.TF32, 50.0),
    (AMPERE, DType.FP32, 20.0), (VOLTA, DType.TF32, 15.0), (VOLTA, DType.BF16, 100.0),
    (CPU, DType.BF16, 0.2),  # the CPU's tflops figure is FP32 already
])
def test_the_peak_is_the_one_of_the_computed_dtype(device, requested, tflops):
    assert peak_flops(device, requested) == pytest.approx(tflops * 1e12)
    assert achievable_flops(device, requested) == pytest.approx(tflops * 1e12 * device.matmul_efficiency)


def test_fp32_on_a_gpu_without_an_fp32_figure_is_refused_with_the_field_to_set():
    with pytest.raises(ConfigError, match="fp32_tflops") as err:
        peak_flops(NO_FP32, DType.TF32)
    assert "mystery" in str(err.value) and "\n" not in str(err.value)
    assert peak_flops(NO_FP32, DType.BF16) == pytest.approx(100e12)  # 16-bit plans need none


def test_a_compute_bound_gemm_runs_at_the_dtypes_peak_with_four_byte_elements():
    model = load_model("gpt3-125m")
    n = 8192  # 2*n^3 = 1.1e12 FLOPs against 0.8 GB of FP32 traffic: compute bound
    flops = 2.0 * n**3
    for dtype, tflops in ((DType.FP32, 20.0), (DType.TF32, 50.0), (DType.BF16, 100.0)):
        compute = ComputeModel(model, 2048, dtype)
        assert compute._gemm_s(AMPERE, n, n, n) == pytest.approx(flops / (tflops * 1e12 * 0.5))
        assert compute.element_bytes(AMPERE) == (2 if dtype is DType.BF16 else 4)


def test_fp32_and_tf32_keep_16_bytes_of_states_and_reduce_gradients_in_fp32():
    cluster = Cluster(parse_cluster(CLUSTER, "amp.yaml"))
    model = load_model("gpt3-125m")
    for dtype in (DType.FP32, DType.TF32):
        cost = CostModel(cluster, model, 2048, dtype)
        assert cost.state_layout(AMPERE) == formulas.FP32
        assert cost.state_layout(AMPERE).total == 16.0
        assert cost.grad_bytes(AMPERE) == 4
        assert cost.send_bytes(AMPERE, 1) == 2048 * model.hidden_size * 4
    bf16 = CostModel(cluster, model, 2048, DType.BF16)
    assert bf16.state_layout(AMPERE).total == 18.0  # FP32 weights under autocast
    assert bf16.grad_bytes(AMPERE) == 2


@pytest.mark.parametrize(("dtype", "tflops"), [(DType.TF32, 50.0), (DType.FP32, 20.0),
                                               (DType.BF16, 100.0)])
def test_mfu_is_against_the_peak_of_the_trained_dtype(dtype, tflops):
    best = api.plan(parse_cluster(CLUSTER, "amp.yaml"), "tiny-llama", global_batch=8,
                    seq_len=128, dtype=dtype.value).best
    prediction = best.prediction
    achieved = prediction.tflops_per_gpu * 1e12 * best.num_gpus
    assert prediction.mfu == pytest.approx(achieved / (tflops * 1e12 * best.num_gpus))


def test_a_tf32_plan_is_faster_than_fp32_and_slower_than_bf16():
    times = {dtype: api.plan(parse_cluster(CLUSTER, "amp.yaml"), "gpt3-125m", global_batch=8,
                             seq_len=512, dtype=dtype, tp=1, pp=1, dp=2, micro_batch_size=4,
                             recompute="none").best.prediction.iteration_time_s
             for dtype in ("fp32", "tf32", "bf16")}
    assert times["fp32"] > times["tf32"] > times["bf16"]


def test_notes_name_the_devices_computing_in_another_dtype_and_why():
    assert dtype_notes(DType.TF32, [VOLTA, AMPERE, VOLTA]) == [
        "volta computes in fp32, not tf32: no TF32 tensor cores"]
    assert dtype_notes(DType.BF16, [VOLTA, CPU]) == [
        "cpu computes in fp32, not bf16: CPU ranks train in fp32",
        "volta computes in fp16, not bf16: no bf16 support"]
    assert dtype_notes(DType.BF16, [AMPERE]) == []


def test_an_unknown_dtype_is_one_line():
    with pytest.raises(ConfigError, match="bf16, fp16, fp32, tf32"):
        api.training_shape(load_model("tiny-llama"), dtype="fp8")


def test_a_tf32_plan_round_trips_and_older_dtypes_still_load():
    best = api.plan(parse_cluster(CLUSTER, "amp.yaml"), "tiny-llama", global_batch=8, seq_len=128,
                    dtype="tf32").best
    loaded = plan_from_dict(json.loads(plan_to_json(best)))
    assert loaded.training.dtype is DType.TF32
    data = json.loads(plan_to_json(best))
    data["training"]["dtype"] = "bf16"  # what plans before tf32 hold
    assert plan_from_dict(data).training.dtype is DType.BF16


def test_zero3_states_are_charged_as_fsdp2_mixed_precision_holds_them():
    """potluck's runtime shards FP32 weights under ZeRO-3 and gathers them in 16 bits
    (FSDP2's MixedPrecisionPolicy), keeping no autocast copy: FP32 shards, 2-byte gathers."""
    bf16 = CostModel(Cluster(parse_cluster(CLUSTER, "amp.yaml")), load_model("gpt3-125m"), 2048,
                     DType.BF16)
    sharded = StateSharding.of(4, 3)
    layout = bf16.state_layout(AMPERE, sharded)
    assert (layout.weights, layout.grads, layout.gathered_weights) == (4.0, 4.0, 2.0)
    assert bf16.model_state_bytes(AMPERE, 1000, sharded) == pytest.approx(16.0 * 1000 / 4)
    zero2 = StateSharding.of(4, 2)  # ZeRO-2: 16-bit weights, FP32 gradient sums and masters
    assert bf16.state_layout(AMPERE, zero2) == formulas.MAIN_GRAD_MASTER
    autocast = CostModel(Cluster(parse_cluster(CLUSTER, "amp.yaml")), load_model("gpt3-125m"),
                         2048, DType.BF16, Execution(fp32_params=True))
    assert autocast.state_layout(AMPERE, zero2).weights == 6.0  # autocast's copy kept
