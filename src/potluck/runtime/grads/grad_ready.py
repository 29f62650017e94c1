"""When a bucket's gradients are final (or, under ZeRO-2, ready for their next reduction).

The gradient sum of a bucket may start once every gradient in it has been
accumulated for every micro-batch of the step (or, with ``levels``, for the
``t``-th time, for each of the bucket's thresholds ``t``: ZeRO-2 reduces a
bucket after every micro-batch). Two things write gradients:

- a full backward pass accumulates into ``.grad`` and then calls
  its post-accumulate-grad hook (``Tensor.register_post_accumulate_grad_hook``);
  a parameter used twice in one pass (a tied embedding and head in one
  module) accumulates once per pass;
- zero bubble splits the backward: the input pass only computes input
  gradients (``autograd.grad``, no accumulation) and the later weight pass
  writes ``.grad`` directly (``stage_backward_weight``), or runs a full
  backward on the first stage. :meth:`GradReady.weight_pass` wraps that pass
  and counts one accumulation for every parameter of the stage, ignoring
  the hooks inside it;
- the explicit TP executor (:mod:`potluck.runtime.parallel.tp_overlap`) runs a
  stage's blocks in sub-batches, each with its own backward: their parameters'
  hooks fire once per sub-batch, and ``accumulations`` says how many hooks
  make one micro-batch's accumulation.

A parameter accumulated more often than expected means the count was wrong
and an all-reduce may have started too early: that is an error, never a
silent wrong gradient. A parameter that gets no gradient is simply never
final; its bucket starts when the schedule is over.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager

from torch import nn

from potluck.runtime.grads.buckets import Bucket


class GradReady:
    """Counts this step's gradient accumulations; calls ``on_ready(bucket index, level)``
    when every parameter of a bucket has been accumulated ``levels[bucket][level]`` times
    (default one level: every micro-batch, the gradient is final); a parameter named in
    ``accumulations`` counts one accumulation per that many hooks."""

    def __init__(self, buckets: Sequence[Bucket], micro_batches: int,
                 on_ready: Callable[[int, int], None],
                 levels: Sequence[Sequence[int]] | None = None,
                 accumulations: Mapping[str, int] | None = None) -> None:
        self.expected = micro_batches
        self.on_ready = on_ready
        self.levels = [tuple(t) for t in levels] if levels is not None else \
            [(micro_batches,)] * len(buckets)
        self._where: dict[int, tuple[int, int, str]] = {}  # id(param) -> slot, bucket, name
        self._sizes = [len(bucket.items) for bucket in buckets]
        self._hooks_per_accumulation: list[int] = []
        for index, bucket in enumerate(buckets):
            for item in bucket.items:
                self._where[id(item.param)] = (len(self._where), index, item.name)
                self._hooks_per_accumulation.append((accumulations or {}).get(item.name, 1))
                item.param.register_post_accumulate_grad_hook(self._hook)
        self._hooks: list[int] = []
        self._counts: list[int] = []
        self._reached: list[list[int]] = []  # per bucket and level: parameters that reached it
        self.unfinished = 0  # tracked parameters whose gradient is not final yet
        self.armed = False
        self._paused = False

    def start(self) -> None:
        self._counts = [0] * len(self._where)
        self._hooks = [0] * len(self._where)
        self._reached = [[0] * len(levels) for levels in self.levels]
        self.unfinished = len(self._where)
        self._paused = False
        self.armed = True

    def stop(self) -> None:
        self.armed = False

    def _hook(self, param: nn.Parameter) -> None:
        if not self.armed or self._paused:
            return
        slot = self._where[id(param)][0]
        self._hooks[slot] += 1
        if self._hooks[slot] % self._hooks_per_accumulation[slot] == 0:
            self._accumulated(param)

    def _accumulated(self, param: nn.Parameter) -> None:
        slot, bucket, name = self._where[id(param)]
        self._counts[slot] += 1
        count = self._counts[slot]
        if count > self.expected:
            raise RuntimeError(
                f"the gradient of {name} was accumulated {count} times in a step of "
                f"{self.expected} micro-batches; its all-reduce may have started too early"
            )
        if count == self.expected:
            self.unfinished -= 1
        levels = self.levels[bucket]
        if count not in levels:
            return
        level = levels.index(count)
        self._reached[bucket][level] += 1
        if self._reached[bucket][level] == self._sizes[bucket]:
            self.on_ready(bucket, level)

    @contextmanager
    def weight_pass(self, module: nn.Module) -> Iterator[None]:
        """One weight-gradient pass of ``module``: one accumulation of each of its parameters."""
        if not self.armed:
            yield
            return
        self._paused = True
        try:
            yield
        finally:
            self._paused = False
        for param in module.parameters():
            if id(param) in self._where:
                self._accumulated(param)
