"""Presets of current popular models, as the ``config.json`` their authors released.

Each entry holds the keys that shape the model (sizes, heads, experts, windows, tied
embeddings, rotary settings); everything else takes transformers' defaults for the
``model_type``. They are read like any config (:mod:`potluck.model.generic`), so
their counts come from the model itself. Sources: the ``config.json`` of each model's
Hugging Face repository (meta-llama/Llama-3.1-8B, Llama-3.2-1B; Qwen/Qwen3-*; google/
gemma-2-*; microsoft/Phi-3-*; mistralai/Mixtral-8x7B-v0.1; allenai/OLMo-2-1124-*).
"""

from __future__ import annotations

from typing import Any

_LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                 "rope_theta": 500000.0}
_LLAMA32_ROPE = {**_LLAMA31_ROPE, "factor": 32.0}


def _llama3(hidden: int, layers: int, heads: int, ffn: int, *, tied: bool,
            rope: dict[str, Any], head_dim: int | None = None) -> dict[str, Any]:
    config: dict[str, Any] = {
        "model_type": "llama", "hidden_size": hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": 8, "intermediate_size": ffn,
        "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": tied, "rope_parameters": rope, "bos_token_id": 128000,
        "eos_token_id": 128001,
    }
    if head_dim:
        config["head_dim"] = head_dim
    return config


def _qwen3(hidden: int, layers: int, heads: int, ffn: int, *, tied: bool, kv_heads: int = 8,
           **moe: int) -> dict[str, Any]:
    return {
        "model_type": "qwen3_moe" if moe else "qwen3", "hidden_size": hidden,
        "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": 128, "intermediate_size": ffn,
        "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": tied, "rope_parameters": {"rope_type": "default",
                                                         "rope_theta": 1000000.0},
        "bos_token_id": 151643, "eos_token_id": 151645, **moe,
    }


def _gemma2(hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, ffn: int,
            query_scale: int) -> dict[str, Any]:
    return {
        "model_type": "gemma2", "hidden_size": hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "intermediate_size": ffn, "vocab_size": 256000, "max_position_embeddings": 8192,
        "sliding_window": 4096, "query_pre_attn_scalar": query_scale,
        "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
        "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
        "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1,
    }


def _phi3(hidden: int, layers: int, heads: int, kv_heads: int, ffn: int) -> dict[str, Any]:
    return {
        "model_type": "phi3", "hidden_size": hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "intermediate_size": ffn,
        "vocab_size": 32064, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "pad_token_id": 32000, "bos_token_id": 1,
        "eos_token_id": 32000,
    }


def _olmo2(hidden: int, layers: int, heads: int, ffn: int) -> dict[str, Any]:
    return {
        "model_type": "olmo2", "hidden_size": hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": heads, "intermediate_size": ffn,
        "vocab_size": 100352, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "pad_token_id": 100277, "bos_token_id": None,
        "eos_token_id": 100257,
    }


HF_PRESETS: dict[str, dict[str, Any]] = {
    "llama3.1-8b": _llama3(4096, 32, 32, 14336, tied=False, rope=_LLAMA31_ROPE),
    "llama3.1-70b": _llama3(8192, 80, 64, 28672, tied=False, rope=_LLAMA31_ROPE),
    "llama3.2-1b": _llama3(2048, 16, 32, 8192, tied=True, rope=_LLAMA32_ROPE, head_dim=64),
    "llama3.2-3b": _llama3(3072, 28, 24, 8192, tied=True, rope=_LLAMA32_ROPE, head_dim=128),
    "qwen3-0.6b": _qwen3(1024, 28, 16, 3072, tied=True),
    "qwen3-1.7b": _qwen3(2048, 28, 16, 6144, tied=True),
    "qwen3-4b": _qwen3(2560, 36, 32, 9728, tied=True),
    "qwen3-8b": _qwen3(4096, 36, 32, 12288, tied=False),
    "qwen3-14b": _qwen3(5120, 40, 40, 17408, tied=False),
    "qwen3-32b": _qwen3(5120, 64, 64, 25600, tied=False),
    "qwen3-30b-a3b": _qwen3(2048, 48, 32, 6144, tied=False, kv_heads=4, num_experts=128,
                            num_experts_per_tok=8, moe_intermediate_size=768),
    "qwen3-235b-a22b": _qwen3(4096, 94, 64, 12288, tied=False, kv_heads=4, num_experts=128,
                              num_experts_per_tok=8, moe_intermediate_size=1536),
    "gemma2-2b": _gemma2(2304, 26, 8, 4, 256, 9216, 256),
    "gemma2-9b": _gemma2(3584, 42, 16, 8, 256, 14336, 256),
    "gemma2-27b": _gemma2(4608, 46, 32, 16, 128, 36864, 144),
    "phi3-mini": _phi3(3072, 32, 32, 32, 8192),
    "phi3-medium": _phi3(5120, 40, 40, 10, 17920),
    "mixtral-8x7b": {
        "model_type": "mixtral", "hidden_size": 4096, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
        "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000,
        "max_position_embeddings": 32768, "sliding_window": None, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    },
    "olmo2-7b": _olmo2(4096, 32, 32, 11008),
    "olmo2-13b": _olmo2(5120, 40, 40, 13824),
}
