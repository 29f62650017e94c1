"""Uneven splits: layers over the stages of a pipeline, micro-batches over pipelines.

Both are min-max problems with identical items (blocks are identical; so are
micro-batches), solved exactly by searching over the bottleneck value:

- layers: stage ``i`` costs ``extra_i + n_i * per_layer_i`` per micro-batch (plus, where
  it may recompute, ``recompute_i`` for each block that must recompute to fit:
  :meth:`StageSlot.recomputed`) and holds at most ``max_i`` blocks in memory; its time
  never falls as blocks are added, so the smallest period ``P`` such that the blocks
  each stage takes within ``P`` sum to ``L`` is optimal, and the surplus is taken back
  from the stages closest to ``P``;
- micro-batches: pipeline ``k`` takes ``fill_k + m_k * period_k``; the
  smallest ``T`` with ``sum_k floor((T - fill_k) / period_k) >= M`` is optimal.

``uniform`` gives the classic even split (Megatron-style baseline).
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class StageSlot:
    """What one stage of a pipeline costs per block, with fixed extras and a memory cap.

    A stage that may recompute some of its blocks (``recompute_s`` > 0) keeps every block's
    activations while they fit in ``spare_bytes`` (``kept_bytes`` a block) and recomputes
    the fewest blocks that make the rest fit (each frees ``freed_bytes`` and costs
    ``recompute_s``), as the per-stage refinement later chooses; ``max_layers`` is then
    its cap with every block recomputed."""

    per_layer_s: float
    extra_s: float
    max_layers: int
    recompute_s: float = 0.0
    spare_bytes: float = 0.0
    kept_bytes: float = 0.0
    freed_bytes: float = 0.0

    def recomputed(self, layers: int) -> int:
        """The fewest of ``layers`` blocks that recompute for all of them to fit."""
        if self.recompute_s <= 0 or self.freed_bytes <= 0:
            return 0
        over = layers * self.kept_bytes - self.spare_bytes
        return min(layers, max(0, math.ceil(over / self.freed_bytes - 1e-9)))

    def time_s(self, layers: int) -> float:
        if self.recompute_s > 0 and 0 <= layers <= self.max_layers:
            return self._times[layers]
        return self._time_s(layers)

    def _time_s(self, layers: int) -> float:
        return (self.extra_s + layers * self.per_layer_s
                + self.recomputed(layers) * self.recompute_s)

    @cached_property
    def _times(self) -> tuple[float, ...]:
        """The time of every block count it holds (a stage that recomputes some)."""
        return tuple(self._time_s(n) for n in range(self.max_layers + 1))


def _layers_within(slot: StageSlot, period_s: float) -> int:
    if period_s < slot.extra_s:
        return 0
    if slot.recompute_s > 0:  # the most blocks within the period: time never falls with more
        return max(0, bisect.bisect_right(slot._times, period_s * (1 + 1e-12)) - 1)
    if slot.per_layer_s <= 0:
        return slot.max_layers
    return min(slot.max_layers, int((period_s - slot.extra_s) / slot.per_layer_s + 1e-9))


def split_layers(slots: list[StageSlot], num_layers: int, *, uniform: bool = False,
                 min_layers: int = 1) -> list[int] | None:
    """Blocks per stage minimizing the slowest stage, or None if memory cannot hold them."""
    if len(slots) * min_layers > num_layers:
        return None
    if uniform:
        return _even_layers(slots, num_layers)
    if sum(s.max_layers for s in slots) < num_layers or any(s.max_layers < min_layers for s in slots):
        return None
    candidates = sorted({s.time_s(n)
                         for s in slots for n in range(min_layers, min(s.max_layers, num_layers) + 1)})

    def enough(period_s: float) -> bool:
        counts = [_layers_within(s, period_s) for s in slots]
        return min(counts) >= min_layers and sum(counts) >= num_layers

    index = bisect.bisect_left(candidates, True, key=enough)
    if index == len(candidates):
        return None
    return _trim(slots, candidates[index], num_layers, min_layers)


def _trim(slots: list[StageSlot], period_s: float, num_layers: int, min_layers: int) -> list[int]:
    """Take the surplus back one block at a time from the currently slowest stage (the first
    of equally slow ones), kept in a heap of (-time, stage)."""
    layers = [_layers_within(s, period_s) for s in slots]
    surplus = sum(layers) - num_layers
    heap = [(-_stage_s(slots[i], layers[i]), i) for i in range(len(slots)) if layers[i] > min_layers]
    heapq.heapify(heap)
    while surplus > 0:
        _, slowest = heapq.heappop(heap)
        layers[slowest] -= 1
        surplus -= 1
        if layers[slowest] > min_layers:
            heapq.heappush(heap, (-_stage_s(slots[slowest], layers[slowest]), slowest))
    return layers


def _stage_s(slot: StageSlot, layers: int) -> float:
    return slot.time_s(layers)


def _even_layers(slots: list[StageSlot], num_layers: int) -> list[int] | None:
    base, remainder = divmod(num_layers, len(slots))
    layers = [base + (1 if i < remainder else 0) for i in range(len(slots))]
    if any(n > s.max_layers for n, s in zip(layers, slots, strict=True)):
        return None
    return layers


@dataclass(frozen=True)
class PipelineSlot:
    """``replicas`` identical pipelines, each taking ``fill + m * period`` for m micro-batches."""

    fill_s: float
    period_s: float
    replicas: int = 1
    most: int | None = None  # micro-batches one replica holds in memory at most


def split_micro_batches(slots: list[PipelineSlot], total: int, uniform: bool = False,
                        minimum: int = 0) -> list[list[int]] | None:
    """Micro-batches for every pipeline (grouped as in ``slots``) minimizing the slowest one.

    Replicas of one slot differ by at most one micro-batch; a pipeline may get none,
    which leaves its devices out, unless ``minimum`` asks for at least that many each
    (None when the total is too small); none gets more than its slot's ``most``.
    ``uniform`` gives every pipeline the same count.
    """
    pipelines = sum(slot.replicas for slot in slots)
    if minimum:
        return _split_above(slots, total, uniform, minimum)
    if total > sum(s.replicas * (total if s.most is None else s.most) for s in slots):
        return None
    if uniform:
        if total % pipelines or any(s.most is not None and total // pipelines > s.most
                                    for s in slots):
            return None
        return [[total // pipelines] * slot.replicas for slot in slots]
    low = min(s.fill_s + s.period_s for s in slots)
    high = max(s.fill_s + math.ceil(total / s.replicas) * s.period_s for s in slots)
    at_low, at_high = _counts_within(slots, low), _counts_within(slots, high)
    for _ in range(200):
        if high - low <= 1e-12 * max(1.0, high) or _settled(slots, at_low, at_high, total):
            break
        mid = 0.5 * (low + high)
        at_mid = _counts_within(slots, mid)
        if sum(at_mid) >= total:
            high, at_high = mid, at_mid
        else:
            low, at_low = mid, at_mid
    totals = _trim_totals(slots, at_high, total)
    return [_spread(count, slot.replicas) for count, slot in zip(totals, slots, strict=True)]


def _split_above(slots: list[PipelineSlot], total: int, uniform: bool,
                 minimum: int) -> list[list[int]] | None:
    """Every pipeline takes ``minimum`` first (time is linear in the count, so that is a
    later fill), then the rest is split as usual."""
    rest = total - minimum * sum(slot.replicas for slot in slots)
    if rest < 0:
        return None
    if rest == 0:
        return [[minimum] * slot.replicas for slot in slots]
    if any(s.most is not None and s.most < minimum for s in slots):
        return None
    shifted = [PipelineSlot(s.fill_s + minimum * s.period_s, s.period_s, s.replicas,
                            None if s.most is None else s.most - minimum) for s in slots]
    shares = split_micro_batches(shifted, rest, uniform)
    if shares is None:
        return None
    return [[m + minimum for m in share] for share in shares]


def _counts_within(slots: list[PipelineSlot], time_s: float) -> list[int]:
    return [_count_within(slot, time_s) for slot in slots]


def _settled(slots: list[PipelineSlot], at_low: list[int], at_high: list[int],
             total: int) -> bool:
    """Whether the bisection's counts at its upper end are already those it ends with: they
    sum to ``total`` exactly (counts never fall below it there, nor rise as the end comes
    down), or a single pipeline slot takes a single step between the ends (that step is
    where ``total`` is first reached)."""
    reached = sum(at_high)
    if reached == total:
        return True
    if reached < total or sum(at_low) >= total:
        return False
    changed = [k for k, (a, b) in enumerate(zip(at_low, at_high, strict=True)) if a != b]
    return len(changed) == 1 and at_high[changed[0]] - at_low[changed[0]] == slots[changed[0]].replicas


def _count_within(slot: PipelineSlot, time_s: float) -> int:
    if time_s < slot.fill_s + slot.period_s:
        return 0
    each = math.floor((time_s - slot.fill_s) / slot.period_s + 1e-9)
    return slot.replicas * (each if slot.most is None else min(each, slot.most))


def _slot_time(slot: PipelineSlot, count: int) -> float:
    if count == 0:
        return 0.0
    return slot.fill_s + math.ceil(count / slot.replicas) * slot.period_s


def _trim_totals(slots: list[PipelineSlot], totals: list[int], total: int) -> list[int]:
    surplus = sum(totals) - total
    while surplus > 0:
        slowest = max((k for k in range(len(totals)) if totals[k] > 0),
                      key=lambda k: (_slot_time(slots[k], totals[k]), totals[k] % slots[k].replicas))
        remove = min(surplus, _excess_over_lower_level(slots[slowest], totals[slowest]))
        totals[slowest] -= remove
        surplus -= remove
    return totals


def _excess_over_lower_level(slot: PipelineSlot, count: int) -> int:
    """Micro-batches to remove before the slot's slowest pipeline gets one fewer."""
    remainder = count % slot.replicas
    return remainder if remainder else slot.replicas


def _spread(count: int, replicas: int) -> list[int]:
    base, extra = divmod(count, replicas)
    return [base + (1 if j < extra else 0) for j in range(replicas)]
