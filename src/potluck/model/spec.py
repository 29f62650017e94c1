"""Model description: the shape of a decoder-only transformer.

A :class:`ModelSpec` holds what the cost model and the runtime need (hidden
size, layers, heads, key/value heads, MLP kind and width, vocabulary, tied
embeddings). It comes from a preset name (``gpt3-1.3b``, ``llama2-7b``,
``qwen2.5-7b``, ...), from a Hugging Face ``config.json`` (LLaMA, Mistral,
Qwen2 and GPT-2 keys) or from a local Hugging Face model directory. The
original HF config travels with the spec so the runtime can build the exact
model.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import Any

from potluck.errors import ConfigError
from potluck.model import byte_vocab
from potluck.model.hf_presets import HF_PRESETS
from potluck.yamlio import parse_json

MAX_SIZE = 2**31 - 1  # any width, depth or vocabulary (their products stay exact floats)


class MlpKind(str, Enum):
    GELU = "gelu"  # fc1 -> GeLU -> fc2 (GPT-2/3)
    SWIGLU = "swiglu"  # gate, up -> SiLU(gate) * up -> down (LLaMA, Mistral, Qwen2)


class NormKind(str, Enum):
    LAYERNORM = "layernorm"
    RMSNORM = "rmsnorm"


@dataclass(frozen=True)
class ParamCounts:
    """Exact parameter counts read off the model itself, built from its config on the meta
    device (:mod:`potluck.model.derived`): what the formulas of
    :mod:`potluck.model.counts` give for the families they know, for any model."""

    embedding: int  # everything used before the first block (token and position tables)
    block: int  # one block, every expert included
    final_norm: int  # everything after the last block but the output projection
    projection: int  # the output projection's matrix (counted again when tied and apart)


@dataclass(frozen=True)
class BlockFlops:
    """Forward FLOPs of one block measured by torch's FLOP counter
    (:mod:`potluck.model.derived`): ``matmul_per_token * b*s + scores_per_key * b*s*keys``."""

    matmul_per_token: float
    scores_per_key: float


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer, as far as planning and building it need."""

    name: str
    family: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    vocab_size: int
    max_seq_len: int
    mlp: MlpKind = MlpKind.SWIGLU
    norm: NormKind = NormKind.RMSNORM
    tied_embeddings: bool = False
    learned_positions: bool = False
    linear_bias: bool = False
    qkv_bias: bool = False
    dropout: bool = False
    head_size: int = 0  # per-head width when it is not hidden_size / num_heads (Qwen3, Gemma)
    num_experts: int = 0  # routed experts per block (mixture of experts); 0: a dense MLP
    experts_per_token: int = 0  # top-k routing
    shared_ffn_size: int = 0  # width of the always-active shared expert(s), summed
    sliding_window: int = 0  # keys each query sees in windowed blocks (0: none)
    window_layers: int = 0  # how many of the blocks use the window
    params: ParamCounts | None = None  # exact counts derived from the model itself
    block_flops: BlockFlops | None = None  # counted on the model itself
    hf_config: dict[str, Any] | None = field(default=None, compare=False, hash=False)

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "ffn_hidden_size", "vocab_size", "max_seq_len"):
            if not 1 <= getattr(self, name) <= MAX_SIZE:
                raise ConfigError(f"model {self.name!r}: {name} must be from 1 to {MAX_SIZE:,}, "
                                  f"not {getattr(self, name)}")
        if not self.head_size and self.hidden_size % self.num_heads:
            raise ConfigError(
                f"model {self.name!r}: hidden_size {self.hidden_size} is not a multiple of "
                f"num_heads {self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model {self.name!r}: num_heads {self.num_heads} is not a multiple of "
                f"num_kv_heads {self.num_kv_heads}"
            )

        if self.num_experts and not 1 <= self.experts_per_token <= self.num_experts:
            raise ConfigError(
                f"model {self.name!r}: experts_per_token must be from 1 to num_experts "
                f"{self.num_experts}, not {self.experts_per_token}"
            )
        if not 0 <= self.window_layers <= self.num_layers:
            raise ConfigError(f"model {self.name!r}: window_layers must be from 0 to "
                              f"num_layers {self.num_layers}, not {self.window_layers}")

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden_size // self.num_heads

    @property
    def q_size(self) -> int:
        """Width of the queries (and of the attention output): heads x head width."""
        return self.head_dim * self.num_heads

    @property
    def kv_hidden_size(self) -> int:
        return self.head_dim * self.num_kv_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def mean_keys_per_query(self, seq_len: int) -> float:
        """Keys each query is scored against, averaged over the blocks (the full square,
        as SC'21 counts it, shortened to the window in windowed blocks)."""
        windowed = min(seq_len, self.sliding_window) if self.sliding_window else seq_len
        return (self.window_layers * windowed
                + (self.num_layers - self.window_layers) * seq_len) / self.num_layers


def _gpt3(name: str, layers: int, hidden: int, heads: int) -> ModelSpec:
    return ModelSpec(
        name=name, family="gpt2", hidden_size=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=heads, ffn_hidden_size=4 * hidden, vocab_size=50257, max_seq_len=2048,
        mlp=MlpKind.GELU, norm=NormKind.LAYERNORM, tied_embeddings=True,
        learned_positions=True, linear_bias=True, qkv_bias=True, dropout=True,
    )


def _llama(name: str, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int,
           vocab: int, seq: int, *, family: str = "llama", tied: bool = False,
           qkv_bias: bool = False) -> ModelSpec:
    return ModelSpec(
        name=name, family=family, hidden_size=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=kv_heads, ffn_hidden_size=ffn, vocab_size=vocab, max_seq_len=seq,
        tied_embeddings=tied, qkv_bias=qkv_bias,
    )


def _qwen(name: str, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int,
          vocab: int, *, tied: bool) -> ModelSpec:
    return _llama(name, layers, hidden, heads, kv_heads, ffn, vocab, 32768, family="qwen2",
                  tied=tied, qkv_bias=True)


# Shapes from the papers and the released config.json files: GPT-3 (Brown et al. 2020,
# Table 2.1; 1.3B with 16 heads of 128 as in Megatron-LM), LLaMA-2 (Touvron et al. 2023),
# LLaMA-3 (Meta 2024), Qwen2.5 (Qwen team 2024).
PRESETS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        _gpt3("gpt3-125m", 12, 768, 12),
        _gpt3("gpt3-350m", 24, 1024, 16),
        _gpt3("gpt3-760m", 24, 1536, 16),
        _gpt3("gpt3-1.3b", 24, 2048, 16),
        _gpt3("gpt3-2.7b", 32, 2560, 32),
        _gpt3("gpt3-6.7b", 32, 4096, 32),
        _gpt3("gpt3-13b", 40, 5120, 40),
        _gpt3("gpt3-175b", 96, 12288, 96),
        _llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 4096),
        _llama("llama2-13b", 40, 5120, 40, 40, 13824, 32000, 4096),
        _llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000, 4096),
        _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192),
        _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192),
        _qwen("qwen2.5-0.5b", 24, 896, 14, 2, 4864, 151936, tied=True),
        _qwen("qwen2.5-1.5b", 28, 1536, 12, 2, 8960, 151936, tied=True),
        _qwen("qwen2.5-3b", 36, 2048, 16, 2, 11008, 151936, tied=True),
        _qwen("qwen2.5-7b", 28, 3584, 28, 4, 18944, 152064, tied=False),
        _qwen("qwen2.5-14b", 48, 5120, 40, 8, 13824, 152064, tied=False),
        _qwen("qwen2.5-32b", 64, 5120, 40, 8, 27648, 152064, tied=False),
        _qwen("qwen2.5-72b", 80, 8192, 64, 8, 29568, 152064, tied=False),
        # Tiny models for the demo and tests: byte-level vocabulary (256 bytes + 4 specials).
        _llama("tiny-llama", 4, 64, 4, 2, 172, byte_vocab.VOCAB_SIZE, 256),
        replace(_gpt3("tiny-gpt2", 4, 64, 4), vocab_size=byte_vocab.VOCAB_SIZE, max_seq_len=256,
                ffn_hidden_size=256),
    )
}
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
    close = closest_names(str(name_or_path), names)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    raise ConfigError(
        f"unknown model {name_or_path!r}: {hint}give a preset ({', '.join(names)}), "
        "a config.json or a Hugging Face model directory"
    )


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
    head_dim = _optional(config, "head_dim", name, hidden // heads)
    if head_dim * heads != hidden:
        raise ConfigError(
            f"model config {name!r}: head_dim x num_attention_heads != hidden_size is not supported"
        )
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


def model_to_dict(spec: ModelSpec) -> dict[str, Any]:
    """A JSON-ready description of the model (what plan files carry)."""
    from pydantic import TypeAdapter

    return TypeAdapter(ModelSpec).dump_python(spec, mode="json")


def model_from_dict(data: dict[str, Any]) -> ModelSpec:
    from pydantic import TypeAdapter

    return TypeAdapter(ModelSpec).validate_python(data)
