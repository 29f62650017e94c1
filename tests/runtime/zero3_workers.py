"""Rank workers for the ZeRO-3 (FSDP2) tests: what FSDP2's state looks like between a
micro-batch's forward and its backward, and after a step; the most weights it holds
gathered at once in a step."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from unittest.mock import patch

import torch
from runtime_helpers import LR
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

from potluck.plans import Plan
from potluck.runtime import Trainer, build_model, parallelize, start
from potluck.runtime.grads import zero3
from potluck.runtime.launch.local import run_local
from potluck.runtime.launch.session import Session
from potluck.runtime.loop.batches import RandomTokens


@dataclass(frozen=True)
class FsdpView:
    """Per rank: FSDP modules' names that are roots, and those whose weights were still
    unsharded when a stage's forward returned (before its backward); the most gathered
    weight elements held at once, sampled at each tensor autograd saves or unpacks."""

    roots: list[str]
    unsharded_after_forward: list[str]
    fsdp_modules: int
    unsharded_grads_between_micro_batches: list[str]  # full-size gradients held back
    most_gathered_elements: int


def _fsdp_modules(stage: nn.Module) -> dict[str, FSDPModule]:
    return {name or "<stage>": m for name, m in stage.named_modules() if isinstance(m, FSDPModule)}


def _unsharded(modules: dict[str, FSDPModule]) -> list[str]:
    return sorted(name for name, module in modules.items()
                  for group in fully_shard.state(module)._fsdp_param_groups
                  if group.is_unsharded)


def _gathered_elements(modules: dict[str, FSDPModule]) -> int:
    """Elements of the weights the FSDP units among ``modules`` hold gathered now, or are
    gathering (a prefetch: its all-gather's output exists, not yet waited for)."""
    groups = {id(group): group for module in modules.values()
              for group in fully_shard.state(module)._fsdp_param_groups
              if group.is_unsharded or group._all_gather_result is not None}
    return sum(param._orig_size.numel() for group in groups.values()
               for param in group.fsdp_params)


class _GatheredPeak:
    """The most gathered weight elements seen, sampled whenever autograd saves a tensor
    (forward, loss) or hands one back (backward)."""

    def __init__(self, modules: dict[str, FSDPModule]) -> None:
        self.modules, self.most = modules, 0

    def sample(self, tensor: torch.Tensor) -> torch.Tensor:
        self.most = max(self.most, _gathered_elements(self.modules))
        return tensor

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.sample, self.sample)


def _unsharded_grads(modules: dict[str, FSDPModule]) -> list[str]:
    """FSDP modules holding a full-size gradient (FSDP2 keeps one on the unsharded
    parameter, or accumulates one, while gradient sync is off)."""
    return sorted(name for name, module in modules.items()
                  for group in fully_shard.state(module)._fsdp_param_groups
                  for param in group.fsdp_params
                  if param.unsharded_accumulated_grad is not None
                  or (hasattr(param, "_unsharded_param") and param._unsharded_param.grad is not None))


def _inspect(plan: Plan, reshard_all: bool) -> FsdpView:
    """``reshard_all``: every unit reshards after forward (none kept for the backward)."""
    with patch.object(zero3, "gathered_after_forward", lambda *_args: set()) if reshard_all \
            else nullcontext():
        return _inspect_step(plan)


def _inspect_step(plan: Plan) -> FsdpView:
    session = start(plan, timeout_s=60)
    try:
        model = parallelize(build_model(plan.model), session)
        seen: list[str] = []
        held: list[str] = []
        for stage in model.stages:
            modules = _fsdp_modules(stage)
            stage.register_forward_pre_hook(
                lambda _m, _i, modules=modules: held.extend(_unsharded_grads(modules)))
            stage.register_forward_hook(
                lambda _m, _i, _o, modules=modules: seen.extend(_unsharded(modules)),
                always_call=True)
        trainer = Trainer(model, None, lr=LR)
        shape = plan.training
        data = RandomTokens(plan.model.vocab_size, shape.seq_len, shape.global_batch)
        modules = {f"{i}.{name}": m for i, stage in enumerate(model.stages)
                   for name, m in _fsdp_modules(stage).items()}
        peak = _GatheredPeak(modules)
        with peak.hooks():
            trainer.step(data.replica_rows(0, *session.layout.batch_rows))
        roots = sorted(name for name, m in modules.items() if fully_shard.state(m)._is_root)
        return FsdpView(roots, sorted(set(seen)), len(modules), sorted(set(held)), peak.most)
    finally:
        session.close()


def inspect_fsdp(plan: Plan, *, reshard_all: bool = False) -> list[FsdpView]:
    """Every rank's view of FSDP2 in one training step of ``plan`` on CPU ranks
    (``reshard_all``: with every unit resharded after forward)."""
    return run_local(_inspect, plan.devices, (plan, reshard_all), timeout_s=120)


def _outputs_follow_weights(plan: Plan) -> bool:
    """Under bf16 autocast (forced on this CPU rank, as a GPU rank computes): a second
    forward in the same autocast region, after the head's sharded weight was zeroed, gives
    zero logits (not those of a cached cast of the old unsharded weight)."""
    with patch.object(Session, "autocast_dtype", property(lambda _self: torch.bfloat16)):
        session = start(plan, timeout_s=60)
        try:
            model = parallelize(build_model(plan.model), session)
            stage = model.stages[0]
            shape = plan.training
            rows = RandomTokens(plan.model.vocab_size, shape.seq_len, shape.global_batch) \
                .replica_rows(0, *session.layout.batch_rows)[:, :-1]
            with model._autocast():
                before = stage(rows).float()
                for module in _fsdp_modules(stage).values():
                    module.reshard()  # as after each forward: the sharded weights registered
                with torch.no_grad():
                    stage.lm_head.weight.zero_()  # logits = hidden @ W.T: zeros now
                after = stage(rows).float()
            return bool(after.abs().max() == 0) and bool(before.abs().max() > 0)
        finally:
            session.close()


def outputs_follow_weights(plan: Plan) -> list[bool]:
    """Per rank: :func:`_outputs_follow_weights`."""
    return run_local(_outputs_follow_weights, plan.devices, (plan,), timeout_s=120)
