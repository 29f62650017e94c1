"""Per-stage memory choices of a candidate plan: the lightest that fits each stage.

The search lays plans out with plan-wide settings (one recomputation mode, ZeRO stage,
offload, whether stages may swap); pipeline schedules make memory uneven (under 1F1B
the first of ``p`` stages holds ``p`` micro-batches, the last one), so
:func:`refine_memory` then gives every stage its own
:class:`~potluck.plans.memory.StageMemory`: for each recomputation mode the fewest
recomputed blocks that fit, for each swap kind the fewest swapped blocks that fit
(alone, or on top of full recomputation), with or without the optimizer offloaded, and
keeps the one whose iteration share (``m`` micro-batches of stage time, plus its
optimizer step) is smallest. Peer swaps stash in the spare memory of another device of
the plan on the same machine, the one with most room once every stage has chosen
without peers. Pinned techniques (:class:`~potluck.planner.options.SearchOptions`) are
forced on every stage, even where they do not pay. Every choice is priced by the one
cost model (:class:`~potluck.planner.cost.CostModel`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace

from potluck.cluster.topology import Device
from potluck.model.counts import Recompute
from potluck.planner.cost import CostModel, StageShape, usable_memory_bytes
from potluck.planner.evaluate import (
    HOST_OS_RESERVE_BYTES,
    HOST_RANK_RESERVE_BYTES,
    stage_sharding,
)
from potluck.planner.formulas import StateSharding
from potluck.planner.options import SearchOptions
from potluck.plans import Pipeline, Plan
from potluck.plans.memory import Offload, StageMemory, Swap
from potluck.schedules import schedule_for


@dataclass(frozen=True)
class _Stage:
    """One stage as the refinement sees it."""

    ref: tuple[int, int]
    devices: tuple[Device, ...]
    base: StageShape  # no recomputation, no swap, no offload
    in_flight: float
    micro_batches: int
    sharding: StateSharding  # the plan's ZeRO, no offload


@dataclass(frozen=True)
class _Choice:
    memory: StageMemory
    score_s: float  # the stage's share of an iteration
    device_bytes: float
    host_bytes: float  # per device
    peer_bytes: float  # per device, on memory.swap_peer


def refine_memory(plan: Plan, cost: CostModel, options: SearchOptions, offload: bool
                  ) -> Plan | None:
    """``plan`` with every stage's lightest memory choice that fits, None if some stage
    fits none (``offload``: stages may offload their optimizer)."""
    return cost.remembered(("refine_memory", plan, options, offload),
                           lambda: _Refiner(plan, cost, options, offload).run())


class _Refiner:
    def __init__(self, plan: Plan, cost: CostModel, options: SearchOptions, offload: bool) -> None:
        self.plan, self.cost, self.options = plan, cost, options
        self.offloads = _offloads(options, offload)
        self.stages = list(self._stages())
        self.ranks_on = Counter(d.node for s in self.stages for d in s.devices)  # per machine
        self.host_used: dict[str, float] = {}
        self.held: dict[str, float] = {}
        self.need: dict[str, float] = {}
        # per stage, what each memory choice needs and scores whatever the rest of the plan
        # holds: tables the cost model keeps, as a stage recurs in many candidate plans (at
        # every memory level) and each is probed at many block counts
        self.needs = {s.ref: cost.remembered(
            ("stage_needs", s.devices[0].type, len(s.devices), s.base, s.in_flight, s.sharding),
            dict) for s in self.stages}
        self.scores = {s.ref: cost.remembered(
            ("stage_scores", s.devices, s.base, s.micro_batches, s.sharding), dict)
            for s in self.stages}

    def _stages(self) -> Iterator[_Stage]:
        plan = self.plan
        schedule = schedule_for(plan.schedule)
        for k, pipeline in enumerate(plan.pipelines):
            for i, stage in enumerate(pipeline.stages):
                sharding = replace(stage_sharding(plan, k, i), offload=False)
                devices = tuple(self.cost.cluster.device(d) for d in stage.devices)
                base = StageShape(stage.num_layers, i == 0, i == pipeline.pp - 1, pipeline.pp,
                                  pipeline.micro_batch_size,
                                  tp_overlap_chunks=stage.comm.tp_overlap_chunks,
                                  keeps_comm=stage.comm.recompute_keeps_comm)
                in_flight = schedule.in_flight(i, pipeline.pp, pipeline.num_micro_batches,
                                               plan.virtual_stages)
                yield _Stage((k, i), devices, base, in_flight, pipeline.num_micro_batches,
                             sharding)

    def run(self) -> Plan | None:
        chosen: dict[tuple[int, int], _Choice] = {}
        self.provisional: dict[tuple[int, int], _Choice] = {}
        peer_kinds = [s for s in self._swaps() if s.uses_peer]
        own_kinds = [s for s in self._swaps() if not s.uses_peer]
        for stage in self.stages:  # every stage on its own first (no peers)
            choice = self._best(stage, own_kinds, None) if own_kinds else None
            if choice is None and not peer_kinds:
                return None
            if choice is not None:
                chosen[stage.ref] = choice
                self._account(stage, choice)
            else:  # pinned to peers: hold its own bytes without swapping until it gets one
                self.provisional[stage.ref] = self._unchecked(stage)
                self._account(stage, self.provisional[stage.ref])
        if peer_kinds:  # then peer swaps, heaviest stages first, where they fit and pay
            for stage in sorted(self.stages, key=lambda s: -s.in_flight):
                if not self._try_peers(stage, peer_kinds, chosen):
                    return None
        return self._with_memory(chosen)

    def _unchecked(self, stage: _Stage) -> _Choice:
        """The stage without swapping, fitting or not (what it holds before its peer swap)."""
        memory = _memory(self._modes()[0], stage.base.num_layers, stage.base.num_layers,
                         Swap.NONE, 0, None, self.offloads[-1])
        shape = _shape(stage.base, memory)
        device = stage.devices[0]
        sharding = self.cost.stage_sharding(shape, stage.sharding)
        on_device = self.cost.stage_memory_bytes(device.type, len(stage.devices), shape,
                                                 stage.in_flight, sharding)
        return _Choice(memory, float("inf"), on_device, 0.0, 0.0)

    def _try_peers(self, stage: _Stage, kinds: list[Swap],
                   chosen: dict[tuple[int, int], _Choice]) -> bool:
        provisional = self.provisional.pop(stage.ref, None)
        if provisional is not None:
            self._account(stage, provisional, -1.0)
        old = chosen.get(stage.ref)
        if old is not None:
            self._account(stage, old, -1.0)
        peer = self._roomiest_peer(stage)
        best = self._best(stage, kinds, peer) if peer is not None else None
        if best is None or (old is not None and old.score_s <= best.score_s):
            best = old
        if best is None:
            return False
        chosen[stage.ref] = best
        self._account(stage, best)
        return True

    def _account(self, stage: _Stage, choice: _Choice, sign: float = 1.0) -> None:
        node = stage.devices[0].node
        tp = len(stage.devices)
        self.host_used[node] = self.host_used.get(node, 0.0) + sign * choice.host_bytes * tp
        for device in stage.devices:
            self.need[device.id] = self.need.get(device.id, 0.0) + sign * choice.device_bytes
        peer = choice.memory.swap_peer
        if peer is not None and choice.peer_bytes:
            self.held[peer] = self.held.get(peer, 0.0) + sign * choice.peer_bytes * tp

    def _roomiest_peer(self, stage: _Stage) -> Device | None:
        """The device of the plan on the stage's machine (not its own) with most room."""
        if len(stage.devices) > 1:
            return None  # one peer per device: the search swaps to peers at tp 1
        own = stage.devices[0]
        rooms = [(self._room(d), d) for s in self.stages for d in s.devices
                 if d.node == own.node and d.id != own.id]
        rooms = [(room, d) for room, d in rooms if room > 0]
        return max(rooms, key=lambda pair: pair[0])[1] if rooms else None

    def _room(self, device: Device) -> float:
        return (usable_memory_bytes(device.type) - self.need.get(device.id, 0.0)
                - self.held.get(device.id, 0.0))

    def _host_room(self, node: str) -> float:
        return (self.cost.cluster.host_memory_bytes(node) - HOST_OS_RESERVE_BYTES
                - self.ranks_on[node] * HOST_RANK_RESERVE_BYTES - self.host_used.get(node, 0.0))

    def _best(self, stage: _Stage, swaps: list[Swap], peer: Device | None) -> _Choice | None:
        best: _Choice | None = None
        for memory in self._candidates(stage, swaps, peer):
            choice = self._price(stage, memory)
            if choice is not None and (best is None or choice.score_s < best.score_s):
                best = choice
        return best

    def _candidates(self, stage: _Stage, swaps: list[Swap], peer: Device | None
                    ) -> Iterator[StageMemory]:
        """For each offload, swap kind and mode: the fewest blocks that fit."""
        n = stage.base.num_layers
        peer_id = peer.id if peer is not None else None
        for offload in self.offloads:
            for swap in swaps:
                for mode in self._modes():
                    if swap is not Swap.NONE and self.options.swap is not None:
                        yield from self._pinned_swap(stage, mode, swap, peer_id, offload)
                        continue
                    if swap is Swap.NONE:
                        pinned = self.options.recompute is not None or mode is Recompute.NONE
                        blocks = self._fewest(stage, n, pinned, lambda r, mode=mode, swap=swap,
                                              offload=offload: _memory(
                                                  mode, r, n, swap, n, peer_id, offload))
                        if blocks is not None:
                            yield _memory(mode, blocks, n, swap, n, peer_id, offload)
                        continue
                    recomputed = 0 if mode is Recompute.NONE else n
                    blocks = self._fewest(stage, n, False, lambda s, mode=mode, swap=swap,
                                          offload=offload, r=recomputed: _memory(
                                              mode, r, n, swap, s, peer_id, offload))
                    if blocks is not None:
                        yield _memory(mode, recomputed, n, swap, blocks, peer_id, offload)

    def _pinned_swap(self, stage: _Stage, mode: Recompute, swap: Swap, peer: str | None,
                     offload: bool) -> Iterator[StageMemory]:
        """A pinned swap on every stage: all its blocks where that fits, else the fewest that
        fit, at least one (on, even where it does not pay)."""
        n = stage.base.num_layers
        recomputed = 0 if mode is Recompute.NONE else n
        every = _memory(mode, recomputed, n, swap, n, peer, offload)
        if self._fits(stage, every):
            yield every
            return
        blocks = self._fewest(stage, n, False, lambda s: _memory(mode, recomputed, n, swap,
                                                                  max(1, s), peer, offload))
        if blocks is not None:
            yield _memory(mode, recomputed, n, swap, max(1, blocks), peer, offload)

    def _modes(self) -> list[Recompute]:
        if self.options.recompute is not None:
            return [self.options.recompute]
        if self.cost.flash_attention:
            return [Recompute.NONE, Recompute.FULL]
        return list(Recompute)

    def _swaps(self) -> list[Swap]:
        if self.options.swap is not None:
            return [self.options.swap]
        return [Swap.NONE, Swap.HOST, Swap.PEER, Swap.HYBRID]

    def _fewest(self, stage: _Stage, n: int, pinned: bool, memory_of) -> int | None:
        """The fewest blocks (0..n) for which ``memory_of(blocks)`` fits (memory falls as
        blocks grow); ``n`` itself when the technique is pinned (or has no block count)."""
        if pinned:
            return n if self._fits(stage, memory_of(n)) else None
        if not self._fits(stage, memory_of(n)):
            return None
        low, high = 0, n
        while low < high:
            middle = (low + high) // 2
            if self._fits(stage, memory_of(middle)):
                high = middle
            else:
                low = middle + 1
        return low

    def _fits(self, stage: _Stage, memory: StageMemory) -> bool:
        return self._bytes(stage, memory) is not None

    def _bytes(self, stage: _Stage, memory: StageMemory) -> tuple[float, float, float] | None:
        """(device, host, peer) bytes per device of ``memory`` on the stage, None if they
        do not fit the device, the machine's host memory or the peer's room."""
        on_device, host, peer = self._needs(stage, memory)
        device = stage.devices[0]
        tp = len(stage.devices)
        room = usable_memory_bytes(device.type) - self.held.get(device.id, 0.0)
        if on_device > room or host * tp > self._host_room(device.node):
            return None
        if peer and memory.swap_peer is not None:
            if peer * tp > self._room(self.cost.cluster.device(memory.swap_peer)):
                return None
        return on_device, host, peer

    def _needs(self, stage: _Stage, memory: StageMemory) -> tuple[float, float, float]:
        """(device, host, peer) bytes per device of ``memory`` on the stage, whatever the rest
        of the plan holds."""
        table = self.needs[stage.ref]
        found = table.get(memory)
        if found is None:
            found = table[memory] = self._new_needs(stage, memory)
        return found

    def _new_needs(self, stage: _Stage, memory: StageMemory) -> tuple[float, float, float]:
        shape = _shape(stage.base, memory)
        device = stage.devices[0]
        tp = len(stage.devices)
        sharding = self.cost.stage_sharding(shape, stage.sharding)
        on_device = self.cost.stage_memory_bytes(device.type, tp, shape, stage.in_flight,
                                                 sharding)
        swap = self.cost.swap_bytes(device.type, tp, shape, stage.in_flight)
        host = self.cost.host_bytes(device.type, tp, shape, sharding) + swap.host
        return on_device, host, swap.peer

    def _price(self, stage: _Stage, memory: StageMemory) -> _Choice | None:
        found = self._bytes(stage, memory)
        if found is None:
            return None
        table = self.scores[stage.ref]
        score = table.get(memory)
        if score is None:
            score = table[memory] = self._score(stage, memory)
        return _Choice(memory, score, *found)

    def _score(self, stage: _Stage, memory: StageMemory) -> float:
        """The stage's share of an iteration: its micro-batches' passes and its optimizer step."""
        shape = _shape(stage.base, memory)
        work = self.cost.stage_time(stage.devices, shape).work
        sharding = self.cost.stage_sharding(shape, stage.sharding)
        params = self.cost.stage_params(shape, len(stage.devices))
        device = stage.devices[0]
        if shape.offload:
            ranks = self.cost.cluster.groups[device.group].gpus_per_node
            step = self.cost.offloaded_step_s(device, params, sharding,
                                              params / sharding.optimizer_shards * ranks)
        else:
            step = self.cost.optimizer_step_s(device.type, params, sharding)
        return stage.micro_batches * (work.forward_s + work.backward_s) + step

    def _with_memory(self, chosen: dict[tuple[int, int], _Choice]) -> Plan:
        pipelines = []
        for k, pipeline in enumerate(self.plan.pipelines):
            stages = tuple(replace(stage, memory=chosen[(k, i)].memory)
                           for i, stage in enumerate(pipeline.stages))
            pipelines.append(Pipeline(stages, pipeline.micro_batch_size,
                                      pipeline.num_micro_batches))
        recompute = self.options.recompute or Recompute.NONE
        return replace(self.plan, pipelines=tuple(pipelines), recompute=recompute)


def _offloads(options: SearchOptions, offload: bool) -> list[bool]:
    if options.offload is not None:
        return [options.offload is Offload.OPTIMIZER]
    return [False, True] if offload else [False]


def _memory(mode: Recompute, recomputed: int, n: int, swap: Swap, swapped: int,
            peer: str | None, offload: bool) -> StageMemory:
    """A stage's memory: its first ``recomputed`` blocks in ``mode``, its first ``swapped``
    swapping (``swap``), its optimizer offloaded or not."""
    if mode is Recompute.NONE or recomputed == 0:
        mode, recomputed = Recompute.NONE, n
    fraction = swapped / n if n else 0.0
    if swap is Swap.NONE or swapped == 0:
        swap, fraction = Swap.NONE, 1.0
    return StageMemory(mode, None if recomputed >= n else recomputed, swap, fraction,
                       peer if swap.uses_peer else None, 0.5,
                       Offload.OPTIMIZER if offload else Offload.NONE)


def _shape(base: StageShape, memory: StageMemory) -> StageShape:
    n = base.num_layers
    return replace(base, recompute=memory.recompute or Recompute.NONE,
                   recompute_blocks=memory.recompute_blocks, swap=memory.swap,
                   swapped_blocks=memory.swapped_blocks(n), host_share=memory.host_share,
                   swap_peer=memory.swap_peer, offload=memory.offload is Offload.OPTIMIZER)
