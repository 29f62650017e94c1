"""Model layer: model shapes (presets, HF configs) and their per-layer counts."""

from potluck.model.counts import Recompute, model_flops_per_token, total_params
from potluck.model.loading import load_model, model_from_hf_config
from potluck.model.spec import PRESETS, MlpKind, ModelSpec, NormKind

__all__ = [
    "PRESETS", "MlpKind", "ModelSpec", "NormKind", "Recompute", "load_model",
    "model_flops_per_token", "model_from_hf_config", "total_params",
]
