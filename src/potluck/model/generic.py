"""A :class:`ModelSpec` for any decoder-only causal LM the installed transformers knows.

The config is read through transformers' own config class for its ``model_type`` (so
defaults and key aliases are the library's), its shape from the usual keys, and the rest
from the model built on the meta device (:mod:`potluck.model.derived`): exact parameter
counts, the block's FLOPs, whether the MLP is gated, the kind of norm, biases and
position tables. Mixture-of-experts configs name their experts, top-k and widths under
a few spellings (Mixtral, Qwen-MoE, DeepSeek, OLMoE); the number of experts is read off
the model (its ``experts`` module), top-k and widths from those keys.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from potluck.errors import ConfigError
from potluck.model.derived import build_meta_model, measure
from potluck.model.sharding import tp_refusal
from potluck.model.spec import DROPOUT_KEYS, MlpKind, ModelSpec, NormKind, ParamCounts

_TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "top_k", "num_experts_per_token")
_FFN_KEYS = ("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size", "d_ff")
_ENCODER_DECODER = "is_encoder_decoder"


def spec_from_any_config(config: dict[str, Any], name: str) -> ModelSpec:
    """The spec of a config whose ``model_type`` the hand-written readers do not cover."""
    return _cached_spec(json.dumps(config, sort_keys=True), name)


@lru_cache(maxsize=64)
def _cached_spec(config_json: str, name: str) -> ModelSpec:
    original = json.loads(config_json)
    config = _config_object(original, name)
    model = build_meta_model(config, name)
    measured = measure(model, _int(config, ("num_hidden_layers",), name), name,
                       experts_per_token=_int(config, _TOP_K_KEYS, name, 1))
    shape = _shape(config, name, measured.experts)
    return ModelSpec(
        name=name, family=str(config.model_type), **shape,
        mlp=MlpKind.SWIGLU if measured.gated_mlp else MlpKind.GELU,
        norm=NormKind.RMSNORM if measured.rms_norm else NormKind.LAYERNORM,
        tied_embeddings=measured.tied,
        learned_positions=measured.learned_positions, linear_bias=measured.linear_bias,
        qkv_bias=measured.qkv_bias, dropout=_has_dropout(config),
        params=ParamCounts(embedding=measured.embedding, block=measured.block,
                           final_norm=measured.final_norm, projection=measured.projection),
        block_flops=measured.flops, hf_config=dict(original),
        sdpa=bool(getattr(type(model), "_supports_sdpa", True)),
        tp_refusal=tp_refusal(str(config.model_type), getattr(config, "base_model_tp_plan", None),
                              measured.experts),
    )


def _config_object(original: dict[str, Any], name: str) -> Any:
    from huggingface_hub.errors import StrictDataclassError
    from transformers import CONFIG_MAPPING

    model_type = str(original.get("model_type") or "")
    if model_type not in CONFIG_MAPPING:
        raise ConfigError(f"model config {name!r}: model_type {model_type!r} is unknown to the "
                          "installed transformers; upgrade transformers or give a known model")
    fields = {key: value for key, value in original.items() if key != "model_type"}
    try:
        config = CONFIG_MAPPING[model_type].from_dict(fields)
    except (ValueError, TypeError, KeyError, AttributeError, StrictDataclassError) as err:
        raise ConfigError(f"model config {name!r}: transformers refuses it "
                          f"({_reason(err, isinstance(err, StrictDataclassError))})") from None
    if getattr(config, _ENCODER_DECODER, False):
        raise ConfigError(f"model config {name!r}: {model_type} is an encoder-decoder model; "
                          "potluck trains decoder-only causal language models")
    if hasattr(config, "add_cross_attention") and not getattr(config, "is_decoder", True):
        raise ConfigError(f"model config {name!r}: {model_type} is an encoder (its tokens see "
                          "later tokens) unless the config says is_decoder: true; set it to "
                          "train it as a causal language model")
    text = getattr(config, "get_text_config", lambda: config)()
    if text is not config:
        raise ConfigError(f"model config {name!r}: {model_type} wraps a text model with other "
                          "inputs (vision or audio); give the text model's config")
    return config


def _reason(err: Exception, cause_last: bool) -> str:
    """The line of a config class's error that says what is wrong: its first, or its last
    where the error wraps its cause (a strict dataclass's validator names itself first)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    return lines[-1] if cause_last else lines[0]


def _int(config: Any, keys: tuple[str, ...], name: str, default: int | None = None) -> int:
    for key in keys:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
    if default is not None:
        return default
    raise ConfigError(f"model config {name!r}: none of {', '.join(keys)} is a whole number of "
                      "at least 1; potluck needs it to plan the model")


def _shape(config: Any, name: str, experts: int) -> dict[str, Any]:
    """The shape fields; ``experts`` as the model holds them (a config key alone, which a
    dense model's config may carry unused, does not make a mixture of experts)."""
    hidden = _int(config, ("hidden_size",), name)
    heads = _int(config, ("num_attention_heads",), name)
    ffn = _int(config, ("moe_intermediate_size",) if experts else (), name, 0) or _int(
        config, _FFN_KEYS, name, 4 * hidden)
    head_size = _int(config, ("head_dim",), name, 0)
    return {
        "hidden_size": hidden, "num_layers": _int(config, ("num_hidden_layers",), name),
        "num_heads": heads,
        "num_kv_heads": _int(config, ("num_key_value_heads", "num_kv_heads"), name,
                             1 if getattr(config, "multi_query", False) else heads),
        "ffn_hidden_size": ffn, "vocab_size": _int(config, ("vocab_size",), name),
        "max_seq_len": _int(config, ("max_position_embeddings", "n_positions"), name, 2048),
        "head_size": 0 if head_size * heads == hidden else head_size,
        "num_experts": experts,
        "experts_per_token": _int(config, _TOP_K_KEYS, name, 1) if experts else 0,
        "shared_ffn_size": _shared_width(config, ffn) if experts else 0,
        **_window(config),
    }


def _shared_width(config: Any, expert_width: int) -> int:
    """Width of the always-active shared expert(s): Qwen-MoE names it, DeepSeek counts them."""
    width = getattr(config, "shared_expert_intermediate_size", None)
    if isinstance(width, int) and width > 0:
        return width
    count = getattr(config, "n_shared_experts", None)
    return count * expert_width if isinstance(count, int) and count > 0 else 0


def _window(config: Any) -> dict[str, int]:
    """The sliding window and how many blocks use it (``layer_types`` when given)."""
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or window < 1 or not getattr(config, "use_sliding_window", True):
        return {"sliding_window": 0, "window_layers": 0}
    layer_types = getattr(config, "layer_types", None)
    if isinstance(layer_types, list | tuple):
        windowed = sum(1 for kind in layer_types if kind == "sliding_attention")
    else:
        windowed = int(config.num_hidden_layers)
    return {"sliding_window": window if windowed else 0, "window_layers": windowed}


def _has_dropout(config: Any) -> bool:
    return any(isinstance(getattr(config, key, None), int | float)
               and not isinstance(getattr(config, key), bool) and getattr(config, key) > 0
               for key in DROPOUT_KEYS)
