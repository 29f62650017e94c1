"""Counts read off the model itself (potluck.model.derived / generic) against transformers'
own parameter count, the hand-written formulas and the published sizes of released models."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM

from potluck.errors import ConfigError
from potluck.model import counts
from potluck.model.generic import spec_from_any_config
from potluck.model.hf import hf_config_for
from potluck.model.loading import load_model, model_from_hf_config

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=300, pad_token_id=0, bos_token_id=1,
             eos_token_id=2)
TINY_FAMILIES = {
    "qwen3": dict(head_dim=32),
    "gemma2": dict(head_dim=16, sliding_window=8),
    "phi3": {},
    "olmo2": {},
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48),
    "gpt_neox": {},
    "opt": dict(ffn_dim=96, word_embed_proj_dim=64),
}


def tiny_config(model_type: str) -> dict:
    return {"model_type": model_type, **SMALL, **TINY_FAMILIES[model_type]}


@pytest.mark.parametrize("model_type", sorted(TINY_FAMILIES))
def test_derived_parameter_count_is_transformers_own(model_type: str) -> None:
    spec = model_from_hf_config(tiny_config(model_type), model_type)
    built = AutoModelForCausalLM.from_config(hf_config_for(spec))
    assert counts.total_params(spec) == sum(p.numel() for p in built.parameters())
    assert spec.params is not None and spec.block_flops is not None


@pytest.mark.parametrize("preset", ["gpt3-1.3b", "llama2-7b", "llama3-8b", "qwen2.5-7b",
                                    "qwen2.5-0.5b", "tiny-gpt2"])
def test_hand_written_formulas_equal_the_derived_counts(preset: str) -> None:
    hand = load_model(preset)
    derived = spec_from_any_config(hf_config_for(hand).to_dict(), preset)
    for count in (counts.total_params, counts.block_params, counts.embedding_params,
                  counts.head_params):
        assert count(derived) == count(hand), count.__name__
    assert counts.head_params(derived, True) == counts.head_params(hand, True)
    for seq_len in (128, 2048):
        ratio = (counts.block_forward_flops(derived, 2, seq_len)
                 / counts.block_forward_flops(hand, 2, seq_len))
        assert ratio == pytest.approx(1.0, abs=0.02)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "qwen2_moe", "qwen3", "gemma2"])
def test_counted_flops_equal_the_block_formula(model_type: str) -> None:
    """The FLOP counter (with the routed experts' top-k added) against 2 x the weights one
    token multiplies (router, top-k experts, shared expert) plus the attention core."""
    spec = model_from_hf_config(tiny_config(model_type), model_type)
    assert spec.block_flops is not None
    formula = 2.0 * counts.block_matmul_params(spec)
    assert spec.block_flops.matmul_per_token == pytest.approx(formula, rel=0.02)
    assert spec.block_flops.scores_per_key == pytest.approx(4.0 * spec.q_size, rel=1e-9)


def test_moe_active_parameters_and_flops_follow_top_k() -> None:
    spec = model_from_hf_config(tiny_config("mixtral"), "mixtral")
    dense = model_from_hf_config({**tiny_config("mixtral"), "num_local_experts": 2,
                                  "num_experts_per_tok": 2}, "two")
    assert spec.num_experts == 4 and spec.experts_per_token == 2
    # four experts hold twice the weights of two; a token uses two either way
    assert counts.total_params(spec) > counts.total_params(dense)
    assert counts.active_params(spec) == counts.active_params(dense) + 2 * 64 * 2
    assert spec.block_flops.matmul_per_token == pytest.approx(
        dense.block_flops.matmul_per_token + 2 * 64 * 2)  # the router's two more columns


def test_sliding_window_shortens_only_windowed_blocks() -> None:
    spec = model_from_hf_config(tiny_config("gemma2"), "gemma2")
    assert (spec.sliding_window, spec.window_layers) == (8, 1)
    short, long = (counts.attention_core_forward_flops(spec, 1, s) for s in (8, 64))
    assert short == 4.0 * 8 * 8 * spec.q_size
    assert long == 4.0 * 64 * (8 + 64) / 2 * spec.q_size  # one block windowed, one full


# Published totals (model cards): parameters in billions, total and active.
PUBLISHED = {
    "llama3.1-8b": (8.03, 8.03), "llama3.2-1b": (1.24, 1.24), "qwen3-8b": (8.19, 8.19),
    "qwen3-30b-a3b": (30.5, 3.3), "qwen3-235b-a22b": (235.0, 22.0), "gemma2-9b": (9.24, 9.24),
    "gemma2-27b": (27.2, 27.2), "phi3-mini": (3.82, 3.82), "mixtral-8x7b": (46.7, 12.9),
    "olmo2-7b": (7.30, 7.30),
}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_presets_have_the_published_sizes(preset: str) -> None:
    total, active = PUBLISHED[preset]
    spec = load_model(preset)
    assert counts.total_params(spec) / 1e9 == pytest.approx(total, rel=0.01)
    assert counts.active_params(spec) / 1e9 == pytest.approx(active, rel=0.02)


@pytest.mark.parametrize(("config", "message"), [
    ({"model_type": "t5"}, "encoder-decoder"),
    ({"model_type": "no-such-model", "hidden_size": 8}, "unknown to the installed transformers"),
    ({**tiny_config("qwen2_moe"), "mlp_only_layers": [0]}, "blocks differ in size"),
    ({**tiny_config("phi3"), "pad_token_id": 999}, "cannot build"),
    ({**tiny_config("qwen3"), "num_hidden_layers": 0}, "num_hidden_layers"),
    # a config class's own validator (a strict dataclass): its cause, not a traceback
    ({"model_type": "gemma3_text", **SMALL, "layer_types": ["full_attention"] * 3},
     r"refuses it \(ValueError: `num_hidden_layers` \(2\) must be equal to the number of `layer_types`"),
    # a padding id past XGLM's position table: the model cannot be built
    ({"model_type": "xglm", "d_model": 32, "ffn_dim": 64, "num_layers": 2,
      "attention_heads": 4, "vocab_size": 300, "max_position_embeddings": 16,
      "pad_token_id": 299}, "cannot build"),
    # BERT as a causal LM attends both ways unless its config says it is a decoder
    ({"model_type": "bert", "hidden_size": 32, "num_hidden_layers": 2,
      "num_attention_heads": 4, "intermediate_size": 64, "vocab_size": 300},
     "bert is an encoder .* unless the config says is_decoder: true"),
    # Mamba's block does not run under torch's FLOP counter on meta tensors; it has no heads
    ({"model_type": "mamba", "hidden_size": 32, "state_size": 4, "num_hidden_layers": 2,
      "vocab_size": 300}, "none of num_attention_heads"),
])
def test_configs_potluck_cannot_plan_get_one_line(config: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        model_from_hf_config(config, "m")
    assert "\n" not in str(err.value)
