"""Rank workers for the data-parallel priority schedule's tests: train a plan and report
its losses and parameters, when each parameter bucket was waited for, and which
collectives ran between an optimizer step and the next forward."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from runtime_helpers import LR, STEPS

from potluck.ops import OpKind
from potluck.plans import Plan
from potluck.runtime import ParallelModel, Trainer, build_model, parallelize, start
from potluck.runtime.grads.buckets import BUCKET_ELEMENTS, local
from potluck.runtime.grads.gather import bucket_units
from potluck.runtime.launch.local import run_local
from potluck.runtime.loop.batches import RandomTokens
from potluck.runtime.timing.clock import CommOp, NullClock, Waitable

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_single",
               "reduce_scatter_tensor", "reduce_scatter", "broadcast", "barrier", "reduce",
               "all_gather_object", "gather_object", "broadcast_object_list", "all_to_all_single")


def prioritized(plan: Plan, zero: int, on: bool = True) -> Plan:
    """``plan`` with ZeRO stage ``zero`` and the priority schedule on (or off)."""
    return replace(plan, zero=zero, comm=replace(plan.comm, dp_priority_schedule=on))


@dataclass(frozen=True)
class RankRun:
    losses: list[float]
    parameters: dict[str, Any]  # this rank's local values after the last step (numpy arrays)


def _trainer(plan: Plan, bucket_elements: int) -> tuple[ParallelModel, Trainer, RandomTokens]:
    session = start(plan, timeout_s=60)
    model = parallelize(build_model(plan.model), session, bucket_elements=bucket_elements)
    shape = plan.training
    data = RandomTokens(plan.model.vocab_size, shape.seq_len, shape.global_batch)
    return model, Trainer(model, lr=LR), data


def _fit(plan: Plan, steps: int, bucket_elements: int) -> RankRun:
    model, trainer, data = _trainer(plan, bucket_elements)
    try:
        history = trainer.fit(data, steps)
        return RankRun([m.loss for m in history],
                       {name: local(p).detach().numpy().copy()
                        for name, p in model.named_parameters()})
    finally:
        model.session.close()


def fit_plan(plan: Plan, steps: int = STEPS, bucket_elements: int = BUCKET_ELEMENTS
             ) -> list[RankRun]:
    """Every rank's losses and final parameters of ``plan`` trained with ``Trainer.fit``."""
    return run_local(_fit, plan.devices, (plan, steps, bucket_elements), timeout_s=120)


def _watch_buckets(plan: Plan, bucket_elements: int) -> dict[str, Any]:
    """Step once, then record the next step's bucket waits around block 0's forward."""
    model, trainer, data = _trainer(plan, bucket_elements)
    try:
        start, count = model.layout.batch_rows
        before = {n: local(p).detach().clone() for n, p in model.named_parameters()}
        trainer.step(data.replica_rows(0, start, count))
        gathers = model.gathers
        report = {"pending_after_step": gathers.pending, "order": gathers.order,
                  "units": [bucket_units(b) for b in model.zero.buckets],
                  "unchanged": [n for n, p in model.named_parameters()
                                if torch.equal(local(p), before[n])]}
        events: list[tuple[Any, ...]] = []
        waits = gathers.wait

        def wait(index: int) -> None:
            events.append(("wait", index, gathers.pending))
            waits(index)

        gathers.wait = wait
        block = model.stages[0].get_submodule("model.layers.0")  # the block itself
        block.register_forward_pre_hook(lambda *_: events.append(("block.0", gathers.pending)))
        block.register_forward_hook(lambda *_: events.append(("block.0 done", gathers.pending)))
        trainer.step(data.replica_rows(1, start, count))
        waiting = gathers.pending
        model.state_dict()  # reading the state finishes every gather first
        return {**report, "events": events, "pending_before_state_dict": waiting,
                "pending_after_state_dict": gathers.pending}
    finally:
        model.session.close()


def watch_buckets(plan: Plan, bucket_elements: int) -> list[dict[str, Any]]:
    """Per rank: the buckets pending after a step, their units, the parameters a step left
    unchanged (before the next forward), the next step's waits around block 0, and what is
    pending before and after reading the state dict."""
    return run_local(_watch_buckets, plan.devices, (plan, bucket_elements), timeout_s=120)


class RecordingClock(NullClock):
    """A clock that notes when each op starts and ends and when a collective is waited for."""

    def __init__(self, events: list[tuple[Any, ...]]) -> None:
        self.events = events

    def run(self, kind: OpKind, stage_id: int, fn: Callable[[], Any]) -> Any:
        self.events.append(("start", kind))
        result = fn()
        self.events.append(("end", kind))
        return result

    def start_comm(self, op: CommOp, work: Waitable) -> Waitable:
        self.events.append(("start_comm", op.kind))
        return _NotedWait(work, op, self.events)


@dataclass
class _NotedWait:
    work: Waitable
    op: CommOp
    events: list[tuple[Any, ...]]

    def wait(self) -> Any:
        self.events.append(("wait", self.op.kind))
        return self.work.wait()


def _record_calls(events: list[tuple[Any, ...]]) -> None:
    """Note every collective called through ``torch.distributed`` (name, group size, async)."""
    for name in COLLECTIVES:
        original = getattr(dist, name)

        def noted(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
            group = kwargs.get("group")
            size = dist.get_world_size(group) if group is not None else dist.get_world_size()
            events.append(("call", _name, size, bool(kwargs.get("async_op", False))))
            return _original(*args, **kwargs)

        setattr(dist, name, noted)


def _record_collectives(plan: Plan, steps: int, bucket_elements: int) -> list[tuple[Any, ...]]:
    model, trainer, data = _trainer(plan, bucket_elements)
    try:
        events: list[tuple[Any, ...]] = []
        model.set_clock(RecordingClock(events))
        _record_calls(events)
        trainer.fit(data, steps)
        return events
    finally:
        model.session.close()


def record_collectives(plan: Plan, steps: int = STEPS, bucket_elements: int = BUCKET_ELEMENTS
                       ) -> list[list[tuple[Any, ...]]]:
    """Per rank, in order: op starts and ends, collectives called and waited for."""
    return run_local(_record_collectives, plan.devices, (plan, steps, bucket_elements),
                     timeout_s=120)

