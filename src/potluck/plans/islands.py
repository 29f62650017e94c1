"""Islands: parts of a plan that synchronize with each other rarely (plan data, no behaviour).

Inside an island, replicas exchange gradients every step as today. Across islands, a plan
synchronizes by one of :class:`SyncMethod`:

- ``sync``: every step, as if there were one island (the default, and what a plan without
  islands does);
- ``diloco``: every ``inner_steps`` (H) steps the islands average their *pseudo-gradient*
  (the weights at the last outer step minus the weights now) and an outer optimizer applies
  it: SGD with Nesterov momentum, learning rate 0.7 and momentum 0.9 (DiLoCo, Douillard et
  al. 2023, arXiv:2311.08105, section 3). The exchange may be rounded to 16 bits or to int8
  with one scale per block of values (:class:`Compression`; OpenDiLoCo, Jaghouar et al. 2024,
  arXiv:2407.07852, found FP16 lossless; INTELLECT-1, Jaghouar et al. 2024,
  arXiv:2412.01152, all-reduced in int8), and split into ``fragments`` sent at staggered
  steps so that each overlaps the inner steps after it (streaming DiLoCo, Douillard et al.
  2025, arXiv:2501.18512);
- ``bounded``: every ``inner_steps`` steps each island's update since its last push is
  averaged with the others' while it goes on training; the average is applied at most
  ``staleness`` pushes later (wave-synchronous parallelism with bounded staleness: HetPipe,
  Park et al. ATC'20; SDPipe, Miao et al. VLDB'23). With ``staleness`` 0 it waits for each
  push: plain periodic averaging.

Each island steps its inner optimizer on its own rows only. An adaptive optimizer (Adam and
its kin) divides each step by the root of its second moment, which on a batch ``f`` times
the global one holds about ``1 / f`` times the gradient noise where noise dominates it (the
regime below the critical batch, McCandlish et al. 2018, arXiv:1812.06162). Averaging the
islands' steps then drifts ``sqrt(f)`` times slower than one optimizer on the global batch,
and its noise shrinks alike: islands averaged every step at a rate ``lr`` train as one
optimizer at ``lr * sqrt(f)`` (measured by ``benchmarks/islands_cpu.py``: README,
"Training across slow links").
``inner_lr`` ``sqrt_share`` (the default) therefore runs an island's adaptive optimizer at
``lr / sqrt(f)``, which gives back both the drift and the noise of the global batch in that
regime (Adam's square-root scaling, Malladi et al. 2022, arXiv:2205.10287); where the signal
dominates instead the right factor falls towards 1, so it is an upper bound there. An inner
SGD needs no scaling: the average of the islands' SGD steps is the global batch's.

Islands of different speeds reach each outer step together through their batch shares: a
faster island's pipelines take more rows of each global batch (the pipelines' own
``micro_batch_size`` and ``num_micro_batches``), so every island runs the same H inner steps.
Each island names its pipelines by their index in ``Plan.pipelines``; the global batch is
still the sum of every pipeline's share, all islands together. An island's ``transport``
says how its ranks reach the other islands: over the job's own backend, or staged through
host memory over gloo (islands of another vendor's accelerators, or of CPUs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Annotated

from pydantic import Field, NonNegativeInt, PositiveInt

OuterRate = Annotated[float, Field(gt=0.0, le=10.0)]
Momentum = Annotated[float, Field(ge=0.0, lt=1.0)]

DILOCO_OUTER_LR = 0.7
"""DiLoCo's outer learning rate (Douillard et al. 2023, section 3: Nesterov, lr 0.7)."""
DILOCO_OUTER_MOMENTUM = 0.9
"""DiLoCo's outer Nesterov momentum (Douillard et al. 2023, section 3)."""
DILOCO_INNER_STEPS = 500
"""DiLoCo's default H: inner steps between outer steps (Douillard et al. 2023, section 4)."""
INT8_BLOCK = 4096
"""Values that share one scale when a pseudo-gradient is rounded to int8."""


class SyncMethod(str, Enum):
    """How the islands of a plan synchronize with each other."""

    SYNC = "sync"  # every step: one island
    DILOCO = "diloco"  # every H steps, through an outer optimizer
    BOUNDED = "bounded"  # every H steps, each island at most `staleness` pushes behind


class Compression(str, Enum):
    """What one value of a cross-island exchange is rounded to on the wire."""

    NONE = "none"  # FP32
    BF16 = "bf16"
    FP16 = "fp16"
    INT8 = "int8"  # one FP32 scale per INT8_BLOCK values

    @property
    def bytes_per_value(self) -> float:
        """Bytes on the wire per exchanged value, the int8 block's scale included."""
        return {Compression.NONE: 4.0, Compression.BF16: 2.0, Compression.FP16: 2.0,
                Compression.INT8: 1.0 + 4.0 / INT8_BLOCK}[self]


class InnerLR(str, Enum):
    """The learning rate of an island's inner optimizer (module docstring)."""

    SAME = "same"  # the run's rate on every island
    SQRT_SHARE = "sqrt_share"  # adaptive optimizers: the run's rate / sqrt(island's share)

    def factor(self, share: float) -> float:
        """The multiplier of an adaptive inner optimizer's rate on an island that trains on
        ``share`` (0 < share <= 1) of the global batch."""
        return 1.0 / math.sqrt(share) if self is InnerLR.SQRT_SHARE else 1.0


class Transport(str, Enum):
    """How an island's ranks reach the other islands."""

    BACKEND = "backend"  # the job's collective backend (NCCL between NVIDIA islands)
    HOST = "host"  # staged through host memory over gloo (another vendor, CPU islands)


@dataclass(frozen=True)
class Island:
    """Pipelines (indices into ``Plan.pipelines``) that synchronize every step."""

    pipelines: tuple[NonNegativeInt, ...]
    transport: Transport = Transport.BACKEND


@dataclass(frozen=True)
class Islands:
    """How a plan's pipelines split into islands, and how the islands synchronize.

    No islands (the default) is one island of every pipeline, synchronized every step.
    """

    islands: tuple[Island, ...] = ()
    sync: SyncMethod = SyncMethod.SYNC
    inner_steps: PositiveInt = 1  # H: inner steps between exchanges (diloco, bounded)
    outer_lr: OuterRate = DILOCO_OUTER_LR  # diloco's outer SGD
    outer_momentum: Momentum = DILOCO_OUTER_MOMENTUM  # diloco's outer Nesterov momentum
    compression: Compression = Compression.NONE
    fragments: PositiveInt = 1  # streaming: parts of the model exchanged at staggered steps
    staleness: NonNegativeInt = 0  # bounded: pushes an island may run ahead of the average
    inner_lr: InnerLR = InnerLR.SQRT_SHARE  # an island's adaptive inner optimizer's rate

    @property
    def count(self) -> int:
        """How many islands (1 when the plan has none)."""
        return max(1, len(self.islands))

    @property
    def split(self) -> bool:
        """Whether the islands synchronize less often than every step."""
        return self.sync is not SyncMethod.SYNC and len(self.islands) > 1

    @property
    def host_staged(self) -> bool:
        """Whether the exchanges across islands are staged through host memory over gloo
        (some island's transport is ``host``)."""
        return self.split and any(i.transport is Transport.HOST for i in self.islands)

    def island_of(self, pipeline: int) -> int:
        """The island that pipeline ``pipeline`` belongs to (0 without islands)."""
        for index, island in enumerate(self.islands):
            if pipeline in island.pipelines:
                return index
        return 0

    def members(self, island: int, num_pipelines: int) -> tuple[int, ...]:
        """The pipelines of island ``island`` (every pipeline without islands)."""
        if not self.islands:
            return tuple(range(num_pipelines))
        return self.islands[island].pipelines

    def fragment_of(self, unit_index: int, num_units: int) -> int:
        """The fragment that the ``unit_index``-th of ``num_units`` parameter units (the
        embedding, each block, the head, in model order) is exchanged with: contiguous runs
        of units, as streaming DiLoCo splits a model by layers."""
        return min(self.fragments - 1, unit_index * self.fragments // max(1, num_units))

    @property
    def overlap_steps(self) -> int:
        """Inner steps a diloco fragment's exchange overlaps before its average is applied:
        ``H // F``, until the next fragment is due (streaming DiLoCo); 0 with one fragment
        (blocking)."""
        return 0 if self.fragments == 1 else max(1, self.inner_steps // self.fragments)

    def exchanges_at(self, step: int, fragment: int) -> bool:
        """Whether fragment ``fragment`` is exchanged after inner step ``step`` (1-based):
        fragment ``f`` every H steps, offset by ``f * H / fragments`` (streaming DiLoCo)."""
        if not self.split:
            return True
        offset = fragment * self.inner_steps // self.fragments
        return step > 0 and step % self.inner_steps == offset


ONE_ISLAND = Islands()
