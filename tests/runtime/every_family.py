"""A tiny config of every causal-LM family the installed transformers ships (its auto
mapping), made from each family's config class with small sizes (no downloads), and the
rank side of the test that trains each one potluck accepts under one layout.

Sizes are set under whatever name the config class uses (its ``attribute_map``); every
dropout is turned off, so every layout computes the same function. A few families'
configs reject any small size this way (their layer patterns are fixed per released
model): :data:`NO_TINY_CONFIG` names them."""

from __future__ import annotations

from typing import Any

from runtime_helpers import make_plan, pipe
from transformers import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from potluck.errors import ConfigError
from potluck.model.loading import model_from_hf_config
from potluck.model.spec import ModelSpec
from potluck.runtime.options import TrainOptions
from potluck.runtime.training import train_rank

CAUSAL_LM_TYPES = tuple(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
SIZES: dict[str, Any] = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, vocab_size=260, max_position_embeddings=64,
    pad_token_id=256, bos_token_id=257, eos_token_id=258, sliding_window=8, rotary_dim=8,
    n_positions=64, n_ctx=64, n_embd=32, n_layer=4, n_head=4, n_inner=64, d_model=32, ffn_dim=64,
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=16, shared_expert_intermediate_size=16, n_shared_experts=1,
    num_shared_experts=1, first_k_dense_replace=0, decoder_sparse_step=1, n_group=1,
    topk_group=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
    qk_head_dim=16, v_head_dim=8, mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8,
    mamba_d_state=8, mamba_chunk_size=16, state_size=8, chunk_size=16, time_step_rank=4,
)
NO_TINY_CONFIG = frozenset({
    "dots3_note", "dots3_note_text", "gemma3", "gemma3n", "gemma4", "gemma4_assistant",
    "gemma4_unified", "gemma4_unified_assistant", "got_ocr2", "gpt_neo", "kolibri1_1", "llama4",
    "mamba2", "moss_transcribe_diarize", "qwen3_5", "qwen3_5_moe", "qwen4_exp", "zamba2", "zaya",
})
SWEEP_STEPS = 2
GLOBAL_BATCH = 2


def _small(config_class: type, defaults: dict[str, Any]) -> dict[str, Any]:
    names = getattr(config_class, "attribute_map", None) or {}
    small = {names.get(key, key): value for key, value in SIZES.items()}
    small = {key: value for key, value in small.items() if key in defaults}
    small.update({key: 0.0 for key, value in defaults.items()
                  if ("dropout" in key or key.endswith("pdrop")) and isinstance(value, float)
                  and value > 0})
    if "kv_lora_rank" in defaults and "num_key_value_heads" in small:
        small["num_key_value_heads"] = SIZES["num_attention_heads"]  # latent attention: no GQA
    return small


def tiny_config(model_type: str) -> dict[str, Any]:
    """``model_type``'s config with 4 blocks of width 32 (sub-configs shrunk alike)."""
    config_class = CONFIG_MAPPING[model_type]
    defaults = config_class().to_dict()
    changes = _small(config_class, defaults)
    for key, value in defaults.items():
        if isinstance(value, dict) and value.get("model_type") in CONFIG_MAPPING:
            sub = CONFIG_MAPPING[value["model_type"]]
            changes[key] = {**value, **_small(sub, value)}
    return {**config_class(**changes).to_dict(), "model_type": model_type}


def tiny_spec(model_type: str) -> ModelSpec | ConfigError:
    """The spec potluck reads from the tiny config, or its one-line refusal."""
    try:
        return model_from_hf_config(tiny_config(model_type), f"tiny-{model_type}")
    except ConfigError as err:
        return err


def layout_of(spec: ModelSpec, layout: str) -> Any:
    """``pp``: two stages of two blocks; ``tp``: one stage split over two ranks."""
    stages = [(1, (0, 2)), (1, (2, 4))] if layout == "pp" else [(2, (0, 4))]
    return make_plan(spec, [pipe(stages, 1, GLOBAL_BATCH)])


def train_family(model_type: str, layout: str) -> list[float]:
    """Inside a rank: ``model_type``'s loss curve under ``layout``."""
    options = TrainOptions(steps=SWEEP_STEPS, lr=3e-3, seed=0, progress=False, timeout_s=120)
    spec = tiny_spec(model_type)
    assert isinstance(spec, ModelSpec), spec
    return [m.loss for m in train_rank(layout_of(spec, layout), options)]
