"""Mixture-of-experts models on CPU ranks: experts inside their stage under pipeline and
data parallelism, and the routers' auxiliary loss kept through every layout."""

from __future__ import annotations

import pytest
import torch
from family_configs import tiny_family
from runtime_helpers import make_plan, pipe
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from potluck.runtime.launch.local import run_local
from potluck.runtime.models.moe import switch_loss
from potluck.runtime.options import TrainOptions
from potluck.runtime.training import train_rank

TOLERANCE = 2e-5


def test_the_switch_loss_of_one_block_is_transformers_load_balancing_loss():
    logits = torch.randn(24, 6, generator=torch.Generator().manual_seed(0))
    for top_k in (1, 2):
        expected = load_balancing_loss_func((logits,), num_experts=6, top_k=top_k)
        assert switch_loss(logits, top_k).item() == pytest.approx(expected.item(), rel=1e-6)


def test_a_balanced_router_has_the_least_loss():
    balanced = torch.zeros(8, 4)
    skewed = torch.tensor([[4.0, 0.0, 0.0, 0.0]]).repeat(8, 1)
    assert switch_loss(balanced, 1) < switch_loss(skewed, 1)


def _curves(plan, steps: int = 4) -> list[float]:
    """Rank 0's loss and gradient norm of each step of ``plan`` on CPU ranks, in turn."""
    options = TrainOptions(steps=steps, lr=3e-3, seed=0, progress=False, timeout_s=60.0)
    results = run_local(_curve_of_rank, plan.devices, (plan, options), timeout_s=120.0)
    return results[0]


def _curve_of_rank(plan, options) -> list[float]:
    return [value for m in train_rank(plan, options) for value in (m.loss, m.grad_norm)]


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_the_auxiliary_loss_trains_alike_in_every_layout(family: str):
    """With the loss on, a pp=2 x dp=2 run of uneven stages computes one rank's losses and
    gradient norms at the same micro-batch size (the routers' gradients carry the loss
    from every stage); without it the gradients differ (it is on), the first loss not."""
    spec = tiny_family(family, output_router_logits=True, router_aux_loss_coef=5.0)
    one_rank = _curves(make_plan(spec, [pipe([(1, (0, 4))], 1, 4)]))
    spread = make_plan(spec, [pipe([(1, (0, 1)), (1, (1, 4))], 1, 2),
                              pipe([(1, (0, 3)), (1, (3, 4))], 1, 2)])
    assert _curves(spread) == pytest.approx(one_rank, abs=TOLERANCE)
    plain = _curves(make_plan(tiny_family(family), [pipe([(1, (0, 4))], 1, 4)]))
    assert plain[0] == pytest.approx(one_rank[0], abs=TOLERANCE)  # same first loss
    assert one_rank[1] > 1.5 * plain[1]  # the routers' gradients grow by the loss
