"""Hugging Face configs for a ModelSpec, so the runtime and the exporter build the same model.

A spec read from a ``config.json`` carries the original config
(``hf_config``); that config is rebuilt exactly, through the config class of its
``model_type``. A preset has none, so one is made from the spec's shape: a
``LlamaConfig`` for the LLaMA family, ``Qwen2Config`` for Qwen2 (biases on q, k
and v only), ``MistralConfig`` for Mistral and ``GPT2Config`` for GPT-2/3. The
tiny presets use the byte vocabulary's special ids (pad 256, bos 257, eos 258:
:mod:`potluck.model.byte_vocab`); larger presets keep the defaults of their
config class.
"""

from __future__ import annotations

from typing import Any

from transformers import (
    CONFIG_MAPPING,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
)

from potluck.errors import ConfigError
from potluck.model import byte_vocab
from potluck.model.spec import ModelSpec

_LLAMA_CLASSES: dict[str, type[PretrainedConfig]] = {
    "llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig,
}


def hf_config_for(spec: ModelSpec) -> PretrainedConfig:
    """The transformers config that builds ``spec`` (``AutoModelForCausalLM.from_config``)."""
    if spec.hf_config is not None:
        return _from_original(spec)
    if spec.family == "gpt2":
        return _gpt2_config(spec)
    if spec.family in _LLAMA_CLASSES:
        return _llama_like_config(spec)
    raise ConfigError(f"model {spec.name!r}: no Hugging Face config for family {spec.family!r}")


def _special_ids(spec: ModelSpec) -> dict[str, int]:
    """The byte vocabulary's special ids for a byte-sized vocabulary, else nothing."""
    if spec.vocab_size != byte_vocab.VOCAB_SIZE:
        return {}
    return {"pad_token_id": byte_vocab.PAD_ID, "bos_token_id": byte_vocab.BOS_ID,
            "eos_token_id": byte_vocab.EOS_ID}


def _from_original(spec: ModelSpec) -> PretrainedConfig:
    original: dict[str, Any] = dict(spec.hf_config or {})
    model_type = original.get("model_type") or spec.family
    if model_type not in CONFIG_MAPPING:
        raise ConfigError(
            f"model {spec.name!r}: this transformers does not know model_type {model_type!r}"
        )
    original.pop("model_type", None)
    return CONFIG_MAPPING[model_type].from_dict(original)


def _llama_like_config(spec: ModelSpec) -> PretrainedConfig:
    fields: dict[str, Any] = dict(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
        intermediate_size=spec.ffn_hidden_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_seq_len, tie_word_embeddings=spec.tied_embeddings,
        **_special_ids(spec),
    )
    if spec.family == "llama":
        fields["attention_bias"] = spec.qkv_bias
    return _LLAMA_CLASSES[spec.family](**fields)


def _gpt2_config(spec: ModelSpec) -> GPT2Config:
    dropout = 0.1 if spec.dropout else 0.0
    return GPT2Config(
        vocab_size=spec.vocab_size, n_positions=spec.max_seq_len, n_embd=spec.hidden_size,
        n_layer=spec.num_layers, n_head=spec.num_heads, n_inner=spec.ffn_hidden_size,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
        tie_word_embeddings=spec.tied_embeddings, **_special_ids(spec),
    )
