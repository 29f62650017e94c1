"""Gradients of 16-bit parameters summed over micro-batches in FP32.

A parameter held in 16 bits on the device (optimizer offload's layout,
:meth:`~potluck.runtime.grads.offload.HostOffloadOptimizer.keep_device_parameters_in`)
gets a 16-bit ``.grad``, and autograd adds each micro-batch's gradient into it
in 16 bits: bf16 keeps 8 bits of mantissa, so every addition may drop what
falls under 1/256 of the running sum (a sum of ones stops at 256). Megatron-LM
and DeepSpeed sum in FP32; so does :class:`FP32Accumulation`, without changing
who reads ``.grad``: a tensor hook on each parameter (it runs before autograd
accumulates, and zero bubble's weight pass, whose ``autograd.grad`` captures
what the hook returns, goes through it too) adds the micro-batch's gradient into
an FP32 sum and writes the sum's rounding into ``.grad``. After every
micro-batch ``.grad`` is the 16-bit rounding of the FP32 sum, one rounding
in all instead of one per micro-batch, and the gradient sum across replicas and
the copy to the host read it as before.

The FP32 sum costs 4 bytes per parameter on the device, from a parameter's
second accumulation in a step until :meth:`FP32Accumulation.reset` (the
optimizer's ``zero_grad``); a step of one micro-batch allocates none. A
``.grad`` found ``None`` means its holder took the sum away (ZeRO-2 after each
reduce-scatter, ``zero_grad(set_to_none=True)``): the sum starts over.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial

import torch
from torch import nn


class FP32Accumulation:
    """Micro-batch gradients of ``params`` summed in FP32, ``.grad`` the sum's rounding."""

    def __init__(self, params: Iterable[nn.Parameter]) -> None:
        self._sums: dict[int, torch.Tensor] = {}
        for param in params:
            param.register_hook(partial(self._accumulate, param))

    def reset(self) -> None:
        """Drop the sums: the step is over and its gradients were zeroed."""
        self._sums.clear()

    def _accumulate(self, param: nn.Parameter, grad: torch.Tensor) -> torch.Tensor:
        """Runs on ``grad`` before autograd adds it to ``param.grad``; returns what is added."""
        if param.grad is None:  # the first accumulation (or the sum was taken): exact as it is
            self._sums.pop(id(param), None)
            return grad
        total = self._sums.get(id(param))
        if total is None:
            total = self._sums[id(param)] = param.grad.float()
        total.add_(grad)
        param.grad.copy_(total)
        return torch.zeros_like(grad)
