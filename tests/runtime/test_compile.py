"""The ``compile`` execution trait on CPU ranks with inductor: each block and the loss
compiled, with the same losses as eager, composed with ZeRO-3 (FSDP2 over the compiled
blocks) and full recomputation (checkpoint around each compiled block); and which ranks and
blocks stay eager."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
from compile_workers import train_compiled
from runtime_helpers import TINY_LLAMA, make_plan, pipe

from potluck.model.counts import Recompute
from potluck.plans import Plan
from potluck.plans.memory import Offload, StageMemory
from potluck.runtime.models.adapters import detect_family
from potluck.runtime.models.build import build_model
from potluck.runtime.parallel.compile import block_eager_reason, rank_eager_reason
from potluck.runtime.parallel.pipeline import StageModule
from potluck.runtime.parallel.recompute import apply_memory

STEPS = 3
TOLERANCE = 1e-4  # fp32 on CPU: inductor's fused kernels reorder sums
DP2 = [pipe([(1, (0, 4))], 2, 2)] * 2


def _with_compile(plan: Plan, compile: bool | None) -> Plan:
    execution = replace(plan.training.execution, compile=compile)
    return replace(plan, training=replace(plan.training, execution=execution))


def test_compiled_blocks_and_loss_train_as_eager_under_zero3_and_recomputation():
    plan = replace(make_plan(TINY_LLAMA, DP2, recompute=Recompute.FULL), zero=3)
    eager = train_compiled(_with_compile(plan, None), STEPS)  # auto: eager on CPU ranks
    compiled = train_compiled(_with_compile(plan, True), STEPS)
    for rank, (plain, fast) in enumerate(zip(eager, compiled, strict=True)):
        assert plain.compiled_blocks == [] and not plain.loss_compiled, f"rank {rank}"
        assert fast.compiled_blocks == ["0", "1", "2", "3"], f"rank {rank}"
        assert fast.loss_compiled and fast.sharded_blocks == 4, f"rank {rank}"
        # one graph shared by the four identical blocks, one for the loss, none broken
        assert (fast.graphs, fast.graph_breaks) == (2, 0), f"rank {rank}"
        assert fast.losses == pytest.approx(plain.losses, abs=TOLERANCE), f"rank {rank}"
        assert fast.grad_norms == pytest.approx(plain.grad_norms, abs=TOLERANCE), f"rank {rank}"


def _layout(tp: int = 1) -> SimpleNamespace:
    return SimpleNamespace(role=SimpleNamespace(tp=tp, pipeline=0, stage=0, holds_head=True))


def test_blocks_and_ranks_that_stay_eager_say_why():
    model = build_model(TINY_LLAMA)
    stage = StageModule(model, detect_family(model), (0, 4), first=True, last=True)
    apply_memory([stage], StageMemory(recompute=Recompute.SELECTIVE, recompute_blocks=1),
                 Recompute.NONE)
    stage.swapped = frozenset({"1"})
    reasons = [block_eager_reason(stage, name) for name in stage.blocks]
    assert reasons == ["selective recomputation", "swapped activations", None, None]
    plan = make_plan(TINY_LLAMA, DP2)
    assert rank_eager_reason(plan, _layout(), [stage]) is None
    assert "tensor parallelism" in rank_eager_reason(plan, _layout(tp=2), [stage])
    assert "traced" in rank_eager_reason(plan, _layout(), [model])
    offloaded = replace(plan.pipelines[0].stages[0],
                        memory=StageMemory(offload=Offload.OPTIMIZER))
    plan = replace(plan, pipelines=(replace(plan.pipelines[0], stages=(offloaded,)),
                                    *plan.pipelines[1:]))
    assert "offload" in rank_eager_reason(plan, _layout(), [stage])
