"""The explicit TP executor: sub-batches whose all-reduces overlap compute, and recomputation
that keeps communication, train exactly like one process.

Stages whose plan sets ``tp_overlap_chunks`` > 1 (or ``recompute_keeps_comm`` with
recomputation) run :mod:`potluck.runtime.parallel.tp_overlap` instead of DTensor's
sequence-parallel styles. Each layout's losses match a single process; the first step's
gradients equal the plain path's for every parameter; a recording clock shows each
sub-batch's all-reduce starting before the next sub-batch computes the same part, and
that a recomputing stage's backward starts no collective beyond the backward's own.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from runtime_helpers import (
    SEQ_LEN,
    TINY_GPT2,
    TINY_LLAMA,
    make_plan,
    pipe,
    reference_losses,
    run_plan,
)
from tp_workers import held_bytes, input_grad_only, step_reports, with_comm

from potluck.errors import ConfigError
from potluck.model.counts import Recompute
from potluck.ops import OpKind
from potluck.plans import Plan, Schedule, StageComm
from potluck.plans.memory import StageMemory
from potluck.runtime.grads.buckets import Bucket, SyncedParam
from potluck.runtime.grads.grad_ready import GradReady
from potluck.runtime.launch.checks import check_execution, check_explicit_tp
from potluck.runtime.timing.clock import Segment

TOLERANCE = 2e-3
TINY_QWEN2 = replace(TINY_LLAMA, family="qwen2", qkv_bias=True, tied_embeddings=True)
TP2 = [pipe([(2, (0, 4))], 2, 2)]
KEEP = StageComm(1, recompute_keeps_comm=True)


def _sub_batches(chunks: int, keeps: bool = False) -> StageComm:
    return StageComm(chunks, recompute_keeps_comm=keeps)


CASES = {
    "tp=2, one sub-batch, full recomputation keeping communication": (
        TINY_LLAMA, TP2, {(0, 0): KEEP}, {"recompute": Recompute.FULL}),
    "tp=2, 2 sub-batches": (TINY_LLAMA, TP2, {(0, 0): _sub_batches(2)}, {}),
    "tp=2, 4 sub-batches": (TINY_LLAMA, [pipe([(2, (0, 4))], 4, 1)],
                            {(0, 0): _sub_batches(4)}, {}),
    "pp=2 x tp=2, an explicit stage beside a plain one": (
        TINY_LLAMA, [pipe([(2, (0, 2)), (2, (2, 4))], 2, 2)], {(0, 0): _sub_batches(2)}, {}),
    "pp=2 x tp=2, the explicit stage fed by a pipeline send": (
        TINY_LLAMA, [pipe([(2, (0, 2)), (2, (2, 4))], 2, 2)], {(0, 1): _sub_batches(2)}, {}),
    "interleaved over two explicit stages, full recomputation": (
        TINY_LLAMA, [pipe([(2, ((0, 1), (2, 3))), (2, ((1, 2), (3, 4)))], 2, 4)],
        {(0, 0): _sub_batches(2, keeps=True), (0, 1): KEEP},
        {"schedule": Schedule.INTERLEAVED, "recompute": Recompute.FULL}),
    "dp=2 x tp=2, uneven shares": (
        TINY_LLAMA, [pipe([(2, (0, 4))], 2, 2), pipe([(2, (0, 4))], 2, 1)],
        {(0, 0): _sub_batches(2), (1, 0): _sub_batches(2)}, {}),
    "selective recomputation, 2 sub-batches, gpt2": (
        TINY_GPT2, TP2, {(0, 0): _sub_batches(2, keeps=True)},
        {"recompute": Recompute.SELECTIVE}),
    "full recomputation, 2 sub-batches": (
        TINY_LLAMA, TP2, {(0, 0): _sub_batches(2, keeps=True)}, {"recompute": Recompute.FULL}),
    "gpt2 (fused qkv, row-wise biases), 2 sub-batches": (
        TINY_GPT2, TP2, {(0, 0): _sub_batches(2)}, {}),
    "qwen2 (qkv bias, tied), 2 sub-batches": (TINY_QWEN2, TP2, {(0, 0): _sub_batches(2)}, {}),
    "mixed tp: tp 1 then an explicit tp=2 stage with the head": (
        TINY_LLAMA, [pipe([(1, (0, 1)), (2, (1, 4))], 2, 2)], {(0, 1): _sub_batches(2)}, {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_explicit_tp_trains_like_one_process(case):
    spec, pipelines, comm, options = CASES[case]
    plan = with_comm(make_plan(spec, pipelines, **options), comm)
    expected = reference_losses(spec, plan.training.global_batch)
    assert run_plan(plan) == pytest.approx(expected, abs=TOLERANCE)


def test_zero2_reduces_each_micro_batchs_gradients_once_its_sub_batches_are_in():
    """ZeRO-2 reduce-scatters a bucket after every micro-batch, when ``GradReady`` has
    counted one accumulation per micro-batch: for an explicit stage, ``chunks`` hooks."""
    dp2 = with_comm(make_plan(TINY_LLAMA, [pipe([(2, (0, 4))], 2, 2), pipe([(2, (0, 4))], 2, 1)]),
                    {(0, 0): _sub_batches(2), (1, 0): _sub_batches(2)})
    expected = reference_losses(TINY_LLAMA, dp2.training.global_batch)
    assert run_plan(replace(dp2, zero=2)) == pytest.approx(expected, abs=TOLERANCE)


# One tp=2 stage, 4 blocks, one micro-batch of 2 sequences: its first step four ways.
ONE_MICRO_BATCH = [pipe([(2, (0, 4))], 2, 1)]
RECOMPUTED_BLOCKS = 2  # the stage recomputes its first two blocks


def _llama_plan(comm: StageComm | None, recompute: Recompute = Recompute.NONE,
                recompute_blocks: int | None = RECOMPUTED_BLOCKS) -> Plan:
    plan = make_plan(TINY_LLAMA, ONE_MICRO_BATCH)
    memory = StageMemory(recompute, recompute_blocks=recompute_blocks)
    stage = replace(plan.pipelines[0].stages[0], memory=memory, comm=comm or StageComm())
    return replace(plan, pipelines=(replace(plan.pipelines[0], stages=(stage,)),))


@pytest.fixture(scope="module")
def first_steps():
    """Rank reports of the first step: plain and explicit (2 sub-batches), each without and
    with full recomputation of the first two blocks."""
    return {
        (explicit, recompute): step_reports(_llama_plan(
            _sub_batches(2, keeps=True) if explicit else None, recompute))
        for explicit in (False, True) for recompute in (Recompute.NONE, Recompute.FULL)
    }


def test_each_sub_batch_starts_its_all_reduce_before_the_next_one_computes(first_steps):
    """Part-major order: for each block and part, sub-batch 1 computes and starts its
    all-reduce, then sub-batch 2 computes and starts its own; the backward pass the same
    way in reverse. Segments and collectives run inside the stage's forward or backward."""
    events = first_steps[True, Recompute.NONE][0].events
    tp_events = [e for e in events if e[0] == "segment" or e[1] is OpKind.TP_ALLREDUCE]
    order = [(layer, part) for layer in range(4) for part in ("attention", "mlp")]
    forward = [("segment", Segment(OpKind.TP_ALLREDUCE, 0, "entry", -1, 2), (OpKind.FORWARD,))]
    for layer, part in order:
        forward += [("segment", Segment(OpKind.FORWARD, 0, part, layer, 2), (OpKind.FORWARD,)),
                    ("comm", OpKind.TP_ALLREDUCE, (part, layer, "forward"), (OpKind.FORWARD,))
                    ] * 2
    backward = [("segment", Segment(OpKind.TP_ALLREDUCE, 0, "exit", -1, 2), (OpKind.BACKWARD,))]
    for layer, part in reversed(order):
        backward += [
            ("segment", Segment(OpKind.BACKWARD, 0, part, layer, 2), (OpKind.BACKWARD,)),
            ("comm", OpKind.TP_ALLREDUCE, (part, layer, "backward"), (OpKind.BACKWARD,))] * 2
    assert tp_events == forward + backward


def test_recomputation_starts_no_collective_in_the_backward_pass(first_steps):
    """A recomputing explicit stage's backward starts exactly the collectives of one that
    keeps everything (its own all-reduces, 2 per block and sub-batch, and the exit's
    all-gather); DTensor's recomputation, by contrast, gathers its inputs again."""
    for rank in range(2):
        kept = first_steps[True, Recompute.NONE][rank].backward_collectives
        assert first_steps[True, Recompute.FULL][rank].backward_collectives == kept
        assert kept >= 2 * 4 * 2 + 1
        plain = first_steps[False, Recompute.NONE][rank].backward_collectives
        assert first_steps[False, Recompute.FULL][rank].backward_collectives > plain


def test_only_the_blocks_the_stage_memory_names_are_recomputed(first_steps):
    """Full recomputation of the stage's first two blocks: their norms run again in the
    backward pass (once more per sub-batch), the other blocks' only in the forward."""
    calls = first_steps[True, Recompute.FULL][0].norm_calls
    assert calls == {0: 8, 1: 8, 2: 4, 3: 4}
    assert first_steps[True, Recompute.NONE][0].norm_calls == {0: 4, 1: 4, 2: 4, 3: 4}


def test_every_gradient_equals_the_plain_paths(first_steps):
    """Same parameters, sharded the same way (placements and local shapes, their gradients'
    too), with the same gradients after the first step."""
    plain = first_steps[False, Recompute.NONE]
    for key in ((True, Recompute.NONE), (True, Recompute.FULL), (False, Recompute.FULL)):
        for rank, report in enumerate(first_steps[key]):
            assert report.layouts == plain[rank].layouts
            for name, grad in report.grads.items():
                np.testing.assert_allclose(grad, plain[rank].grads[name], rtol=1e-4, atol=1e-6,
                                           err_msg=f"{key} rank {rank}: {name}")


def test_gpt2_gradients_equal_the_plain_paths_with_selective_recomputation():
    plan = make_plan(TINY_GPT2, ONE_MICRO_BATCH, recompute=Recompute.SELECTIVE)
    plain = step_reports(plan)
    explicit = step_reports(with_comm(plan, {(0, 0): _sub_batches(2, keeps=True)}))
    for ours, theirs in zip(explicit, plain, strict=True):
        assert ours.layouts == theirs.layouts  # the fused QKV's strided shard included
        for name, grad in ours.grads.items():
            np.testing.assert_allclose(grad, theirs.grads[name], rtol=1e-4, atol=1e-6,
                                       err_msg=name)


def test_the_ledger_counts_what_a_recomputing_stage_keeps():
    """Full recomputation of every block keeps each part's full input ``[b, s, h]`` (two
    parts per block) until the backward pass, where DTensor's keeps each block's sequence
    shard ``[b, s/t, h]``: the ledger counts exactly that difference between the forward
    and the backward pass (give or take a few bytes of scalars), and nothing once the
    backward is done."""
    explicit = held_bytes(_llama_plan(_sub_batches(2, keeps=True), Recompute.FULL, None))
    plain = held_bytes(_llama_plan(None, Recompute.FULL, None))
    b, s, h, blocks, tp = 2, SEQ_LEN, TINY_LLAMA.hidden_size, 4, 2
    difference_bytes = (2 * blocks * b * s * h - blocks * b * (s // tp) * h) * 4
    for ours, theirs in zip(explicit, plain, strict=True):
        assert ours.after_forward - theirs.after_forward == pytest.approx(difference_bytes,
                                                                         abs=64)
        assert ours.before == ours.after_backward == 0


def test_a_backward_pass_for_the_input_only_leaves_the_parameters_alone():
    """torch's pipeline stages infer gradient shapes with ``autograd.grad`` on placeholder
    values: through an explicit stage that gives the input's gradient and accumulates
    nothing; ``backward()`` gives the same input gradient and accumulates every block
    parameter's."""
    for report in input_grad_only(_llama_plan(_sub_batches(2, keeps=True), Recompute.FULL)):
        assert report.untouched_after_grad and report.accumulated_after_backward
        np.testing.assert_allclose(report.input_grads[0], report.input_grads[1], rtol=1e-6)


def test_grad_ready_counts_one_accumulation_per_sub_batch():
    """A parameter accumulated once per sub-batch is final after ``chunks`` hooks per
    micro-batch; one hook more is an error."""
    param = torch.nn.Parameter(torch.ones(2))
    bucket = Bucket((0,), True, (SyncedParam("w", param, "block.0", None),), None)
    ready: list[tuple[int, int]] = []
    counter = GradReady([bucket], 2, lambda b, level: ready.append((b, level)),
                        accumulations={"w": 3})
    counter.start()
    for _ in range(5):
        (param * 2).sum().backward()
    assert ready == [] and counter.unfinished == 1
    (param * 2).sum().backward()
    assert ready == [(0, 0)] and counter.unfinished == 0
    with pytest.raises(RuntimeError, match="accumulated 3 times in a step of 2 micro-batches"):
        for _ in range(3):
            (param * 2).sum().backward()


def test_the_runtime_runs_the_executors_decisions_and_refuses_what_it_does_not():
    plan = with_comm(make_plan(TINY_LLAMA, TP2), {(0, 0): _sub_batches(2)})
    check_execution(plan)
    check_explicit_tp(plan)
    with pytest.raises(ConfigError, match="zero 3 does not run with the explicit TP") as err:
        check_explicit_tp(replace(plan, zero=3))
    assert "\n" not in str(err.value)
    dropout = with_comm(make_plan(replace(TINY_GPT2, dropout=True), TP2),
                        {(0, 0): _sub_batches(2)})
    with pytest.raises(ConfigError, match="does not run models with dropout"):
        check_explicit_tp(dropout)
    check_explicit_tp(make_plan(replace(TINY_GPT2, dropout=True), TP2))  # plain TP runs it
