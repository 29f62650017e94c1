"""Tiny configs of the model families the README's table lists, made in the test (no
downloads): 4 blocks, hidden 32, the byte vocabulary, no dropout, every family's own
features kept (Qwen3's per-head norms and wider heads, Gemma 2's windows and soft-capping,
Phi-3's fused projections, OLMo 2's post-norms, experts and top-k routing, OLMo 3's two
rotary tables, GPT-NeoX's own initializer range)."""

from __future__ import annotations

from typing import Any

from potluck.model.loading import model_from_hf_config
from potluck.model.spec import ModelSpec

BASE: dict[str, Any] = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, vocab_size=260,
                            max_position_embeddings=64, pad_token_id=256, bos_token_id=257,
                            eos_token_id=258)

FAMILIES: dict[str, dict[str, Any]] = {
    "llama3.2": dict(model_type="llama", head_dim=16, tie_word_embeddings=True,
                     rope_parameters={"rope_type": "llama3", "factor": 32.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 16,
                                      "rope_theta": 500000.0}),
    "qwen3": dict(model_type="qwen3", head_dim=16),
    "gemma2": dict(model_type="gemma2", head_dim=8, sliding_window=8, query_pre_attn_scalar=8),
    "phi3": dict(model_type="phi3"),
    "olmo2": dict(model_type="olmo2"),
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=16),
    # traced (no block adapter): pipeline and data parallel only; a spread of initial values
    # of its own (traced stages have no config to read it from)
    "gpt_neox": dict(model_type="gpt_neox", initializer_range=0.006),
    # traced, its forward calls the rotary module twice (the split names the copy rotary_emb@1)
    "olmo3": dict(model_type="olmo3"),
    # a traced mixture of experts (its router's histogram dtype depends on the device)
    "olmoe": dict(model_type="olmoe", num_experts=4, num_experts_per_tok=2),
}


def tiny_family(name: str, **changes: Any) -> ModelSpec:
    """The tiny spec of ``name`` (a key of :data:`FAMILIES`)."""
    return model_from_hf_config({**BASE, **FAMILIES[name], **changes}, f"tiny-{name}")
