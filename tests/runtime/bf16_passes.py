"""Backward passes of a bf16 ``nn.Linear(4, 1)`` that add a gradient of ones, for the tests of
gradients summed in FP32 (a bf16 sum of ones stops at 256)."""

from __future__ import annotations

import torch
from torch import nn


def micro_batch(layer: nn.Linear) -> None:
    """One backward pass that adds a gradient of ones."""
    layer(torch.ones(1, 4, dtype=torch.bfloat16)).sum().backward()


def weight_pass(layer: nn.Linear) -> None:
    """Zero bubble's weight pass: ``autograd.grad``, then written into ``.grad`` by hand, as
    torch's ``stage_backward_weight`` does."""
    out = layer(torch.ones(1, 4, dtype=torch.bfloat16)).sum()
    (grad,) = torch.autograd.grad(out, [layer.weight])
    if layer.weight.grad is None:
        layer.weight.grad = grad
    else:
        layer.weight.grad += grad


def ones_times(layer: nn.Linear, count: float) -> torch.Tensor:
    """The weight's gradient after ``count`` passes."""
    return torch.full_like(layer.weight, count)
