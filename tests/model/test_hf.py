"""hf_config_for builds the model the spec describes, for presets and HF configs alike."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from potluck.errors import ConfigError
from potluck.model.counts import total_params
from potluck.model.hf import hf_config_for
from potluck.model.loading import model_from_hf_config
from potluck.model.spec import PRESETS, ModelSpec


def _meta_model(config):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


TINY_MISTRAL = replace(PRESETS["tiny-llama"], name="tiny-mistral", family="mistral")
SPECS = [PRESETS[name] for name in ("tiny-llama", "tiny-gpt2", "qwen2.5-0.5b", "llama2-7b",
                                    "gpt3-125m")] + [TINY_MISTRAL]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_built_model_has_the_parameters_the_cost_model_counts(spec: ModelSpec):
    model = _meta_model(hf_config_for(spec))
    assert sum(p.numel() for p in model.parameters()) == total_params(spec)
    assert model.config.num_hidden_layers == spec.num_layers
    assert model.config.model_type == spec.family


def test_tiny_presets_use_the_byte_tokenizer_specials():
    for name in ("tiny-llama", "tiny-gpt2"):
        config = hf_config_for(PRESETS[name])
        assert (config.pad_token_id, config.bos_token_id, config.eos_token_id) == (256, 257, 258)


def test_qwen2_has_biases_on_q_k_v_only():
    model = _meta_model(hf_config_for(PRESETS["qwen2.5-0.5b"]))
    attention = model.model.layers[0].self_attn
    assert attention.q_proj.bias is not None and attention.v_proj.bias is not None
    assert attention.o_proj.bias is None
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_a_spec_from_a_config_json_rebuilds_that_exact_config():
    original = {  # a config.json as transformers 4 wrote it
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
        "intermediate_size": 172, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 300, "rope_theta": 5000.0,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 128,
    }
    config = hf_config_for(model_from_hf_config(original, "mine"))
    assert type(config).__name__ == "LlamaConfig"
    assert config.rms_norm_eps == 1e-5
    assert config.rope_parameters["rope_theta"] == 5000.0


def test_unknown_family_or_model_type_is_a_config_error():
    with pytest.raises(ConfigError, match="no Hugging Face config"):
        hf_config_for(replace(PRESETS["tiny-llama"], family="rwkv"))
    with pytest.raises(ConfigError, match="does not know model_type 'mixtral_dense'"):
        hf_config_for(replace(PRESETS["tiny-llama"], hf_config={"model_type": "mixtral_dense"}))
