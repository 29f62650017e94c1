"""A rank computes in its plan's dtype: autocast for 16 bits, none for fp32 and tf32,
TF32 matmuls switched on for tf32 only (the flags read the same on CPU builds)."""

from __future__ import annotations

import pytest
import torch
from runtime_helpers import LR, SEQ_LEN, TINY_LLAMA, make_plan, pipe, reference_losses

from potluck.cluster.spec import parse_cluster
from potluck.plans import DType
from potluck.runtime import Trainer, parallelize, start
from potluck.runtime.launch.precision import TorchPrecision, apply_precision, torch_precision
from potluck.runtime.launch.session import Session
from potluck.runtime.layout import Layout
from potluck.runtime.loop.batches import RandomTokens
from potluck.runtime.models.build import build_model

GPUS = parse_cluster("nodes:\n  - {name: a, gpu: a100-80g-sxm, gpus_per_node: 1}\n"
                     "  - {name: v, gpu: v100-32g, gpus_per_node: 1}\n"
                     "devices:\n  a100-80g-sxm: {fp32_tflops: 19.5, tf32_tflops: 156}\n"
                     "  v100-32g: {fp32_tflops: 15.7, tf32_tflops: 0}\n", "gpus.yaml")


def _flags() -> tuple[bool, bool]:
    return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32


@pytest.fixture(autouse=True)
def _restore_flags():
    before = _flags()
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.mark.parametrize(("dtype", "autocast", "tf32"), [
    (DType.BF16, torch.bfloat16, False), (DType.FP16, torch.float16, False),
    (DType.TF32, None, True), (DType.FP32, None, False),
])
def test_each_dtype_has_one_torch_setting(dtype, autocast, tf32):
    assert torch_precision(dtype) == TorchPrecision(autocast, tf32)
    apply_precision(TorchPrecision(None, not tf32))
    apply_precision(torch_precision(dtype))
    assert _flags() == (tf32, tf32)


def _gpu_session(dtype: DType, device_id: str) -> Session:
    """A session of a GPU rank, built without a GPU (nothing runs on it)."""
    plan = make_plan(TINY_LLAMA, [pipe([(1, (0, 4))], 1, 2)], cluster=GPUS, device_ids=[device_id],
                     dtype=dtype)
    return Session(plan, Layout(plan, 0, (device_id,)), torch.device("cuda", 0), None)


@pytest.mark.parametrize(("dtype", "device_id", "computed"), [
    (DType.TF32, "a.0:0", DType.TF32), (DType.TF32, "v.0:0", DType.FP32),
    (DType.BF16, "v.0:0", DType.FP16), (DType.FP32, "a.0:0", DType.FP32),
    (DType.BF16, "a.0:0", DType.BF16),
])
def test_a_gpu_rank_computes_in_its_devices_dtype(dtype, device_id, computed):
    session = _gpu_session(dtype, device_id)
    assert session.compute_dtype is computed
    assert session.precision == torch_precision(computed)


def test_an_fp32_plan_trains_without_autocast_and_without_tf32():
    plan = make_plan(TINY_LLAMA, [pipe([(1, (0, 4))], 2, 2)], dtype=DType.FP32)
    apply_precision(torch_precision(DType.TF32))  # a previous run's setting
    session = start(plan)
    try:
        assert session.autocast_dtype is None and _flags() == (False, False)
        hf_model = build_model(TINY_LLAMA)
        seen: list[tuple[bool, torch.dtype]] = []
        hf_model.model.layers[0].mlp.register_forward_hook(
            lambda module, args, out: seen.append((torch.is_autocast_enabled("cpu"), out.dtype)))
        model = parallelize(hf_model, session)
        trainer = Trainer(model, lr=LR)
        data = RandomTokens(TINY_LLAMA.vocab_size, SEQ_LEN, plan.training.global_batch)
        losses = [trainer.step(data.replica_rows(k, *session.layout.batch_rows)).loss
                  for k in range(3)]
    finally:
        session.close()
    assert seen and set(seen) == {(False, torch.float32)}
    assert losses == pytest.approx(reference_losses(TINY_LLAMA, 4), abs=2e-5)


def test_a_tf32_plan_on_cpu_ranks_computes_in_fp32():
    plan = make_plan(TINY_LLAMA, [pipe([(1, (0, 4))], 2, 2)], dtype=DType.TF32)
    session = start(plan)
    try:
        assert session.compute_dtype is DType.FP32 and session.autocast_dtype is None
        assert _flags() == (False, False)
    finally:
        session.close()
