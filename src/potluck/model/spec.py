"""Model description: the shape of a decoder-only transformer.

A :class:`ModelSpec` holds what the cost model and the runtime need (hidden
size, layers, heads and their width, key/value heads, MLP kind and width, experts and
top-k, sliding windows, vocabulary, tied embeddings, and for models read through the
model itself its exact parameter counts and counted FLOPs). :mod:`potluck.model.loading`
makes one from a preset name, a Hugging Face ``config.json`` or a local model directory.
The original HF config travels with the spec so the runtime can build the exact model.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from potluck.errors import ConfigError
from potluck.model import byte_vocab
from potluck.model.sharding import heads_problem

EXPLICIT_TP_FAMILIES = frozenset({"llama", "mistral", "qwen2", "gpt2"})
# config keys of dropout probabilities, as transformers' configs spell them
DROPOUT_KEYS = ("attention_dropout", "hidden_dropout", "resid_pdrop", "attn_pdrop", "embd_pdrop",
                "dropout", "activation_dropout")
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
    tp_refusal: str = ""  # why tensor parallelism cannot split this model ('' when it can)
    sdpa: bool = True  # runs on torch's SDPA (flash) kernels; False: eager attention only
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

    def splits_by(self, tp: int) -> bool:
        """Whether tensor parallelism of degree ``tp`` can split this model's heads."""
        return tp == 1 or (not self.tp_refusal
                           and heads_problem(tp, self.num_heads, self.num_kv_heads) is None)

    @property
    def runs_explicit_tp(self) -> bool:
        """Whether the explicit TP executor (TP overlap) runs this model's blocks: pre-norm
        LLaMA-style and GPT-2 blocks (norm, attention, add; norm, MLP, add)."""
        return self.family in EXPLICIT_TP_FAMILIES and not self.tp_refusal

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
def check_seq_len(model: ModelSpec, seq_len: int, flag: str = "--seq-len") -> str | None:
    """The one rule for a sequence longer than the model's positions (``max_seq_len``): a
    model with a learned table of positions (GPT-2 and GPT-3) has no embedding for a
    position beyond it, so the request is refused; a model with rotary positions (LLaMA,
    Qwen) runs at any length but was trained no further, so the returned warning says so
    (None within the positions). ``flag`` names the setting in the messages."""
    if seq_len <= model.max_seq_len:
        return None
    if model.learned_positions:
        raise ConfigError(
            f"{flag} {seq_len} exceeds {model.name}'s {model.max_seq_len} learned positions "
            f"(it has no embedding beyond them); use {flag} {model.max_seq_len} or less"
        )
    return (f"{flag} {seq_len} is beyond {model.name}'s {model.max_seq_len} positions: its "
            "rotary positions run at any length, but it was not trained on sequences this "
            "long and its quality falls unless its RoPE is scaled (rope_scaling in its "
            f"config.json) and it is trained on them; {flag} {model.max_seq_len} or less "
            "keeps within them")


def model_to_dict(spec: ModelSpec) -> dict[str, Any]:
    """A JSON-ready description of the model (what plan files carry)."""
    from pydantic import TypeAdapter

    return TypeAdapter(ModelSpec).dump_python(spec, mode="json")


def model_from_dict(data: dict[str, Any]) -> ModelSpec:
    from pydantic import TypeAdapter

    return TypeAdapter(ModelSpec).validate_python(data)
