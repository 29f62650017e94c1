"""What a search may choose and what it is pinned to: :class:`SearchOptions`.

Every field is a pin of ``potluck plan`` (``None``: let the search choose) or a
knob of the search's beams. Kept apart from the search so that the input checks
(:mod:`potluck.planner.checks`) and the search both read it without importing
each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from potluck.model.counts import Recompute
from potluck.plans.islands import SyncMethod
from potluck.plans.memory import Offload, Swap
from potluck.schedules import AUTO_SCHEDULE, Schedule


class Partition(str, Enum):
    """How layers and the batch are split over a plan's devices."""

    BALANCED = "balanced"  # layers and batch in proportion to speed (default)
    UNIFORM = "uniform"  # even split of layers and batch over every device (Megatron-style)


@dataclass(frozen=True)
class SearchOptions:
    """Pins and knobs of the search; ``None`` means 'let the search choose'."""

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    micro_batch_size: int | None = None
    recompute: Recompute | None = None
    partition: Partition = Partition.BALANCED
    schedule: Schedule | None = None  # None: auto (AUTO_SCHEDULE, said in each plan's notes)
    virtual_stages: int = 2
    zero: int | None = None  # ZeRO stage 0-3
    ep: int | None = None  # expert-parallel degree (mixtures of experts)
    swap: Swap | None = None
    offload: Offload | None = None
    top_k: int = 5
    groups: tuple[str, ...] | None = None  # only these node groups may be used
    group_tp: tuple[tuple[str, int], ...] | None = None  # TP degree pinned per node group
    family_beam: int = 3
    structure_beam: int = 64
    exact_beam: int = 32
    max_micro_batch_size: int = 32
    sharded_levels: bool = True  # go on through the ZeRO stages while sharding may pay (search)
    sync: SyncMethod | None = None  # how islands synchronize (None: auto, islands where links are slow)
    target_tokens: float | None = None  # the target loss: synchronous training's after these tokens

    @property
    def pipeline_schedule(self) -> Schedule:
        """The schedule every plan runs: the pinned one, else ``--schedule auto``'s."""
        return self.schedule or AUTO_SCHEDULE


MICRO_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)  # what the search tries when none is pinned


def micro_batch_sizes(options: SearchOptions, global_batch: int) -> list[int]:
    """The micro-batch sizes the search tries: the pinned one, else the powers of two up to
    ``max_micro_batch_size`` that divide the global batch."""
    if options.micro_batch_size:
        return [options.micro_batch_size]
    return [b for b in MICRO_BATCH_SIZES
            if b <= min(global_batch, options.max_micro_batch_size) and global_batch % b == 0]
