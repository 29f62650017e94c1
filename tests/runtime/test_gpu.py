"""GPU paths (nccl, bf16 autocast); skipped on machines without CUDA."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from runtime_helpers import LR, TINY_LLAMA, make_plan, pipe, reference_losses

from potluck.cluster.spec import parse_cluster
from potluck.plans import DType
from potluck.runtime.launch.gpus import StartMethod
from potluck.runtime.launch.local import run_local
from potluck.runtime.options import TrainOptions
from potluck.runtime.training import train_rank

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _losses(plan, options):
    return [m.loss for m in train_rank(plan, options)]


def _one_gpu_plan(dtype: DType):
    cluster = parse_cluster("nodes:\n  - {name: box, gpu: a100-80g-sxm, gpus_per_node: 1}\n")
    plan = make_plan(TINY_LLAMA, [pipe([(1, (0, 4))], 2, 2)], cluster=cluster,
                     device_ids=["box.0:0"])
    return replace(plan, training=replace(plan.training, dtype=dtype))


def test_one_gpu_bf16_trains_close_to_fp32_reference():
    plan = _one_gpu_plan(DType.BF16)
    options = TrainOptions(steps=3, lr=LR, progress=False)
    losses = run_local(_losses, plan.devices, (plan, options), timeout_s=300,
                       start_method=StartMethod.SPAWN)[0]
    assert losses == pytest.approx(reference_losses(TINY_LLAMA, 4), abs=2e-2)


def _metrics(plan, options):
    return [(m.loss, m.loss_scale, m.skipped) for m in train_rank(plan, options)]


def test_one_gpu_fp16_trains_with_a_loss_scale_close_to_fp32_reference():
    plan = _one_gpu_plan(DType.FP16)
    options = TrainOptions(steps=3, lr=LR, progress=False)
    metrics = run_local(_metrics, plan.devices, (plan, options), timeout_s=300,
                        start_method=StartMethod.SPAWN)[0]
    assert all(scale is not None and scale >= 1.0 for _, scale, _ in metrics)
    kept = [loss for loss, _, skipped in metrics if not skipped]
    assert kept and kept[0] == pytest.approx(reference_losses(TINY_LLAMA, 4)[0], abs=2e-2)


def _tf32_run(plan, options):
    losses = [m.loss for m in train_rank(plan, options)]
    return losses, torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32


def test_one_gpu_tf32_trains_without_autocast_with_tf32_matmuls_on():
    cluster = parse_cluster("nodes:\n  - {name: box, gpu: a100-80g-sxm, gpus_per_node: 1}\n"
                            "devices:\n  a100-80g-sxm: {fp32_tflops: 19.5, tf32_tflops: 156}\n")
    plan = make_plan(TINY_LLAMA, [pipe([(1, (0, 4))], 2, 2)], cluster=cluster,
                     device_ids=["box.0:0"])
    plan = replace(plan, training=replace(plan.training, dtype=DType.TF32))
    options = TrainOptions(steps=3, lr=LR, progress=False)
    losses, matmul_tf32, cudnn_tf32 = run_local(_tf32_run, plan.devices, (plan, options),
                                                timeout_s=300,
                                                start_method=StartMethod.SPAWN)[0]
    assert matmul_tf32 and cudnn_tf32
    assert losses == pytest.approx(reference_losses(TINY_LLAMA, 4), abs=2e-2)
