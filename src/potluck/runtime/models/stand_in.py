"""Stand-in models: compute a smaller model with the plan's layout and timing.

A stand-in lets a laptop dry-run (``--emulate``) a plan for a model it could
never hold: :func:`compute_plan` keeps the plan's layout (and the emulation
keeps the plan's timing) but swaps in the model that is actually computed,
``--stand-in NAME`` or ``tiny`` (:func:`tiny_stand_in`: the plan's model
shrunk to hidden size 64 and a byte vocabulary, same blocks and family). A
stand-in must have as many blocks as the plan's model, so every stage keeps
its layer range. :func:`with_stand_in_if_too_big` picks the tiny one when an
emulated model would not fit in this machine's memory.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Any

from potluck.errors import ConfigError
from potluck.model import byte_vocab
from potluck.model.loading import load_model, model_from_hf_config
from potluck.model.spec import DROPOUT_KEYS, MlpKind, ModelSpec
from potluck.plans import Plan
from potluck.runtime.options import TrainOptions

log = logging.getLogger(__name__)
TINY = "tiny"
TINY_SEQ_LEN = 128
TINY_HIDDEN = 64
TINY_SWIGLU_FFN = 172


def compute_plan(plan: Plan, options: TrainOptions) -> Plan:
    """The plan's layout with the model and sequence length that are actually computed."""
    if options.stand_in is None and options.seq_len is None:
        return plan
    if options.stand_in == TINY:
        model = tiny_stand_in(plan)
    else:
        model = load_model(options.stand_in) if options.stand_in else plan.model
    if model.num_layers != plan.model.num_layers:
        raise ConfigError(
            f"stand-in {model.name} has {model.num_layers} blocks; the plan's {plan.model.name} "
            f"has {plan.model.num_layers}; a stand-in must have the same number of blocks"
        )
    seq_len = options.seq_len or min(plan.training.seq_len, model.max_seq_len)
    return replace(plan, model=model, training=replace(plan.training, seq_len=seq_len))


def tiny_stand_in(plan: Plan) -> ModelSpec:
    """The plan's model shrunk to hidden size 64 and a byte vocabulary, same blocks and
    family, heads divisible by every TP degree of the plan."""
    max_tp = max(stage.tp for pipeline in plan.pipelines for stage in pipeline.stages)
    heads = max(4, max_tp)
    model = plan.model
    if model.params is not None and model.hf_config is not None:
        return model_from_hf_config(_tiny_config(model.hf_config, heads), f"{model.name}-tiny")
    return replace(model, name=f"{model.name}-tiny", hidden_size=TINY_HIDDEN, num_heads=heads,
                   num_kv_heads=heads, ffn_hidden_size=TINY_SWIGLU_FFN
                   if model.mlp is MlpKind.SWIGLU else 256, vocab_size=byte_vocab.VOCAB_SIZE,
                   max_seq_len=TINY_SEQ_LEN, dropout=False, hf_config=None)


# set in every shrunk config; the widths below only where the config has them
TINY_SHAPE = {"hidden_size": TINY_HIDDEN, "vocab_size": byte_vocab.VOCAB_SIZE,
              "pad_token_id": byte_vocab.PAD_ID, "bos_token_id": byte_vocab.BOS_ID,
              "eos_token_id": byte_vocab.EOS_ID}
TINY_WIDTHS = {"intermediate_size": TINY_SWIGLU_FFN, "moe_intermediate_size": TINY_HIDDEN,
               "shared_expert_intermediate_size": TINY_HIDDEN,
               "max_position_embeddings": TINY_SEQ_LEN}


def _tiny_config(config: dict[str, Any], heads: int) -> dict[str, Any]:
    """A model read through its config (any family), shrunk the same way: its config with
    the widths, vocabulary and heads of the tiny stand-in, everything else (blocks, kinds
    of attention, experts and top-k, norms) as it was, dropout off."""
    tiny = {**config, **TINY_SHAPE}
    tiny.update({key: value for key, value in TINY_WIDTHS.items() if key in config})
    tiny.update(num_attention_heads=heads, num_key_value_heads=heads,
                head_dim=TINY_HIDDEN // heads)
    tiny.update({key: 0.0 for key in DROPOUT_KEYS if key in config})
    return tiny


def with_stand_in_if_too_big(plan: Plan, options: TrainOptions) -> TrainOptions:
    """``options``, with the tiny stand-in when emulating a model (no stand-in chosen)
    that does not fit in this machine's memory."""
    if not options.emulate or options.stand_in is not None or _fits_in_memory(plan):
        return options
    log.warning("%s does not fit in this machine's memory; emulating with the tiny "
                "stand-in (same layout and timing; --stand-in to choose)", plan.model.name)
    return replace(options, stand_in=TINY)


def _fits_in_memory(plan: Plan) -> bool:
    """Whether every replica's weights, gradients and Adam states fit in half this
    machine's memory (16 bytes per parameter)."""
    from potluck.model.counts import total_params

    needed_bytes = 16.0 * total_params(plan.model) * plan.dp
    available_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return needed_bytes < 0.5 * available_bytes
