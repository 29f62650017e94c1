"""How to run a slice of an unmodified Hugging Face causal LM.

A :class:`Family` names where a model keeps its embedding, its blocks (one
``nn.ModuleList``), its final norm and head, and runs each piece the way the
model's own ``forward`` does: embed token ids, build what every block needs
(positions, rotary tables, the causal mask), run one block, apply the head.
A pipeline stage is then "embed (first stage), my blocks, head (last stage)"
without touching the model's code.

Supported: LLaMA-style models (``LlamaForCausalLM``, ``MistralForCausalLM``,
``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``) and ``GPT2LMHeadModel``. Any other
module goes through the tracing split (:mod:`potluck.runtime.models.traced`).

Hidden states between blocks may be sequence shards (sequence parallel):
``seq_len`` given to :meth:`Family.context` is the full length. The explicit
tensor-parallel executor (:mod:`potluck.runtime.parallel.tp_overlap`) runs a block
as its two parts instead: ``norms[0]`` then :meth:`Family.attend`, ``norms[1]``
then the block's ``mlp``, adding the residuals itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from potluck.errors import ConfigError

Context = dict[str, Any]


def get_path(root: nn.Module, path: str) -> nn.Module:
    module = root
    for part in path.split("."):
        module = getattr(module, part)
    return module


def has_path(root: nn.Module, path: str) -> bool:
    try:
        get_path(root, path)
    except AttributeError:
        return False
    return True


@dataclass(frozen=True)
class Family:
    """Where the pieces of one model family live, and how they run."""

    name: str
    blocks_path: str
    embed_paths: tuple[str, ...]
    head_paths: tuple[str, ...]
    shared_paths: tuple[str, ...]  # parameter-free helpers every stage needs (rotary tables)
    embedding_weight: str  # FQN of the input embedding matrix
    head_weight: str  # FQN of the output projection
    attention: str  # the attention submodule of a block (selective recomputation wraps it)
    norms: tuple[str, str]  # a block's norms before attention and before the MLP
    supports_tp: bool = True

    def embed(self, stage: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def context(self, stage: nn.Module, hidden: torch.Tensor, seq_len: int) -> Context:
        raise NotImplementedError

    def block(self, block: nn.Module, hidden: torch.Tensor, context: Context) -> torch.Tensor:
        raise NotImplementedError

    def head(self, stage: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def attend(self, block: nn.Module, hidden: torch.Tensor, context: Context) -> torch.Tensor:
        """A block's attention on its already normalized input (no residual)."""
        raise NotImplementedError


def _positions(seq_len: int, device: torch.device) -> torch.Tensor:
    return torch.arange(seq_len, device=device).unsqueeze(0)


def _causal_mask(config: Any, hidden: torch.Tensor, seq_len: int) -> torch.Tensor | None:
    """The model's own causal mask (None where attention takes ``is_causal``)."""
    from transformers.masking_utils import create_causal_mask

    shape_probe = hidden.new_empty(hidden.shape[0], seq_len, 0)
    positions = _positions(seq_len, hidden.device)
    return create_causal_mask(config=config, inputs_embeds=shape_probe, attention_mask=None,
                              cache=None, position_ids=positions)


class LlamaFamily(Family):
    """LLaMA, Mistral, Qwen2, Qwen3: embed_tokens, layers, rotary_emb, norm, lm_head."""

    def embed(self, stage: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return stage.model.embed_tokens(ids)

    def context(self, stage: nn.Module, hidden: torch.Tensor, seq_len: int) -> Context:
        positions = _positions(seq_len, hidden.device)
        return {
            "attention_mask": _causal_mask(stage.config, hidden, seq_len),
            "position_ids": positions,
            "position_embeddings": stage.model.rotary_emb(hidden, positions),
        }

    def block(self, block: nn.Module, hidden: torch.Tensor, context: Context) -> torch.Tensor:
        out = block(hidden, **context)
        return out[0] if isinstance(out, tuple) else out

    def head(self, stage: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return stage.lm_head(stage.model.norm(hidden))

    def attend(self, block: nn.Module, hidden: torch.Tensor, context: Context) -> torch.Tensor:
        return block.self_attn(hidden_states=hidden, **context)[0]


class Gpt2Family(Family):
    """GPT-2: wte + wpe (learned positions), dropout, h, ln_f, lm_head (tied to wte)."""

    def embed(self, stage: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        t = stage.transformer
        positions = _positions(ids.shape[1], ids.device)
        return t.drop(t.wte(ids) + t.wpe(positions))

    def context(self, stage: nn.Module, hidden: torch.Tensor, seq_len: int) -> Context:
        return {"attention_mask": _causal_mask(stage.config, hidden, seq_len)}

    def block(self, block: nn.Module, hidden: torch.Tensor, context: Context) -> torch.Tensor:
        out = block(hidden, None, context["attention_mask"])
        return out[0] if isinstance(out, tuple) else out

    def head(self, stage: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return stage.lm_head(stage.transformer.ln_f(hidden))

    def attend(self, block: nn.Module, hidden: torch.Tensor, context: Context) -> torch.Tensor:
        return block.attn(hidden, None, context["attention_mask"])[0]


LLAMA = LlamaFamily(
    name="llama", blocks_path="model.layers", embed_paths=("model.embed_tokens",),
    head_paths=("model.norm", "lm_head"), shared_paths=("model.rotary_emb",),
    embedding_weight="model.embed_tokens.weight", head_weight="lm_head.weight",
    attention="self_attn", norms=("input_layernorm", "post_attention_layernorm"),
)
QWEN3 = LlamaFamily(
    name="qwen3", blocks_path="model.layers", embed_paths=("model.embed_tokens",),
    head_paths=("model.norm", "lm_head"), shared_paths=("model.rotary_emb",),
    embedding_weight="model.embed_tokens.weight", head_weight="lm_head.weight",
    attention="self_attn", norms=("input_layernorm", "post_attention_layernorm"),
    supports_tp=False,  # q_norm/k_norm weights are shared by the heads TP splits
)
GPT2 = Gpt2Family(
    name="gpt2", blocks_path="transformer.h",
    embed_paths=("transformer.wte", "transformer.wpe", "transformer.drop"),
    head_paths=("transformer.ln_f", "lm_head"), shared_paths=(),
    embedding_weight="transformer.wte.weight", head_weight="lm_head.weight", attention="attn",
    norms=("ln_1", "ln_2"),
)
_BY_MODEL_TYPE = {"llama": LLAMA, "mistral": LLAMA, "qwen2": LLAMA, "qwen3": QWEN3, "gpt2": GPT2}


def detect_family(model: nn.Module) -> Family | None:
    """The family adapter for ``model``, or None when it must be traced."""
    config = getattr(model, "config", None)
    family = _BY_MODEL_TYPE.get(str(getattr(config, "model_type", "")))
    if family is None:
        return None
    paths = (family.blocks_path, *family.embed_paths, *family.head_paths, *family.shared_paths)
    if not all(has_path(model, path) for path in paths):
        return None
    return family


def blocks_of(model: nn.Module, family: Family) -> nn.ModuleList:
    return get_path(model, family.blocks_path)


def is_tied(model: nn.Module, family: Family) -> bool:
    """Whether the head's projection is the embedding matrix itself."""
    params = dict(model.named_parameters(remove_duplicate=False))
    return params[family.head_weight] is params[family.embedding_weight]


def check_sequence(model: nn.Module, seq_len: int) -> None:
    """Sliding-window attention is only exact here while the window covers the sequence."""
    config = getattr(model, "config", None)
    window = getattr(config, "sliding_window", None)
    uses_window = getattr(config, "use_sliding_window", True)
    if window and uses_window and seq_len > window:
        raise ConfigError(
            f"sequence length {seq_len} exceeds the model's sliding window {window}; "
            "potluck runs full causal attention, train with --seq-len at most the window"
        )
