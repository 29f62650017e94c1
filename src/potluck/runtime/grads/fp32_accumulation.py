"""Gradients of 16-bit parameters summed over micro-batches in FP32.

A parameter held in 16 bits on the device (16-bit weights with FP32 masters,
:mod:`~potluck.runtime.grads.master_weights`, and optimizer offload's layout)
gets a 16-bit ``.grad``, and autograd would add each micro-batch's gradient into
it in 16 bits: bf16 keeps 8 bits of mantissa, so every addition may drop what
falls under 1/256 of the running sum (a sum of ones stops at 256). Megatron-LM
and DeepSpeed sum in FP32; so does :class:`FP32Accumulation`, through a tensor
hook on each parameter: it runs before autograd accumulates, and zero bubble's
weight pass, whose ``autograd.grad`` captures what the hook returns, goes
through it too.

Two modes, per parameter:

- **final only** (a parameter in ``finals``, which says how many accumulations
  make its gradient final for a step: the micro-batches, times an explicit TP
  stage's sub-batches). Until the last one, each micro-batch's gradient is added
  into the FP32 sum and ``.grad`` is dropped as soon as autograd wrote it (a
  post-accumulate-grad hook; a weight pass's is dropped at the next
  accumulation); the last one writes the sum's rounding into ``.grad``, and the
  sum is freed. Between micro-batches a parameter costs its 2-byte weight and
  its 4-byte sum, as Megatron-LM's FP32 ``main_grad`` buffer, not also a 16-bit
  gradient; the gradient sum across replicas, the norm, the optimizer and the
  copy to the host read the final ``.grad`` as before. A parameter that gets
  fewer gradients than expected in a step (an expert no token was routed to)
  gets its sum's rounding at :meth:`FP32Accumulation.finish` (the end of the
  schedule, before the remaining buckets are summed); one that gets more than
  expected is summed in the other mode from then on, still in FP32.
- **every micro-batch** (any other parameter: ZeRO-2's, whose ``.grad`` is
  reduce-scattered and taken after every micro-batch). ``.grad`` is the 16-bit
  rounding of the FP32 sum after every micro-batch, one rounding in all
  instead of one per micro-batch. A ``.grad`` found ``None`` means its holder
  took the sum away: the sum starts over.

The sums live from a parameter's first (every micro-batch: second)
accumulation in a step until it is final or until :meth:`FP32Accumulation.reset`
(the optimizer's ``zero_grad``); a step of one micro-batch allocates none.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from functools import partial

import torch
from torch import nn


class FP32Accumulation:
    """Micro-batch gradients of ``params`` summed in FP32 (module doc); ``finals``: by
    ``id``, the accumulations that make a parameter's gradient final for a step."""

    def __init__(self, params: Iterable[nn.Parameter],
                 finals: Mapping[int, int] | None = None) -> None:
        self._sums: dict[int, torch.Tensor] = {}
        self._counts: dict[int, int] = {}
        self._params: dict[int, nn.Parameter] = {}
        self._finals = dict(finals or {})
        for param in params:
            self._params[id(param)] = param
            param.register_hook(partial(self._accumulate, param))
            if id(param) in self._finals:
                param.register_post_accumulate_grad_hook(self._drop_unfinished)

    def params(self) -> list[nn.Parameter]:
        """The parameters whose gradients are summed here."""
        return list(self._params.values())

    def reset(self) -> None:
        """Drop the sums and counts: the step is over and its gradients were zeroed."""
        self._sums.clear()
        self._counts.clear()

    def finish(self) -> None:
        """At the end of a step's schedule: a final-only parameter that got fewer
        gradients than expected gets its sum's rounding as ``.grad`` now."""
        for key in [k for k in self._sums if k in self._finals]:
            param = self._params[key]
            if self._counts.get(key, 0) < self._finals[key]:
                param.grad = self._sums.pop(key).to(param.dtype)

    def _accumulate(self, param: nn.Parameter, grad: torch.Tensor) -> torch.Tensor:
        """Runs on ``grad`` before autograd adds it to ``param.grad``; returns what is added."""
        key = id(param)
        count = self._counts[key] = self._counts.get(key, 0) + 1
        final = self._finals.get(key)
        if final is None or count > final:
            return self._round_every_time(param, grad)
        param.grad = None  # a weight pass's gradient, already in the sum
        total = self._sums.get(key)
        if count < final:
            if total is None:
                self._sums[key] = grad.float()
            else:
                total.add_(grad)
            return grad  # autograd writes it; _drop_unfinished drops it
        if total is None:  # a step of one accumulation: exact as it is
            return grad
        del self._sums[key]
        return total.add_(grad).to(grad.dtype)

    def _drop_unfinished(self, param: nn.Parameter) -> None:
        """After autograd wrote a final-only parameter's gradient: drop it unless final."""
        if self._counts.get(id(param), 0) < self._finals[id(param)]:
            param.grad = None

    def _round_every_time(self, param: nn.Parameter, grad: torch.Tensor) -> torch.Tensor:
        if param.grad is None:  # the first accumulation (or the sum was taken): exact as it is
            self._sums.pop(id(param), None)
            return grad
        total = self._sums.get(id(param))
        if total is None:
            total = self._sums[id(param)] = param.grad.float()
        total.add_(grad)
        param.grad.copy_(total)
        return torch.zeros_like(grad)
