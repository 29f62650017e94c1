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

from potluck.model.sharding import ADAPTED_MODEL_TYPES

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


def _sliding_mask(config: Any, hidden: torch.Tensor, seq_len: int) -> torch.Tensor | None:
    from transformers.masking_utils import create_sliding_window_causal_mask

    shape_probe = hidden.new_empty(hidden.shape[0], seq_len, 0)
    positions = _positions(seq_len, hidden.device)
    return create_sliding_window_causal_mask(config=config, inputs_embeds=shape_probe,
                                             attention_mask=None, cache=None,
                                             position_ids=positions)


def _one_mask(config: Any, hidden: torch.Tensor, seq_len: int) -> torch.Tensor | None:
    """The mask of a model whose blocks all attend alike (no ``layer_types``): a sliding
    window's whenever the config sets one, as Mistral's, Mixtral's and Phi-3's forward
    choose, else the causal mask."""
    if getattr(config, "sliding_window", None) is not None:
        return _sliding_mask(config, hidden, seq_len)
    return _causal_mask(config, hidden, seq_len)


MASKS = "masks"  # the context's per-layer-type masks (not a keyword of the blocks)


def layer_types(config: Any) -> list[str] | None:
    """``config.layer_types`` (full or sliding attention per block), when the model has it."""
    kinds = getattr(config, "layer_types", None)
    return list(kinds) if isinstance(kinds, list | tuple) else None


class DecoderFamily(Family):
    """Causal LMs laid out as ``model.embed_tokens``, ``model.layers``, ``model.rotary_emb``,
    ``model.norm`` and ``lm_head`` whose model forward does only that (LLaMA, Mistral, Qwen2
    and Qwen3 dense and MoE, Gemma 2, Phi-3, OLMo 2, Mixtral:
    :data:`potluck.model.sharding.ADAPTED_MODEL_TYPES`). Blocks of full and of sliding-window
    attention get their own mask (``config.layer_types``, as the models' forward builds them;
    without it, every block the sliding-window mask when the config sets a window); Gemma 2's
    final logit soft-capping is applied to the head's output."""

    def embed(self, stage: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return stage.model.embed_tokens(ids)

    def context(self, stage: nn.Module, hidden: torch.Tensor, seq_len: int) -> Context:
        positions = _positions(seq_len, hidden.device)
        config = stage.config
        kinds = layer_types(config)
        masks = {"full_attention": _one_mask(config, hidden, seq_len) if kinds is None
                 else _causal_mask(config, hidden, seq_len)}
        if kinds is not None and "sliding_attention" in kinds:
            masks["sliding_attention"] = _sliding_mask(config, hidden, seq_len)
        return {
            MASKS: (masks, kinds),
            "position_ids": positions,
            "position_embeddings": stage.model.rotary_emb(hidden, positions),
        }

    def block(self, block: nn.Module, hidden: torch.Tensor, context: Context) -> torch.Tensor:
        out = block(hidden, **self._block_kwargs(block, context))
        return out[0] if isinstance(out, tuple) else out

    def head(self, stage: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        logits = stage.lm_head(stage.model.norm(hidden))
        cap = getattr(stage.config, "final_logit_softcapping", None)
        return torch.tanh(logits / cap) * cap if cap else logits

    def attend(self, block: nn.Module, hidden: torch.Tensor, context: Context) -> torch.Tensor:
        return block.self_attn(hidden_states=hidden, **self._block_kwargs(block, context))[0]

    def _block_kwargs(self, block: nn.Module, context: Context) -> Context:
        """The context with the mask of this block's attention kind."""
        masks, kinds = context[MASKS]
        kind = "full_attention"
        if kinds is not None:
            kind = kinds[get_path(block, self.attention).layer_idx]
        kwargs = {key: value for key, value in context.items() if key != MASKS}
        kwargs["attention_mask"] = masks[kind]
        return kwargs


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


def _decoder(name: str) -> DecoderFamily:
    return DecoderFamily(
        name=name, blocks_path="model.layers", embed_paths=("model.embed_tokens",),
        head_paths=("model.norm", "lm_head"), shared_paths=("model.rotary_emb",),
        embedding_weight="model.embed_tokens.weight", head_weight="lm_head.weight",
        attention="self_attn", norms=("input_layernorm", "post_attention_layernorm"),
    )


LLAMA = _decoder("llama")  # LLaMA, Mistral, Qwen2: the explicit TP executor's blocks
GPT2 = Gpt2Family(
    name="gpt2", blocks_path="transformer.h",
    embed_paths=("transformer.wte", "transformer.wpe", "transformer.drop"),
    head_paths=("transformer.ln_f", "lm_head"), shared_paths=(),
    embedding_weight="transformer.wte.weight", head_weight="lm_head.weight", attention="attn",
    norms=("ln_1", "ln_2"),
)
_BY_MODEL_TYPE: dict[str, Family] = {
    **{model_type: _decoder(model_type) for model_type in ADAPTED_MODEL_TYPES},
    "llama": LLAMA, "mistral": LLAMA, "qwen2": LLAMA, "gpt2": GPT2,
}


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
