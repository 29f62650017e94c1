"""Fine-tuning: a run starts from a Hugging Face model directory's weights (``--init-from``).

Each model is made here from a config (no network) and saved with ``save_pretrained``;
the run's first loss must be the Hugging Face model's own loss on the same batch, in any
layout, and its curve a single process's. ``potluck export`` reads back: a run started
from an export starts from the exported weights.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
from runtime_helpers import make_plan, pipe, reference_losses, run_plan
from safetensors.torch import load_file, save_file
from transformers import (
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from potluck import api
from potluck.data.corpus import builtin_corpus_path
from potluck.data.tokenizer import ByteTokenizer
from potluck.errors import ConfigError
from potluck.model.loading import load_model
from potluck.runtime.checkpoints.export import export_run
from potluck.runtime.checkpoints.pretrained import PretrainedWeights, checked_weights
from potluck.runtime.models.build import build_model, materialize

TOLERANCE = 2e-5
SHAPE = dict(vocab_size=260, num_hidden_layers=4, num_attention_heads=4)
LLAMA = LlamaConfig(hidden_size=32, intermediate_size=64, num_key_value_heads=2,
                    max_position_embeddings=64, **SHAPE)
QWEN2_TIED = Qwen2Config(hidden_size=32, intermediate_size=64, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=True, **SHAPE)
GPT2 = GPT2Config(n_embd=32, n_positions=64, n_layer=4, n_head=4, vocab_size=260,
                  bos_token_id=257, eos_token_id=258, resid_pdrop=0.0, embd_pdrop=0.0,
                  attn_pdrop=0.0)


def _pretrained(tmp_path: Path, model_class: type, config, name: str = "hf"):
    """A model made from ``config`` with its norms moved off 1 (so they are read too),
    saved with ``save_pretrained``; the directory and the model."""
    torch.manual_seed(7)
    model = model_class(config)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name or "ln_" in param_name:
                param.add_(torch.randn_like(param) * 0.1)
    directory = tmp_path / name
    model.save_pretrained(directory)
    return directory, model


def test_pp2_x_tp2_fine_tunes_from_the_weights_like_one_process(tmp_path: Path):
    directory, hf_model = _pretrained(tmp_path, LlamaForCausalLM, LLAMA)
    spec = load_model(str(directory))
    plan = make_plan(spec, [pipe([(2, (0, 2)), (2, (2, 4))], 1, 2)])
    losses = run_plan(plan, steps=2, init_from=str(directory))
    expected = reference_losses(spec, global_batch=2, steps=2, model=hf_model)
    assert losses == pytest.approx(expected, abs=TOLERANCE)


@pytest.mark.parametrize(("model_class", "config", "stages"), [
    (Qwen2ForCausalLM, QWEN2_TIED, [(1, (0, 2)), (1, (2, 4))]),  # tied: two stages share it
    (GPT2LMHeadModel, GPT2, [(2, (0, 4))]),  # Conv1D weights, fused QKV split over tp=2
], ids=["tied qwen2 pp=2", "gpt2 tp=2"])
def test_tied_and_gpt2_models_start_from_their_weights(tmp_path: Path, model_class, config,
                                                       stages):
    directory, hf_model = _pretrained(tmp_path, model_class, config)
    spec = load_model(str(directory))
    plan = make_plan(spec, [pipe(stages, 1, 2)])
    losses = run_plan(plan, steps=1, init_from=str(directory))
    expected = reference_losses(spec, global_batch=2, steps=1, model=hf_model)
    assert losses == pytest.approx(expected, abs=TOLERANCE)


def test_experts_saved_one_per_expert_load_split_over_two_replicas(tmp_path: Path):
    """Mixtral's checkpoint holds block_sparse_moe.experts.E.w1/w2/w3; with ep=2 each
    replica reads the fused gate_up_proj and down_proj rows of its own two experts."""
    config = MixtralConfig(hidden_size=32, intermediate_size=32, num_key_value_heads=2,
                           max_position_embeddings=64, num_local_experts=4,
                           num_experts_per_tok=2, **SHAPE)
    directory, hf_model = _pretrained(tmp_path, MixtralForCausalLM, config)
    spec = load_model(str(directory))
    plan = dataclasses.replace(make_plan(spec, [pipe([(1, (0, 4))], 1, 2)] * 2),
                               expert_parallel=2)
    losses = run_plan(plan, steps=1, init_from=str(directory))
    expected = reference_losses(spec, global_batch=4, steps=1, model=hf_model)
    assert losses == pytest.approx(expected, abs=TOLERANCE)


def _hf_tokenizer(folder: Path) -> Path:
    """A Hugging Face tokenizer directory (bytes, with a mark of its own to recognize it by)."""
    ByteTokenizer().save(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 123}))
    return folder


def test_a_run_started_from_its_export_starts_from_the_exported_weights(tmp_path: Path):
    """The export holds the weights, the run's tokenizer and files of the user's umask."""
    directory, _ = _pretrained(tmp_path, Qwen2ForCausalLM, QWEN2_TIED)
    spec = load_model(str(directory))
    run = tmp_path / "run"
    run_plan(make_plan(spec, [pipe([(1, (0, 4))], 1, 1)]), steps=1, init_from=str(directory),
             out_dir=str(run), data=str(builtin_corpus_path()),
             tokenizer=str(_hf_tokenizer(tmp_path / "tokenizer")))
    exported = export_run(run, tmp_path / "export").out_dir
    tokenizer = AutoTokenizer.from_pretrained(exported)
    assert tokenizer.model_max_length == 123 and tokenizer.encode("é") == [195, 169]
    mask = os.umask(0)
    os.umask(mask)
    for file in exported.iterdir():
        assert file.stat().st_mode & 0o777 == 0o666 & ~mask, file.name
    model = build_model(load_model(str(exported)))
    materialize([model], torch.device("cpu"), seed=0,
                weights=checked_weights(exported, model, "export"))
    saved = load_file(str(exported / "model.safetensors"))
    assert set(saved) == {name for name, _ in model.named_parameters()}  # tied head: once
    for name, param in model.named_parameters():
        assert torch.equal(param, saved[name]), name
    assert model.lm_head.weight is model.model.embed_tokens.weight


def _refusal(directory: Path, config=LLAMA, model_class=LlamaForCausalLM) -> str:
    model = build_model(load_model(str(_write_config(directory, config, model_class))))
    with pytest.raises(ConfigError) as err:
        PretrainedWeights(directory).check(model, "tiny")
    message = str(err.value)
    assert "\n" not in message
    return message


def _write_config(directory: Path, config, model_class) -> Path:
    config.architectures = [model_class.__name__]
    config.save_pretrained(directory)
    return directory


def _tamper(tmp_path: Path, change) -> Path:
    directory, _ = _pretrained(tmp_path, LlamaForCausalLM, LLAMA)
    tensors = load_file(str(directory / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def test_weights_that_do_not_fit_are_refused_in_one_line(tmp_path: Path):
    cases = {
        "missing": (lambda t: t.pop("model.norm.weight"), "missing model.norm.weight"),
        "shape": (lambda t: t.update({"lm_head.weight": torch.zeros(259, 32)}),
                  "lm_head.weight is (259, 32), the model needs (260, 32)"),
        "extra": (lambda t: t.update({"model.layers.9.mlp.up_proj.weight": torch.zeros(1)}),
                  "unexpected model.layers.9.mlp.up_proj.weight"),
        "dtype": (lambda t: t.update({"model.norm.weight": torch.ones(32, dtype=torch.int64)}),
                  "model.norm.weight holds I64 values"),
    }
    for name, (change, fragment) in cases.items():
        assert fragment in _refusal(_tamper(tmp_path / name, change)), name


def test_a_sharded_checkpoint_and_a_bare_gpt2_checkpoint_load(tmp_path: Path):
    directory, hf_model = _pretrained(tmp_path, LlamaForCausalLM, LLAMA)
    hf_model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    gpt2_dir, gpt2 = _pretrained(tmp_path, GPT2LMHeadModel, GPT2, "gpt2")
    bare = {k.removeprefix("transformer."): v for k, v in gpt2.state_dict().items()
            if k != "lm_head.weight"}  # as the Hub's gpt2 holds them
    save_file({k: v.contiguous() for k, v in bare.items()}, str(gpt2_dir / "model.safetensors"))
    for folder, reference in ((tmp_path / "sharded", hf_model), (gpt2_dir, gpt2)):
        model = build_model(load_model(str(folder)))
        materialize([model], torch.device("cpu"), 0, weights=checked_weights(folder, model, "m"))
        for name, value in reference.state_dict().items():
            assert torch.equal(model.state_dict()[name], value), name


def test_init_from_names_the_model_and_the_tokenizer_when_not_given(tmp_path: Path):
    directory, _ = _pretrained(tmp_path, LlamaForCausalLM, LLAMA)
    assert api.train_options(init_from=directory).tokenizer is None  # no tokenizer: bytes
    ByteTokenizer().save(directory)
    assert api.train_options(init_from=directory).tokenizer == str(directory)
    assert api.train_options(init_from=directory, tokenizer="tok").tokenizer == "tok"
    assert api.model_to_train(None, None, directory) == directory
    assert api.model_to_train("tiny-llama", None, directory) == "tiny-llama"
    assert api.model_to_train(None, "plan.json", directory) is None  # the plan's model


def test_16_bit_weights_are_upcast_to_the_fp32_parameters(tmp_path: Path):
    directory, _ = _pretrained(tmp_path, LlamaForCausalLM, LLAMA)
    tensors = load_file(str(directory / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()},
              str(directory / "model.safetensors"))
    model = build_model(load_model(str(directory)))
    materialize([model], torch.device("cpu"), 0, weights=checked_weights(directory, model, "m"))
    for name, param in model.named_parameters():
        assert param.dtype == torch.float32
        assert torch.equal(param, tensors[name].to(torch.bfloat16).float()), name


def test_a_directory_without_weights_is_one_line(tmp_path: Path):
    _write_config(tmp_path, LLAMA, LlamaForCausalLM)
    assert "holds no model.safetensors" in _refusal(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "model.norm.weight": "../elsewhere.safetensors"}}))
    assert "which is not a file of" in _refusal(tmp_path)
