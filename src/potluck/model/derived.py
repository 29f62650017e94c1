"""What the cost model needs, read off the model itself instead of written per family.

Any decoder-only ``AutoModelForCausalLM`` of the installed transformers whose blocks
live in one ``nn.ModuleList`` is built from its config on the meta device (no memory,
no weights) and measured:

- parameters, exactly: the embedding (everything the input embedding tables hold), one
  block (all blocks must be alike; every expert of a mixture included), the final norm
  and the output projection (tied or not); their sum is transformers' own count;
- forward FLOPs of a block, by torch's FLOP counter on a meta forward at two sequence
  lengths, split into a part per token (the matmuls) and a part per token and key (the
  attention scores and values, which eager attention computes as the full square; a
  sliding window is applied from the config, as :meth:`ModelSpec.mean_keys_per_query`
  does). Routed experts cannot run on meta tensors (which tokens reach which expert
  depends on values), so their FLOPs are ``2 * top-k * weights of one expert`` per
  token, counted from the experts' parameters; the router and any shared expert are
  counted by the counter;
- the shape fields the time and memory model price (widths, heads, head width, experts
  and top-k, the MLP's kind from its parameters, the norm's kind from its class).

The hand-written formulas of :mod:`potluck.model.counts` stay for the families they
cover (LLaMA, Mistral, Qwen2, GPT-2); tests hold them to these counts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from potluck.errors import ConfigError
from potluck.model.spec import BlockFlops

log = logging.getLogger(__name__)

COUNT_SEQ_LENS = (16, 32)  # two lengths separate the per-token and per-key FLOPs
GATE_NAMES = ("gate_proj.weight", "gate_up_proj", "gate_up_proj.weight", "w3.weight")


@dataclass(frozen=True)
class Measured:
    """What the meta model says about itself."""

    embedding: int
    block: int
    final_norm: int
    projection: int
    experts: int  # routed experts per block (0: a dense MLP)
    flops: BlockFlops | None
    tied: bool
    gated_mlp: bool
    rms_norm: bool
    learned_positions: bool
    linear_bias: bool
    qkv_bias: bool


def build_meta_model(config: Any, name: str) -> nn.Module:
    """``AutoModelForCausalLM.from_config`` on the meta device (eager attention)."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    except (ValueError, KeyError, IndexError, AssertionError, TypeError, AttributeError,
            RuntimeError) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(f"model config {name!r}: transformers cannot build a causal language "
                          f"model from it ({reason})") from None


def largest_block_list(model: nn.Module, num_layers: int) -> tuple[str, nn.ModuleList] | None:
    """The path and the ``nn.ModuleList`` of ``num_layers`` modules holding the most
    parameters (the blocks), or None."""
    candidates = [(_numel(module.parameters()), path)
                  for path, module in model.named_modules()
                  if isinstance(module, nn.ModuleList) and len(module) == num_layers and path]
    if not candidates:
        return None
    path = max(candidates)[1]
    return path, model.get_submodule(path)


def find_block_list(model: nn.Module, num_layers: int, name: str) -> tuple[str, nn.ModuleList]:
    """:func:`largest_block_list`, or one line saying there is none."""
    found = largest_block_list(model, num_layers)
    if found is None:
        raise ConfigError(f"model {name!r}: {type(model).__name__} keeps no list of its "
                          f"{num_layers} blocks in one nn.ModuleList; potluck cannot split it")
    return found


def measure(model: nn.Module, num_layers: int, name: str, *, experts_per_token: int = 0
            ) -> Measured:
    """Parameters, FLOPs, routed experts and kinds of ``model`` (built on meta by
    :func:`build_meta_model`); ``experts_per_token`` is its top-k, if it has experts."""
    path, blocks = find_block_list(model, num_layers, name)
    sizes = [_numel(block.parameters()) for block in blocks]
    if len(set(sizes)) > 1:
        raise ConfigError(
            f"model {name!r}: its blocks differ in size ({_ranges(sizes)}); potluck plans models "
            "whose blocks are alike (a dense-then-MoE or interleaved layout is not supported yet)"
        )
    embedding, projection = _embedding_and_projection(model)
    tied = _is_tied(model)
    final_norm = _numel(model.parameters()) - sum(sizes) - embedding - (0 if tied else projection)
    block = blocks[0]
    experts = expert_count(block)
    return Measured(
        embedding=embedding, block=sizes[0], final_norm=final_norm, projection=projection,
        experts=experts, tied=tied,
        flops=_block_flops(model, path, name, experts_per_token, experts),
        gated_mlp=_gated(block), rms_norm=_rms_norm(block),
        learned_positions=_learned_positions(model), linear_bias=_all_biased(block),
        qkv_bias=_any_biased(block),
    )


def _numel(params: Any) -> int:
    return sum(p.numel() for p in params)


def _ranges(sizes: list[int]) -> str:
    distinct = sorted(set(sizes), key=sizes.index)
    return ", ".join(f"{sizes.count(size)} of {size:,} parameters" for size in distinct)


def _embedding_and_projection(model: nn.Module) -> tuple[int, int]:
    """Parameters of every embedding table outside the blocks, and of the output projection."""
    head = model.get_output_embeddings()
    projection = head.weight.numel() if head is not None else 0
    tables = {id(module): module for module in model.modules()
              if isinstance(module, nn.Embedding) and module is not head}
    return sum(_numel(table.parameters()) for table in tables.values()), projection


def _is_tied(model: nn.Module) -> bool:
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    return head is not None and embedding is not None and head.weight is embedding.weight


def _linears(block: nn.Module) -> list[nn.Module]:
    return [m for m in block.modules() if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"]


def _all_biased(block: nn.Module) -> bool:
    linears = _linears(block)
    return bool(linears) and all(getattr(m, "bias", None) is not None for m in linears)


def _any_biased(block: nn.Module) -> bool:
    return any(getattr(m, "bias", None) is not None for m in _linears(block))


def _rms_norm(block: nn.Module) -> bool:
    return any("RMSNorm" in type(m).__name__ for m in block.modules())


def _gated(block: nn.Module) -> bool:
    """Whether the MLP multiplies two projections (SwiGLU, GeGLU): a gate projection, alone
    or fused with the up projection (also as the experts' 3-D weights)."""
    return any(name.endswith(GATE_NAMES) for name, _ in block.named_parameters())


def _learned_positions(model: nn.Module) -> bool:
    """Whether a position table sits beside the token embedding (GPT-2, OPT)."""
    inputs = model.get_input_embeddings()
    return any(isinstance(m, nn.Embedding) and m is not inputs
               and m is not model.get_output_embeddings() for m in model.modules())


def expert_count(block: nn.Module) -> int:
    """Routed experts of a block: the leading size of fused 3-D expert weights, or the
    length of a list of expert MLPs (0 without a module named ``experts``)."""
    for path, module in block.named_modules():
        if path.rsplit(".", 1)[-1] != "experts":
            continue
        if isinstance(module, nn.ModuleList):
            return len(module)
        fused = [p for p in module.parameters(recurse=False) if p.dim() == 3]
        if fused:
            return int(fused[0].shape[0])
    return 0


def _experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules named ``experts`` (fused 3-D expert weights or a list of expert MLPs)."""
    return [(path, module) for path, module in model.named_modules()
            if path.rsplit(".", 1)[-1] == "experts"]


def _block_flops(model: nn.Module, blocks_path: str, name: str, experts_per_token: int,
                 num_experts: int) -> BlockFlops | None:
    """FLOPs of the first block from torch's FLOP counter at two sequence lengths (None,
    with a log line, when the model does not run on meta tensors)."""
    experts = _experts_modules(model)
    first_block = [(path, module) for path, module in experts
                   if path.startswith(f"{blocks_path}.0.")]
    expert_flops = _expert_flops_per_token(first_block, experts_per_token, num_experts)
    saved = {id(module): module.forward for _, module in experts}
    for _, module in experts:
        module.forward = _skip_experts  # type: ignore[method-assign]
    try:
        per_length = [_counted_block_flops(model, blocks_path, s) for s in COUNT_SEQ_LENS]
    except (RuntimeError, NotImplementedError, TypeError, ValueError, AssertionError) as err:
        # AssertionError: torch's module tracker on a block whose output has no autograd
        # history (Mamba's reference scan on meta tensors)
        log.info("model %s does not run on meta tensors (%s); its block FLOPs come from the "
                 "formulas", name, str(err).splitlines()[0] if str(err) else type(err).__name__)
        return None
    finally:
        for _, module in experts:
            module.forward = saved[id(module)]  # type: ignore[method-assign]
    (s1, f1), (s2, f2) = zip(COUNT_SEQ_LENS, per_length, strict=True)
    # f(s) = a*s + c*s^2 for one sequence: solve for a and c
    scores = (f2 / s2 - f1 / s1) / (s2 - s1)
    matmul = f1 / s1 - scores * s1
    return BlockFlops(matmul_per_token=matmul + expert_flops, scores_per_key=scores)


def _skip_experts(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """Stands in for the routed experts while counting (their FLOPs are added apart)."""
    return torch.zeros_like(hidden_states)


def _expert_flops_per_token(experts: list[tuple[str, nn.Module]], experts_per_token: int,
                            num_experts: int) -> float:
    if not experts or not num_experts:
        return 0.0
    weights = sum(_numel(module.parameters()) for _, module in experts)
    return 2.0 * experts_per_token * weights / num_experts


def _counted_block_flops(model: nn.Module, blocks_path: str, seq_len: int) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    ids = torch.ones(1, seq_len, dtype=torch.long, device="meta")
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    key = f"{type(model).__name__}.{blocks_path}.0"
    counts = counter.get_flop_counts()
    if key not in counts:
        raise RuntimeError(f"the FLOP counter saw no module {key}")
    return float(sum(counts[key].values()))
