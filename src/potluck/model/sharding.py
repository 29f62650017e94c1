"""Which models potluck can split by tensor parallelism, and how, without code per family.

transformers declares for most architectures how their blocks shard
(``config.base_model_tp_plan``: ``"layers.*.self_attn.q_proj": "colwise"``, ...). potluck
follows that plan where it is the Megatron pattern on whole heads: column-wise Q/K/V and
gate/up projections, row-wise output and down projections, and per-head norms whose
weights are replicated with their gradients summed (Qwen3's ``q_norm``). Plans that gather
outputs (a fused QKV split by the config's head count, a norm over all heads: Phi-3,
OLMo 2) are refused, with the reason in one line, and such models are planned without
tensor parallelism.

A model with routed experts is refused whatever its plan lists, for the plan is no
statement about the experts: transformers 5.24 listed the experts in Mixtral's and the
Qwen MoEs' plans (``moe_tp_experts``), 5.25 dropped those entries (they moved to the
expert-parallel plan), and a plan that names only attention would then have split
attention and left the experts whole on every rank, each rank routing only its own
sequence shard's tokens through them: training that silently differs from one process.
The number of routed experts is read off the model itself
(:func:`potluck.model.derived.expert_count`).

Blocks run through potluck's block adapter only for the model types it has verified
(``ADAPTED_MODEL_TYPES``, tested end to end); any other causal LM is cut into pipeline
stages by tracing, which cannot shard weights, so it is planned with tp=1.
"""

from __future__ import annotations

import math
from typing import Any

# Causal LMs laid out as model.embed_tokens, model.layers, (model.rotary_emb), model.norm and
# lm_head whose model forward is only embed -> blocks (per-layer masks) -> norm -> head.
ADAPTED_MODEL_TYPES = frozenset({
    "llama", "mistral", "qwen2", "qwen3", "gemma2", "phi3", "olmo2", "mixtral", "qwen2_moe",
    "qwen3_moe",
})
HAND_WRITTEN_TP = frozenset({"gpt2"})  # GPT-2's Conv1D styles (runtime/parallel/tensor_parallel)
BLOCK_PREFIX = "layers.*."
SPLIT_STYLES = frozenset({"colwise", "rowwise", "replicated_with_grad_allreduce"})
_EXPERT_STYLES = frozenset({"moe_tp_experts", "packed_colwise", "packed_rowwise", "grouped_gemm",
                            "local_colwise", "local_rowwise", "ep_router", "local"})


def block_tp_plan(tp_plan: dict[str, str] | None) -> dict[str, str]:
    """Block-relative module path -> style for a model type potluck can split
    (empty when the plan has no block entries); see :func:`tp_refusal` for the others."""
    return {key[len(BLOCK_PREFIX):]: style for key, style in (tp_plan or {}).items()
            if key.startswith(BLOCK_PREFIX)}


def heads_problem(tp: int, heads: int, kv_heads: int, whose: str = "the model's") -> str | None:
    """Why tensor parallelism of degree ``tp`` cannot split ``heads`` attention heads and
    ``kv_heads`` key/value heads (each rank holds whole heads of both), if it cannot: the
    words after the degree, e.g. ``does not divide the model's 12 attention heads ...``;
    ``whose`` names the model in them."""
    if heads % tp == 0 and kv_heads % tp == 0:
        return None
    return (f"does not divide {whose} {heads} attention heads and {kv_heads} key/value "
            f"heads; use a divisor of {math.gcd(heads, kv_heads)}")


def tp_refusal(model_type: str, tp_plan: dict[str, Any] | None, routed_experts: int) -> str:
    """Why a model of ``model_type`` with transformers' ``tp_plan`` and ``routed_experts``
    experts per block (0: dense) cannot be split by tensor parallelism here ('' when it can)."""
    if model_type in HAND_WRITTEN_TP:
        return ""
    if model_type not in ADAPTED_MODEL_TYPES:
        return (f"{model_type} runs by tracing (no verified block adapter), which splits it "
                "into pipeline stages but not by tensor parallelism")
    block = block_tp_plan(tp_plan)
    if not block:
        return f"transformers declares no tensor-parallel plan for {model_type}'s blocks"
    if routed_experts or any(style in _EXPERT_STYLES for style in block.values()):
        return (f"{model_type}'s routed experts are not split by tensor parallelism yet; "
                "pipeline and data parallelism split it")
    other = sorted(f"{style} on {path}" for path, style in block.items()
                   if style not in SPLIT_STYLES)
    if other:
        return (f"{model_type}'s tensor-parallel plan does not split whole heads ({other[0]}): "
                "it needs outputs gathered")
    return ""
