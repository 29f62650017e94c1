"""The Python API: a few added lines train unmodified Hugging Face models.

These run one rank in this process (a world of one needs no launcher); the
multi-rank layouts are in test_equivalence.py.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from runtime_helpers import LR, SEQ_LEN, TINY_LLAMA, make_plan, pipe, reference_losses
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from potluck.cluster.execution import Execution, preset
from potluck.errors import ConfigError
from potluck.runtime import (
    Trainer,
    TrainOptions,
    materialize,
    meta_init,
    model_spec,
    parallelize,
    start,
    train_rank,
)
from potluck.runtime.launch.checks import check_execution
from potluck.runtime.loop.batches import RandomTokens
from potluck.runtime.models.build import build_model

SHAPE = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 260,
         "max_position_embeddings": 64}
FAMILIES = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**SHAPE)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**SHAPE, tie_word_embeddings=True)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**SHAPE)),
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(
        n_embd=32, n_layer=3, n_head=4, vocab_size=260, n_positions=64, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)),
}


def _train_in_process(model: torch.nn.Module, steps: int = 3) -> list[float]:
    spec = model_spec(model)
    plan = make_plan(spec, [pipe([(1, (0, spec.num_layers))], 2, 2)])
    session = start(plan)  # the added lines start here
    try:
        parallel = parallelize(model, session)
        trainer = Trainer(parallel, lr=LR)
        data = RandomTokens(spec.vocab_size, SEQ_LEN, plan.training.global_batch)
        return [trainer.step(data.replica_rows(k, *session.layout.batch_rows)).loss
                for k in range(steps)]
    finally:
        session.close()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_unmodified_hf_model_trains_like_a_plain_loop(family):
    with meta_init():
        model = FAMILIES[family]()
    with meta_init():
        reference = FAMILIES[family]()
    materialize([reference], torch.device("cpu"), seed=0)
    expected = reference_losses(model_spec(reference), 4, model=reference)
    assert _train_in_process(model) == pytest.approx(expected, abs=2e-5)


def test_meta_init_allocates_no_parameters_and_keeps_buffers():
    with meta_init():
        model = FAMILIES["llama"]()
    assert all(p.is_meta for p in model.parameters())
    assert not model.model.rotary_emb.inv_freq.is_meta


def test_real_weights_are_kept_not_reinitialized():
    torch.manual_seed(1)
    model = FAMILIES["llama"]()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    spec = model_spec(model)
    session = start(make_plan(spec, [pipe([(1, (0, 3))], 1, 1)]))
    try:
        parallel = parallelize(model, session)
        for name, param in parallel.named_parameters():
            assert torch.equal(param.detach(), before[name]), name
    finally:
        session.close()


def test_metrics_jsonl_has_one_object_per_step(tmp_path):
    plan = make_plan(TINY_LLAMA, [pipe([(1, (0, 4))], 1, 2)])
    options = TrainOptions(steps=3, lr=LR, out_dir=str(tmp_path), progress=False)
    history = train_rank(plan, options)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3
    for step, line in enumerate(lines):
        record = json.loads(line)
        assert record["step"] == step
        for key in ("loss", "tokens_per_s", "step_time_s", "predicted_step_time_s",
                    "peak_memory_gb"):
            assert key in record
        assert record["tokens_per_s"] > 0 and record["peak_memory_gb"] > 0
    assert [m.loss for m in history] == pytest.approx(reference_losses(TINY_LLAMA, 2), abs=2e-5)


def _metrics_of_rank(plan, options):
    return [m.loss for m in train_rank(plan, options)]


def test_resume_under_another_plan_continues_the_same_loss_curve(tmp_path):
    from potluck.runtime.launch.local import run_local

    first = make_plan(TINY_LLAMA, [pipe([(1, (0, 1)), (1, (1, 4))], 2, 2)])
    second = make_plan(TINY_LLAMA, [pipe([(2, (0, 4))], 1, 1), pipe([(1, (0, 2)), (1, (2, 4))],
                                                                     1, 3)])
    common = {"lr": LR, "out_dir": str(tmp_path), "progress": False, "timeout_s": 60}
    before = run_local(_metrics_of_rank, first.devices,
                       (first, TrainOptions(steps=2, checkpoint_every=2, **common)))[0]
    after = run_local(_metrics_of_rank, second.devices,
                      (second, TrainOptions(steps=4, resume=True, **common)))[0]
    assert before + after == pytest.approx(reference_losses(TINY_LLAMA, 4, steps=4), abs=2e-5)


def test_parallelize_refuses_execution_traits_the_runtime_does_not_run():
    plan = make_plan(TINY_LLAMA, [pipe([(1, (0, 4))], 2, 2)])
    plan = replace(plan, training=replace(plan.training, execution=preset("megatron-lm-2021")))
    session = start(plan)
    try:
        with pytest.raises(ConfigError, match=r"asks for fused_kernels=true, overlap_p2p=false, "
                                              r"tied_grad_sync=pipeline-ends, "
                                              r"which potluck's runtime"):
            parallelize(build_model(TINY_LLAMA), session)
    finally:
        session.close()


def test_the_runtime_runs_the_choices_it_follows_and_any_host_time():
    plan = make_plan(TINY_LLAMA, [pipe([(1, (0, 4))], 2, 2)])
    followed = Execution(flash_attention=False, overlap_grad_reduce=False, grad_reduce_bytes=4,
                         micro_batch_overhead_s=0.002, step_overhead_s=0.01)
    check_execution(replace(plan, training=replace(plan.training, execution=followed)))
    with pytest.raises(ConfigError, match=r"asks for overlap_p2p=false, which"):
        check_execution(replace(plan, training=replace(
            plan.training, execution=replace(followed, overlap_p2p=False))))
