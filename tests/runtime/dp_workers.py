"""Rank workers for the data-parallel tests: train a plan and report what the gradient sync
and the optimizer did on each rank (bucket launches, optimizer state bytes)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from runtime_helpers import LR, STEPS

from potluck.plans import Plan
from potluck.runtime import ParallelModel, Trainer, build_model, parallelize, start
from potluck.runtime.grads.buckets import BUCKET_ELEMENTS
from potluck.runtime.grads.data_parallel import SyncStats
from potluck.runtime.grads.zero import optimizer_state_bytes
from potluck.runtime.launch.local import run_local
from potluck.runtime.loop.batches import RandomTokens
from potluck.runtime.loop.trainer import BatchSource

SMALL_BUCKETS = 3000  # elements: several buckets per stage of the tiny models


@dataclass(frozen=True)
class RankReport:
    losses: list[float]
    grad_norms: list[float]
    stats: list[SyncStats]  # per step
    state_bytes: int  # optimizer state on this rank after the last step
    param_bytes: int = 0  # this rank's parameters (local shards) after the last step
    grad_bytes: int = 0  # ... and gradients kept after the step's gradient sync
    host_bytes: int = 0  # offloaded optimizer: host masters and states


def with_options(plan: Plan, *, overlap: bool | None = None, zero: int | None = None) -> Plan:
    """``plan`` with the gradient all-reduce overlapped or not, ZeRO-1 on or off."""
    if overlap is not None:
        execution = replace(plan.training.execution, overlap_grad_reduce=overlap)
        plan = replace(plan, training=replace(plan.training, execution=execution))
    return plan if zero is None else replace(plan, zero=zero)


def sgd_with_momentum(model: ParallelModel) -> torch.optim.Optimizer:
    return torch.optim.SGD(list(model.parameters()), lr=LR, momentum=0.9)


def _train(plan: Plan, steps: int, bucket_elements: int,
           optimizer: Callable[[ParallelModel], torch.optim.Optimizer] | None,
           data: BatchSource | None = None) -> RankReport:
    session = start(plan, timeout_s=60)
    try:
        model = parallelize(build_model(plan.model), session, bucket_elements=bucket_elements)
        trainer = Trainer(model, optimizer(model) if optimizer else None, lr=LR)
        shape = plan.training
        data = data or RandomTokens(plan.model.vocab_size, shape.seq_len, shape.global_batch)
        losses, norms, stats = [], [], []
        for step in range(steps):
            rows = data.replica_rows(step, *session.layout.batch_rows)
            metrics = trainer.step(rows)
            losses.append(metrics.loss)
            norms.append(metrics.grad_norm)
            stats.append(model.grad_sync.stats)
        return RankReport(losses, norms, stats, _device_state_bytes(trainer.optimizer),
                          *_model_bytes(model), _host_bytes(trainer.optimizer))
    finally:
        session.close()


def _bytes(tensors) -> int:
    from potluck.runtime.grads.buckets import local

    return sum(local(t).numel() * local(t).element_size() for t in tensors)


def _model_bytes(model: ParallelModel) -> tuple[int, int]:
    """Bytes of this rank's parameters and of the gradients it holds after the sync
    (measured inside the step: the trainer zeroes gradients in place, keeping them)."""
    params = list(model.parameters())
    return _bytes(params), _bytes(p.grad for p in params if p.grad is not None)


def _device_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return 0 if hasattr(optimizer, "host_state_tensors") else optimizer_state_bytes(optimizer)


def _host_bytes(optimizer: torch.optim.Optimizer) -> int:
    host = getattr(optimizer, "host_state_tensors", None)
    return _bytes(host()) if host is not None else 0


def with_offload(plan: Plan) -> Plan:
    """``plan`` with every stage's optimizer offloaded to host memory."""
    from potluck.plans.memory import Offload

    pipelines = tuple(replace(p, stages=tuple(replace(s, memory=replace(s.memory,
                                                                        offload=Offload.OPTIMIZER))
                                              for s in p.stages)) for p in plan.pipelines)
    return replace(plan, pipelines=pipelines)


def train_plan(plan: Plan, steps: int = STEPS, bucket_elements: int = BUCKET_ELEMENTS,
               optimizer: Callable[[ParallelModel], torch.optim.Optimizer] | None = None,
               data: BatchSource | None = None) -> list[RankReport]:
    """Every rank's report of ``plan`` run on CPU ranks of this machine (``optimizer``:
    a top-level factory, default the trainer's AdamW; ``data``: default random tokens)."""
    return run_local(_train, plan.devices, (plan, steps, bucket_elements, optimizer, data),
                     timeout_s=120)


def _tied_group_is_not_the_lane(plan: Plan) -> bool:
    from potluck.placement import TIED

    session = start(plan, timeout_s=60)
    try:
        layout = session.layout
        tied = layout.sync_group(TIED).ranks
        return tied == layout.lane_ranks(0, 0) and \
            layout.sync_process_group(tied) is not layout.lane_group
    finally:
        session.close()


def tied_group_is_not_the_lane(plan: Plan) -> list[bool]:
    """Per rank: the tied weight's sync group has the lane's ranks, not its process group."""
    return run_local(_tied_group_is_not_the_lane, plan.devices, (plan,), timeout_s=60)


def _bucket_views(plan: Plan) -> tuple[int, int, int]:
    """(buckets, buckets summed in their gradients' own flat tensor after two steps,
    torch.cat calls of the gradient sync in the second step)."""
    from unittest.mock import patch

    from potluck.runtime.grads import data_parallel, zero

    session = start(plan, timeout_s=60)
    try:
        model = parallelize(build_model(plan.model), session, bucket_elements=SMALL_BUCKETS)
        trainer = Trainer(model, None, lr=LR)
        shape = plan.training
        data = RandomTokens(plan.model.vocab_size, shape.seq_len, shape.global_batch)
        trainer.step(data.replica_rows(0, *session.layout.batch_rows))
        cats = 0
        real_cat = torch.cat

        def counted(*args: object, **kwargs: object) -> torch.Tensor:
            nonlocal cats
            cats += 1
            return real_cat(*args, **kwargs)

        with patch.object(data_parallel.torch, "cat", counted), \
                patch.object(zero.torch, "cat", counted):
            model.grad_sync.start()
            model.grad_sync.finish()
        sync = model.grad_sync
        in_place = sum(1 for b in sync.buckets if b in sync.views and sync.views.flat(b) is not None)
        return len(sync.buckets), in_place, cats
    finally:
        session.close()


def bucket_views(plan: Plan) -> list[tuple[int, int, int]]:
    """Per rank: :func:`_bucket_views`."""
    return run_local(_bucket_views, plan.devices, (plan,), timeout_s=120)


def _grads_in_16_bits(plan: Plan, bf16: bool) -> tuple[dict[str, Any], list[bool], int]:
    """One step's summed gradients (FP32 arrays) of ``plan`` with 16-bit weights and FP32
    masters wired as a GPU rank gets them (``bf16``) or in FP32; whether any gradient was
    held when each micro-batch's forward began; buckets kept as views."""
    from potluck.runtime.grads.master_weights import MasterWeightsOptimizer

    session = start(plan, timeout_s=60)
    try:
        model = parallelize(build_model(plan.model), session, bucket_elements=SMALL_BUCKETS)
        if bf16:
            masters = MasterWeightsOptimizer(torch.optim.AdamW(list(model.parameters())))
            model.sum_grads_in_fp32(masters.keep_device_parameters_in(
                model.parameters(), torch.bfloat16, model.final_accumulations()))
        held: list[bool] = []
        model.stages[0].register_forward_pre_hook(
            lambda *_: held.append(any(p.grad is not None for p in model.parameters())))
        shape = plan.training
        data = RandomTokens(plan.model.vocab_size, shape.seq_len, shape.global_batch)
        model.forward_backward(data.replica_rows(0, *session.layout.batch_rows))
        sync = model.grad_sync
        views = sum(1 for b in sync.buckets if b in sync.views and sync.views.flat(b) is not None)
        grads = {name: p.grad.detach().float().numpy() for name, p in model.named_parameters()}
        return grads, held, views
    finally:
        session.close()


def grads_in_16_bits(plan: Plan, bf16: bool) -> list[tuple[dict[str, Any], list[bool], int]]:
    """Per rank: :func:`_grads_in_16_bits`."""
    return run_local(_grads_in_16_bits, plan.devices, (plan, bf16), timeout_s=120)
