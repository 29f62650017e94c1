"""The routers' load-balancing loss of mixture-of-experts models, kept through any layout.

A model whose config asks for it (``output_router_logits: true``, with
``router_aux_loss_coef``) trains with the Switch Transformer's auxiliary loss (Fedus et
al. 2022, Eq. 4-6): for each MoE block ``E * sum_e f_e * P_e``, ``f_e`` the share of
top-k assignments routed to expert ``e`` and ``P_e`` its mean router probability over the
micro-batch's tokens. The loss is added per block, as Megatron-LM does, and averaged
over the blocks: ``coef / L * sum_l loss_l``. (transformers' own training adds one loss
over all blocks' tokens pooled, which has cross-block terms a pipeline stage cannot
compute alone; the two agree for one block.)

The routers are found from the model's own output-recording table
(``_can_record_outputs["router_logits"]``: the router class and which output holds the
logits), so no code per family. Each block's loss is attached to the block's output by
:class:`AddAuxLoss`: the forward passes the hidden states through, the backward adds the
loss's gradient, so a stage in the middle of a pipeline trains its routers without the
loss crossing the wire. A micro-batch's share is its sequences over the global batch's
(every position counted, as the token-weighted main loss does without padding).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


def switch_loss(router_logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """``E * sum_e f_e * P_e`` over the rows of ``router_logits`` (``[tokens, E]``)."""
    logits = router_logits.reshape(-1, router_logits.shape[-1]).float()
    num_experts = logits.shape[-1]
    probs = torch.softmax(logits, dim=-1)
    chosen = torch.topk(probs, top_k, dim=-1).indices
    counts = torch.zeros(num_experts, device=logits.device).scatter_add_(
        0, chosen.reshape(-1), torch.ones(chosen.numel(), device=logits.device))
    rows = logits.shape[0]
    return num_experts * torch.sum(counts / rows * probs.mean(dim=0))


class AddAuxLoss(torch.autograd.Function):
    """``hidden`` unchanged forward; backward, also the gradient of ``scale * aux``."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_shape = aux.shape
        ctx.aux_dtype = aux.dtype
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        aux_grad = torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype, device=grad.device)
        return grad, aux_grad, None


@dataclass(frozen=True)
class RouterLoss:
    """What the auxiliary loss needs: the router class, which output holds its logits, the
    top-k, the coefficient and how many MoE blocks the model has."""

    router_class: type[nn.Module]
    logits_index: int
    top_k: int
    coefficient: float
    num_blocks: int


def router_loss_of(model: nn.Module) -> RouterLoss | None:
    """The auxiliary loss ``model`` trains with, or None (no routers, or not asked for)."""
    config = getattr(model, "config", None)
    if not getattr(config, "output_router_logits", False):
        return None
    recorder = (getattr(model, "_can_record_outputs", None)
                or getattr(getattr(model, "model", None), "_can_record_outputs", None) or {})
    target = recorder.get("router_logits")
    router_class = getattr(target, "target_class", None)
    if router_class is None:
        return None
    count = sum(1 for module in model.modules() if isinstance(module, router_class))
    top_k = int(getattr(config, "num_experts_per_tok", 1) or 1)
    coefficient = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
    if not count or coefficient == 0.0:
        return None
    return RouterLoss(router_class, int(getattr(target, "index", 0)), top_k, coefficient, count)


def install_router_loss(blocks: list[nn.Module], loss: RouterLoss, share: float) -> None:
    """Hooks on ``blocks`` (this rank's): each router's logits give its block a Switch loss,
    added to the block's output with weight ``coef / L * share`` (``share``: a micro-batch's
    sequences over the global batch's)."""
    scale = loss.coefficient / loss.num_blocks * share
    for block in blocks:
        routers = [m for m in block.modules() if isinstance(m, loss.router_class)]
        if not routers:
            continue
        pending: list[torch.Tensor] = []

        def keep(_: nn.Module, __: Any, output: Any, pending: list = pending) -> None:
            logits = output[loss.logits_index] if isinstance(output, tuple | list) else output
            pending.append(switch_loss(logits, loss.top_k))

        def attach(_: nn.Module, __: Any, output: Any, pending: list = pending) -> Any:
            if not pending or not torch.is_grad_enabled():
                pending.clear()
                return output
            aux = torch.stack(pending).sum()
            pending.clear()
            if isinstance(output, tuple):
                return (AddAuxLoss.apply(output[0], aux, scale), *output[1:])
            return AddAuxLoss.apply(output, aux, scale)

        for router in routers:
            router.register_forward_hook(keep)
        block.register_forward_hook(attach)
