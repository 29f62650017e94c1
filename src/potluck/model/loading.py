"""Reading a model: a preset name, a ``config.json`` or a Hugging Face model directory.

LLaMA/Mistral/Qwen2 and GPT-2 configs are read by hand-written readers (their keys, also
without a ``model_type``); any other decoder-only causal LM through the model itself
(:mod:`potluck.model.generic`). Presets are the hand-written shapes of
:data:`potluck.model.spec.PRESETS` and the released configs of
:mod:`potluck.model.hf_presets`.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from potluck.errors import ConfigError
from potluck.model.hf_presets import HF_PRESETS
from potluck.model.spec import PRESETS, MlpKind, ModelSpec, NormKind
from potluck.yamlio import parse_json

ALIASES = {
    "llama3-7b": "llama3-8b", "gpt3-xl": "gpt3-1.3b", "gpt3": "gpt3-175b",
    "llama-2-7b": "llama2-7b", "llama-2-13b": "llama2-13b", "llama-2-70b": "llama2-70b",
    "llama-3-8b": "llama3-8b", "llama-3-70b": "llama3-70b",
    "llama-3.1-8b": "llama3.1-8b", "llama-3.1-70b": "llama3.1-70b",
    "llama-3.2-1b": "llama3.2-1b", "llama-3.2-3b": "llama3.2-3b",
    "mixtral-8x7b-v0.1": "mixtral-8x7b", "phi-3-mini": "phi3-mini", "phi-3-medium": "phi3-medium",
    "gemma-2-2b": "gemma2-2b", "gemma-2-9b": "gemma2-9b", "gemma-2-27b": "gemma2-27b",
    "olmo-2-7b": "olmo2-7b", "olmo-2-13b": "olmo2-13b",
}


def preset_names() -> list[str]:
    """Every preset: the hand-written shapes and the released configs (:mod:`hf_presets`)."""
    return sorted({*PRESETS, *HF_PRESETS})


def _looks_like_path(name: str) -> bool:
    """Presets are bare names; a path has a separator or a .json suffix."""
    return "/" in name or "\\" in name or name.lower().endswith(".json")


def load_model(name_or_path: str) -> ModelSpec:
    """A preset name, a ``config.json`` path or a Hugging Face model directory."""
    key = str(name_or_path).strip().lower()
    key = ALIASES.get(key, key)
    if key in PRESETS:
        return PRESETS[key]
    if key in HF_PRESETS:
        return model_from_hf_config(dict(HF_PRESETS[key]), name=key)
    path = Path(name_or_path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"model directory '{path}' has no config.json; give a Hugging Face "
                              "model directory, a config.json or a preset name")
        path = path / "config.json"
    if path.is_file():
        config = _read_json(path)
        return model_from_hf_config(config, name=_model_name(path, config))
    if _looks_like_path(str(name_or_path)):
        raise ConfigError(f"model file or directory '{path}' not found; give a local config.json "
                          "or Hugging Face model directory (nothing is downloaded), or a preset name")
    from potluck.cluster.catalog import closest_names

    names = preset_names()
    close = sorted(closest_names(key, names),  # the likeliest first: llama2-7b for llama2-7
                   key=lambda name: -difflib.SequenceMatcher(None, key, name).ratio())
    presets = f"did you mean {', '.join(close)}? give a preset" if close else \
        f"give a preset ({', '.join(names)})"
    raise ConfigError(f"unknown model {name_or_path!r}: {presets}, a config.json or a Hugging "
                      "Face model directory")


def _model_name(config_path: Path, config: dict[str, Any]) -> str:
    """A ``config.json`` is named after its folder (``gpt2-medium/config.json``: gpt2-medium,
    also when given as a bare ``config.json`` in that folder), any other file after its stem;
    without either, the config's own ``_name_or_path`` or ``model_type``."""
    if config_path.name == "config.json":
        name = config_path.resolve().parent.name
    else:
        name = config_path.stem
    if name:
        return name
    recorded = Path(str(config.get("_name_or_path") or "")).name
    return recorded or str(config.get("model_type") or "model")


def _read_json(path: Path) -> dict[str, Any]:
    data = parse_json(path, "model config")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a model config must be a JSON object")
    return data


_LLAMA_LIKE = {"llama", "mistral", "qwen2"}
_FAMILIES = ("decoder-only causal language models of the installed transformers (model_type "
             "in config.json; LLaMA, Mistral, Qwen2 and GPT-2 keys are also read without it)")
_CAUSAL_HEADS = ("ForCausalLM", "LMHeadModel")  # how transformers names decoder LM classes


def model_from_hf_config(config: dict[str, Any], name: str = "model") -> ModelSpec:
    """A spec from a ``config.json``: LLaMA/Mistral/Qwen2 and GPT-2 keys by the hand-written
    readers; any other ``model_type`` through the model itself
    (:func:`potluck.model.generic.spec_from_any_config`).

    A config without ``model_type`` is read by its keys (``n_embd``: GPT-2,
    ``intermediate_size``: LLaMA), unless its ``architectures`` name no causal language
    model (a BERT or T5 config is refused, not misread)."""
    _check_rope_scaling(config, name)
    model_type = str(config.get("model_type") or "").lower()
    if model_type and model_type != "gpt2" and model_type not in _LLAMA_LIKE:
        _check_architectures(config, name)
        from potluck.model.generic import spec_from_any_config

        return spec_from_any_config(config, name)
    if not model_type:
        _check_architectures(config, name)
    if model_type == "gpt2" or (not model_type and "n_embd" in config):
        return _from_gpt2_config(config, name)
    if model_type or "intermediate_size" in config:
        return _from_llama_config(config, name, model_type or "llama")
    raise ConfigError(f"model config {name!r} has no model_type and neither GPT-2 keys (n_embd) "
                      f"nor LLaMA keys (intermediate_size); potluck plans {_FAMILIES}")


# How transformers (5.x: modeling_rope_utils.ROPE_INIT_FUNCTIONS, and "default") scales
# rotary positions; named here, not imported: importing transformers takes seconds.
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3", "proportional")


def _check_rope_scaling(config: dict[str, Any], name: str) -> None:
    """``rope_scaling`` (``rope_parameters`` in transformers 5) is a mapping whose
    ``rope_type`` (or older ``type``) transformers knows: a misspelt one would fail only
    when the run builds the model."""
    for key in ("rope_scaling", "rope_parameters"):
        scaling = config.get(key)
        if scaling is None:
            continue
        if not isinstance(scaling, dict):
            raise ConfigError(f"model config {name!r}: {key!r} must be a mapping such as "
                              f'{{"rope_type": "linear", "factor": 2.0}}, not {scaling!r}')
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind not in ROPE_TYPES:
            raise ConfigError(f"model config {name!r}: {key} type {kind!r} is none of "
                              f"{', '.join(ROPE_TYPES)}")


# A ModelSpec size -> the config.json keys that give it (LLaMA-like and generic; GPT-2).
_SIZE_KEYS = {"hidden_size": ("hidden_size", "n_embd"),
              "num_layers": ("num_hidden_layers", "n_layer"),
              "num_heads": ("num_attention_heads", "n_head"), "vocab_size": ("vocab_size",)}


def config_contradiction(spec: ModelSpec) -> str | None:
    """Where ``spec`` and its own ``hf_config`` (the config.json the runtime builds the model
    from) disagree on a size, one line; None when they agree or it carries none. A plan
    whose model says one size and whose config another would train one model against a
    prediction for the other."""
    config = spec.hf_config or {}
    for field, keys in _SIZE_KEYS.items():
        key = next((k for k in keys if k in config), None)
        if key is not None and config[key] != getattr(spec, field):
            return (f"model.{field} {getattr(spec, field)} contradicts model.hf_config.{key} "
                    f"{config[key]!r} (the run builds the model from hf_config)")
    return None


def _architectures(config: dict[str, Any]) -> str:
    names = config.get("architectures")
    return f" ({', '.join(map(str, names))})" if isinstance(names, list) and names else ""


def _check_architectures(config: dict[str, Any], name: str) -> None:
    names = config.get("architectures")
    if not isinstance(names, list) or not names:
        return
    if not any(str(n).endswith(_CAUSAL_HEADS) for n in names):
        raise ConfigError(f"model config {name!r} is a{_architectures(config)} model, not a causal "
                          f"language model; potluck plans {_FAMILIES}")


def _need(config: dict[str, Any], key: str, name: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"model config {name!r}: {key!r} must be a whole number of at least 1, "
                          f"not {value!r}")
    return value


def _optional(config: dict[str, Any], key: str, name: str, default: int) -> int:
    """``config[key]`` when given (a whole number of at least 1), else ``default``."""
    return _need(config, key, name) if config.get(key) is not None else default


def _from_llama_config(config: dict[str, Any], name: str, family: str) -> ModelSpec:
    heads = _need(config, "num_attention_heads", name)
    hidden = _need(config, "hidden_size", name)
    head_dim = _optional(config, "head_dim", name, 0)
    return ModelSpec(
        name=name,
        family=family if family in _LLAMA_LIKE else "llama",
        hidden_size=hidden,
        num_layers=_need(config, "num_hidden_layers", name),
        num_heads=heads,
        num_kv_heads=_optional(config, "num_key_value_heads", name, heads),
        ffn_hidden_size=_need(config, "intermediate_size", name),
        vocab_size=_need(config, "vocab_size", name),
        max_seq_len=_optional(config, "max_position_embeddings", name, 2048),
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=bool(config.get("attention_bias", family == "qwen2")),
        head_size=0 if head_dim * heads == hidden else head_dim,
        hf_config=dict(config),
    )


def _from_gpt2_config(config: dict[str, Any], name: str) -> ModelSpec:
    hidden = _need(config, "n_embd", name)
    heads = _need(config, "n_head", name)
    return ModelSpec(
        name=name, family="gpt2", hidden_size=hidden,
        num_layers=_need(config, "n_layer", name),
        num_heads=heads,
        num_kv_heads=heads,
        ffn_hidden_size=_optional(config, "n_inner", name, 4 * hidden),
        vocab_size=_need(config, "vocab_size", name),
        max_seq_len=_optional(config, "n_positions", name, 1024),
        mlp=MlpKind.GELU, norm=NormKind.LAYERNORM,
        tied_embeddings=bool(config.get("tie_word_embeddings", True)),
        learned_positions=True, linear_bias=True, qkv_bias=True, dropout=_gpt2_dropout(config, name),
        hf_config=dict(config),
    )


def _gpt2_dropout(config: dict[str, Any], name: str) -> bool:
    """Whether the residual or attention dropout is on (GPT-2's default: 0.1)."""
    probabilities = [config.get(key, 0.1) for key in ("resid_pdrop", "attn_pdrop")]
    for key, value in zip(("resid_pdrop", "attn_pdrop"), probabilities, strict=True):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                                  or not 0 <= value <= 1):
            raise ConfigError(f"model config {name!r}: {key!r} must be a probability from 0 to 1, "
                              f"not {value!r}")
    return any((value or 0) > 0 for value in probabilities)
