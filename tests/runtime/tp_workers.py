"""Rank workers for the explicit TP executor's tests: what one step communicates and in
which order (a recording clock), how often each block's norms run, every parameter's
gradient, and what the memory ledger counts while a stage's backward is pending."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import numpy as np
import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from potluck.ops import OpKind
from potluck.plans import Plan, StageComm
from potluck.runtime import build_model, parallelize, start
from potluck.runtime.launch.local import run_local
from potluck.runtime.loop.batches import RandomTokens
from potluck.runtime.timing.clock import CommOp, Segment, Waitable

T = TypeVar("T")


def with_comm(plan: Plan, comm: Mapping[tuple[int, int], StageComm]) -> Plan:
    """``plan`` with stage ``(pipeline, stage)``'s communication as ``comm`` says."""
    pipelines = tuple(
        replace(pipeline, stages=tuple(replace(stage, comm=comm.get((k, j), stage.comm))
                                       for j, stage in enumerate(pipeline.stages)))
        for k, pipeline in enumerate(plan.pipelines))
    return replace(plan, pipelines=pipelines)


COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")


class CollectiveCount(TorchDispatchMode):
    """Counts the collectives started while it is on (process-group ops and functional
    collectives); DTensor ops are left to desugar first (as torch's CommDebugMode does),
    so the collectives they issue are counted too."""

    def __init__(self) -> None:
        super().__init__()
        self.supports_higher_order_operators = True
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        if any(t is DTensor for t in types):
            return NotImplemented
        namespace = getattr(func, "namespace", "")
        if namespace in COLLECTIVE_NAMESPACES and "wait" not in func.__name__:
            self.count += 1
        return func(*args, **(kwargs or {}))


class RecordingClock:
    """A :class:`~potluck.runtime.timing.clock.Clock` that runs every op as it is and notes,
    in order, each segment and asynchronous collective with the ops open around it; inside
    the stages' backward ops it counts every collective the process starts."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.open: list[OpKind] = []
        self.backward_collectives = 0

    @property
    def dilation(self) -> float:
        return 1.0

    def run(self, kind: OpKind, stage_id: int, fn: Callable[[], T]) -> T:
        self.open.append(kind)
        try:
            if kind is not OpKind.BACKWARD:
                return fn()
            with CollectiveCount() as comms:
                result = fn()
            self.backward_collectives += comms.count
            return result
        finally:
            self.open.pop()

    def tag_p2p(self, ops: list[Any], kind: OpKind, stage_id: int, micro_batch: int
                ) -> list[Any]:
        return ops

    def start_comm(self, op: CommOp, work: Waitable) -> Waitable:
        self.events.append(("comm", op.kind, op.key, tuple(self.open)))
        return work

    def run_segment(self, segment: Segment, fn: Callable[[], T]) -> T:
        self.events.append(("segment", segment, tuple(self.open)))
        return fn()


@dataclass(frozen=True)
class StepReport:
    """One rank's first step."""

    events: list[tuple[Any, ...]]
    backward_collectives: int
    norm_calls: dict[int, int]  # block -> forward calls of its norms
    grads: dict[str, np.ndarray]  # full gradients, by parameter name (plain data: a tensor
    # would cross to the test process as shared memory, gone once the rank ends)
    layouts: dict[str, str]  # each parameter's and its gradient's placements and local shape


def _count_norm_calls(stages: list[torch.nn.Module], calls: dict[int, int]) -> None:
    for stage in stages:
        for name, block in stage.blocks.items():
            for path in stage.family.norms:
                norm = getattr(block, path)
                norm.forward = _counted(norm.forward, calls, int(name))


def _counted(forward: Callable[..., Any], calls: dict[int, int], layer: int
             ) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        calls[layer] = calls.get(layer, 0) + 1
        return forward(*args, **kwargs)

    return run


def _full(tensor: torch.Tensor) -> np.ndarray:
    full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return full.detach().numpy().copy()


def _layout(tensor: torch.Tensor) -> str:
    if isinstance(tensor, DTensor):
        return f"{tensor.placements} {tuple(tensor.to_local().shape)}"
    return f"local {tuple(tensor.shape)}"


def _step(plan: Plan) -> StepReport:
    session = start(plan, timeout_s=60)
    try:
        model = parallelize(build_model(plan.model), session)
        clock, calls = RecordingClock(), {}
        model.set_clock(clock)
        _count_norm_calls(model.stages, calls)
        shape = plan.training
        rows = RandomTokens(plan.model.vocab_size, shape.seq_len, shape.global_batch) \
            .replica_rows(0, *session.layout.batch_rows)
        model.forward_backward(rows)
        params = dict(model.named_parameters())
        grads = {name: _full(p.grad) for name, p in params.items()}
        layouts = {name: f"{_layout(p)} grad {_layout(p.grad)}" for name, p in params.items()}
        return StepReport(clock.events, clock.backward_collectives, calls, grads, layouts)
    finally:
        session.close()


def step_reports(plan: Plan) -> list[StepReport]:
    """Every rank's report of ``plan``'s first step (gradients before any update)."""
    return run_local(_step, plan.devices, (plan,), timeout_s=120)


@dataclass(frozen=True)
class HeldBytes:
    """Transient bytes the ledger counts on one rank around one stage pass."""

    before: float
    after_forward: float
    after_backward: float


def _held(plan: Plan) -> HeldBytes:
    session = start(plan, timeout_s=60)
    try:
        model = parallelize(build_model(plan.model), session, count_memory=True)
        (stage,) = model.stages
        ledger = model.ledger
        rows = RandomTokens(plan.model.vocab_size, plan.training.seq_len,
                            plan.training.global_batch).replica_rows(0, 0, 2)
        before = ledger.now().device_bytes
        with ledger.saving():
            logits = stage(rows[:, :-1])
            after_forward = ledger.now().device_bytes
            logits.to_local().sum().backward()
        del logits
        return HeldBytes(before, after_forward, ledger.now().device_bytes)
    finally:
        session.close()


def held_bytes(plan: Plan) -> list[HeldBytes]:
    """Per rank: what the ledger counts before, between and after one micro-batch's forward
    and backward of ``plan``'s only stage (no model states registered: activations only)."""
    return run_local(_held, plan.devices, (plan,), timeout_s=120)


@dataclass(frozen=True)
class InputGradReport:
    """One rank's explicit stage under ``autograd.grad`` for its input, then ``backward()``."""

    untouched_after_grad: bool  # no block parameter has a gradient
    accumulated_after_backward: bool  # every block parameter has one
    input_grads: tuple[np.ndarray, np.ndarray]  # the input's gradient from each


def _input_grad_only(plan: Plan) -> InputGradReport:
    session = start(plan, timeout_s=60)
    try:
        model = parallelize(build_model(plan.model), session)
        (stage,) = model.stages
        tp, seq_len = session.layout.role.tp, plan.training.seq_len
        shard = torch.randn(2, seq_len // tp, plan.model.hidden_size,
                            generator=torch.Generator().manual_seed(session.rank))
        params = list(stage.blocks.parameters())
        grads = []
        for accumulate in (False, True):
            x = shard.clone().requires_grad_()
            out = stage.explicit.run(stage, x, seq_len)
            if accumulate:
                out.square().sum().backward()
                grads.append(x.grad)
            else:
                grads.append(torch.autograd.grad(out.square().sum(), x)[0])
                untouched = all(p.grad is None for p in params)
        return InputGradReport(untouched, all(p.grad is not None for p in params),
                               tuple(g.numpy().copy() for g in grads))
    finally:
        session.close()


def input_grad_only(plan: Plan) -> list[InputGradReport]:
    """Per rank: ``plan``'s only stage's blocks (explicit TP) on a random sequence shard,
    their input's gradient taken with ``autograd.grad``, then with ``backward()``."""
    return run_local(_input_grad_only, plan.devices, (plan,), timeout_s=120)
