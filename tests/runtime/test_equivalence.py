"""Every layout trains exactly like one process: same model, data and seed, same losses.

Each case runs a plan on CPU ranks (gloo) for a few steps with AdamW and
gradient clipping, and compares rank 0's global loss curve with a plain
single-process PyTorch loop over the same global batches (token-weighted
mean loss over the whole batch).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from runtime_helpers import (
    TINY_GPT2,
    TINY_LLAMA,
    make_plan,
    pipe,
    reference_losses,
    run_plan,
    toy_on_meta,
    toy_reference,
)

from potluck.model.counts import Recompute
from potluck.plans import Execution, Schedule
from potluck.runtime.models.build import attention_implementation, build_model

TOLERANCE = 2e-5
TIED_LLAMA = replace(TINY_LLAMA, tied_embeddings=True)
TINY_QWEN2 = replace(TINY_LLAMA, family="qwen2", qkv_bias=True, tied_embeddings=True)
TINY_MISTRAL = replace(TINY_LLAMA, family="mistral")
INTERLEAVED_STAGES = [(1, ((0, 1), (2, 3))), (1, ((1, 2), (3, 4)))]

CASES = {
    "one rank, four micro-batches": (TINY_LLAMA, [pipe([(1, (0, 4))], 2, 4)], {}),
    "dp=2, uneven shares 6+2": (TINY_LLAMA, [pipe([(1, (0, 4))], 2, 3),
                                             pipe([(1, (0, 4))], 1, 2)], {}),
    "pp=2, uneven stages 1+3": (TINY_LLAMA, [pipe([(1, (0, 1)), (1, (1, 4))], 2, 4)], {}),
    "pp=3, gpipe": (TINY_LLAMA, [pipe([(1, (0, 2)), (1, (2, 3)), (1, (3, 4))], 1, 4)],
                    {"schedule": Schedule.GPIPE}),
    "pp=2, interleaved 1f1b": (TINY_LLAMA, [pipe(INTERLEAVED_STAGES, 1, 4)],
                               {"schedule": Schedule.INTERLEAVED}),
    "pp=2, zero bubble": (TINY_LLAMA, [pipe(INTERLEAVED_STAGES, 1, 4)],
                          {"schedule": Schedule.ZERO_BUBBLE}),
    "zero bubble, one stage per rank": (
        TINY_LLAMA, [pipe([(1, (0, 2)), (1, (2, 4))], 1, 4)], {"schedule": Schedule.ZERO_BUBBLE}),
    "interleaved, 3 micro-batches on 2 stages": (
        TINY_LLAMA, [pipe(INTERLEAVED_STAGES, 1, 3)], {"schedule": Schedule.INTERLEAVED}),
    "virtual stages on one-stage pipelines": (
        TINY_LLAMA, [pipe([(1, ((0, 2), (2, 4)))], 1, 2), pipe([(1, ((0, 1), (1, 4)))], 1, 2)],
        {"schedule": Schedule.INTERLEAVED}),
    "tp=2": (TINY_LLAMA, [pipe([(2, (0, 4))], 2, 4)], {}),
    "dp=2 x pp=2 x tp=2 and pp=2 x tp=1, uneven": (
        TINY_LLAMA, [pipe([(2, (0, 3)), (2, (3, 4))], 1, 3),
                     pipe([(1, (0, 1)), (1, (1, 4))], 1, 2)], {}),
    "heterogeneous: pp=2 tp=1 beside pp=1 tp=2": (
        TINY_LLAMA, [pipe([(1, (0, 1)), (1, (1, 4))], 2, 2), pipe([(2, (0, 4))], 1, 3)], {}),
    "tied llama, pp=2 beside tp=2": (
        TIED_LLAMA, [pipe([(1, (0, 2)), (1, (2, 4))], 1, 4), pipe([(2, (0, 4))], 2, 1)], {}),
    "qwen2 (qkv bias, tied), pp=2 x tp=2": (
        TINY_QWEN2, [pipe([(2, (0, 2)), (2, (2, 4))], 1, 4)], {}),
    # 1F1B over fewer micro-batches than stages fills and drains (torch's schedule runtime)
    "mistral, dp=2 x pp=2, one micro-batch on the second": (
        TINY_MISTRAL, [pipe([(1, (0, 2)), (1, (2, 4))], 1, 2),
                       pipe([(1, (0, 3)), (1, (3, 4))], 2, 1)], {}),
    "pp=3, 1f1b over 2 micro-batches": (
        TINY_LLAMA, [pipe([(1, (0, 2)), (1, (2, 3)), (1, (3, 4))], 2, 2)], {}),
    "gpt2, tp=2 (fused qkv)": (TINY_GPT2, [pipe([(2, (0, 4))], 2, 2)], {}),
    "gpt2, heterogeneous with tied head": (
        TINY_GPT2, [pipe([(1, (0, 3)), (1, (3, 4))], 1, 3), pipe([(2, (0, 4))], 1, 2)], {}),
    "stages with tp 1 then 2 in one pipeline": (
        TINY_LLAMA, [pipe([(1, (0, 1)), (2, (1, 4))], 1, 4)], {}),
    "tp 1-2-1 pipeline beside a tp=2 replica, tied": (
        TIED_LLAMA, [pipe([(1, (0, 1)), (2, (1, 3)), (1, (3, 4))], 1, 3),
                     pipe([(2, (0, 4))], 1, 2)], {}),
    "gpt2, tp 2-1-2 pipeline, gpipe": (
        TINY_GPT2, [pipe([(2, (0, 2)), (1, (2, 3)), (2, (3, 4))], 1, 3)],
        {"schedule": Schedule.GPIPE}),
    "interleaved over stages of tp 1 and 2": (
        TINY_LLAMA, [pipe([(1, ((0, 1), (2, 3))), (2, ((1, 2), (3, 4)))], 1, 4)],
        {"schedule": Schedule.INTERLEAVED}),
    "full recomputation, pp=2 x tp=2": (
        TINY_LLAMA, [pipe([(2, (0, 2)), (2, (2, 4))], 1, 4)], {"recompute": Recompute.FULL}),
    "selective recomputation, gpt2 tp=2": (
        TINY_GPT2, [pipe([(2, (0, 2)), (2, (2, 4))], 1, 4)],
        {"recompute": Recompute.SELECTIVE}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_layout_matches_single_process(case):
    spec, pipelines, plan_options = CASES[case]
    plan = make_plan(spec, pipelines, **plan_options)
    expected = reference_losses(spec, plan.training.global_batch)
    assert run_plan(plan) == pytest.approx(expected, abs=TOLERANCE)


TOY_CASES = {
    "whole model": [pipe([(1, (0, 4))], 2, 2)],
    "pp=2 by tracing": [pipe([(1, (0, 1)), (1, (1, 4))], 1, 4)],
    "traced, heterogeneous dp": [pipe([(1, (0, 3)), (1, (3, 4))], 1, 3),
                                 pipe([(1, (0, 4))], 1, 2)],
}


@pytest.mark.parametrize("case", list(TOY_CASES))
def test_any_module_with_a_block_list_matches_single_process(case):
    plan = make_plan(TINY_LLAMA, TOY_CASES[case])
    expected = reference_losses(TINY_LLAMA, plan.training.global_batch, model=toy_reference())
    got = run_plan(plan, model_factory=toy_on_meta)
    assert got == pytest.approx(expected, abs=TOLERANCE)


def test_a_plan_without_flash_attention_trains_with_eager_attention_alike():
    """``execution.flash_attention: false`` (scores in memory) is one the runtime runs: the
    model is built with Hugging Face's eager attention, and tensor parallelism still
    computes the plain loop's losses."""
    assert attention_implementation(False) == "eager"
    assert build_model(TINY_LLAMA, "eager").config._attn_implementation == "eager"
    plan = make_plan(TINY_LLAMA, [pipe([(2, (0, 4))], 2, 2)])
    plan = replace(plan, training=replace(plan.training,
                                          execution=Execution(flash_attention=False)))
    expected = reference_losses(TINY_LLAMA, plan.training.global_batch)
    assert run_plan(plan) == pytest.approx(expected, abs=TOLERANCE)
