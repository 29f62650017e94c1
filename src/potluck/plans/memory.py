"""How each pipeline stage fits in its device's memory: plan data, no behaviour.

A plan's stages may each make a different trade of time for memory, because
pipeline schedules make memory uneven (under 1F1B the first of ``p`` stages
holds ``p`` micro-batches' activations, the last one):

- **recomputation** (Korthikanti et al. 2022): none, selective (the attention
  core) or full (only each block's input is kept), for all of the stage's
  blocks or its first ``recompute_blocks``;
- **activation swapping**: the saved activations of in-flight micro-batches
  leave the device between their forward and backward pass, in chunks, and
  are prefetched back before the backward pass; ``peer`` stashes them in the
  spare memory of another GPU of the same machine (``swap_peer``, over NVLink
  or PCIe), ``host`` in host memory over PCIe, ``hybrid`` sends part straight
  to host memory and part through a neighbouring GPU (Mbapp);
- **optimizer offload** (ZeRO-Offload, Ren et al. ATC'21): the optimizer
  states and the optimizer step live in host memory.

ZeRO sharding of model states is plan-wide (:attr:`potluck.plans.Plan.zero`):
it is per pipeline stage across that stage's data-parallel replicas by nature.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import Annotated

from pydantic import Field, NonNegativeInt

from potluck.model.counts import Recompute

Fraction = Annotated[float, Field(ge=0.0, le=1.0)]


class Swap(str, Enum):
    """Where a stage's saved activations wait for their backward pass."""

    NONE = "none"
    PEER = "peer"  # spare memory of another GPU of the same machine
    HOST = "host"  # host memory, over the GPU's PCIe link
    HYBRID = "hybrid"  # part straight to host memory, part through a neighbouring GPU

    @property
    def uses_peer(self) -> bool:
        return self in (Swap.PEER, Swap.HYBRID)

    @property
    def uses_host(self) -> bool:
        return self in (Swap.HOST, Swap.HYBRID)


class Offload(str, Enum):
    """Which model states live in host memory."""

    NONE = "none"
    OPTIMIZER = "optimizer"  # optimizer states and the optimizer step (ZeRO-Offload)


@dataclass(frozen=True)
class StageMemory:
    """One stage's recomputation, swapping and offload.

    ``recompute`` None means the plan's :attr:`~potluck.plans.Plan.recompute`;
    ``recompute_blocks`` None means every block of the stage, else its first
    ``recompute_blocks`` blocks (in layer order over its chunks) recompute and
    the rest keep all activations. ``swap_fraction`` is the share of the
    stage's blocks (its first :meth:`swapped_blocks`, in layer order) whose saved
    activations leave the device after each micro-batch's forward pass and come
    back for its backward pass; with ``hybrid``, ``host_share`` of those bytes go
    straight to host memory and the rest through ``swap_peer``.
    """

    recompute: Recompute | None = None
    recompute_blocks: NonNegativeInt | None = None
    swap: Swap = Swap.NONE
    swap_fraction: Fraction = 1.0
    swap_peer: str | None = None  # the device that holds a peer swap (or a hybrid's share)
    host_share: Fraction = 0.5
    offload: Offload = Offload.NONE

    def resolved(self, plan_recompute: Recompute) -> StageMemory:
        """This stage's memory with the plan-wide recomputation filled in."""
        return self if self.recompute is not None else replace(self, recompute=plan_recompute)

    def recompute_of_block(self, index: int, plan_recompute: Recompute) -> Recompute:
        """The recomputation of the stage's ``index``-th block (0-based, in layer order)."""
        mode = self.recompute if self.recompute is not None else plan_recompute
        if self.recompute_blocks is not None and index >= self.recompute_blocks:
            return Recompute.NONE
        return mode

    def swapped_blocks(self, num_blocks: int) -> int:
        """How many of a stage's ``num_blocks`` blocks swap (its first ones)."""
        if self.swap is Swap.NONE:
            return 0
        return min(num_blocks, round(self.swap_fraction * num_blocks))

    @property
    def swaps(self) -> bool:
        return self.swap is not Swap.NONE and self.swap_fraction > 0.0

    def describe(self, plan_recompute: Recompute) -> str:
        """A short human description, e.g. ``full x3, swap host 60%, optimizer offloaded``."""
        mode = self.recompute if self.recompute is not None else plan_recompute
        parts = [mode.value + (f" x{self.recompute_blocks}" if self.recompute_blocks is not None
                               and mode is not Recompute.NONE else "")]
        if self.swaps:
            target = f" to {self.swap_peer}" if self.swap.uses_peer and self.swap_peer else ""
            parts.append(f"swap {self.swap.value}{target} {self.swap_fraction:.0%}")
        if self.offload is not Offload.NONE:
            parts.append(f"{self.offload.value} offloaded")
        return ", ".join(parts)


KEEP_ALL = StageMemory()
