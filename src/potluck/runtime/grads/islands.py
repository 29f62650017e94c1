"""Exchanges across islands: DiLoCo's outer step and bounded-staleness averaging.

Inside an island the replicas sum gradients every step (:mod:`.data_parallel`, over the
island's groups). Across islands (``plan.islands.split``) the weights meet only every
``inner_steps`` (H) steps, fragment by fragment (``Islands.fragment_of``: the units in
model order, embedding, blocks, head; ``Islands.exchanges_at`` says when):

- :class:`DilocoSync` (DiLoCo, arXiv:2311.08105): an FP32 snapshot of the weights at the
  fragment's last outer step is kept on the host; the pseudo-gradient ``snapshot - weights``
  is averaged over the islands and the outer optimizer (SGD, Nesterov momentum when the
  momentum is not 0) steps the snapshot, which becomes the weights. With one fragment the
  exchange blocks; with H=1, an inner SGD, outer learning rate 1 and momentum 0 this is
  synchronous data parallelism exactly. With F > 1 fragments (streaming DiLoCo, Douillard
  et al. 2025, arXiv:2501.18512, section 2.3: the outer all-reduce overlaps tau inner steps)
  a fragment's average is started at its step and applied ``H // F`` steps later, when the
  next fragment is due (as the planner's exposed time assumes,
  :func:`potluck.planner.islands.exchange.exposed_per_step_s`), or at the end of the run:
  the island keeps its progress since it sent, ``weights = new snapshot + (weights now -
  weights when sent)``, as bounded does;
- :class:`BoundedSync` (HetPipe, SDPipe): each island's update since its last push is
  averaged with an asynchronous all-reduce while the island trains on; the average is
  applied (``weights += average - own update``) when it arrives, and at the latest
  ``staleness`` pushes later (0: at once, plain periodic averaging).

**The average.** Island ``i``'s weight is its share of the global batch (rows), so each
island's gradient, already its own batch's token-weighted mean, counts as much as its
tokens do. A unit's cross-island group is its holders in every pipeline
(:meth:`~potluck.runtime.layout.Layout.cross_island_group`); each holder contributes its
value times its island's weight over the island's holders of the unit (they hold the same
values), so the group's sum is the weighted mean. Values travel in the gradient buckets'
layout (:func:`~potluck.runtime.grads.buckets.plan_buckets`: local shards where every holder
shards the unit alike, else the full tensors of :class:`~.buckets.FullLayout`).

**Where the weights live.** Where the optimizer keeps FP32 masters (16-bit weights on a GPU,
an offloaded optimizer's host masters) the exchange reads and writes the masters, and the
optimizer copies them to the parameters; else the parameters themselves.

**The wire** (:class:`CrossIslandWire`, the one function that crosses islands; it hands
each collective to the model's clock as an ``outer_sync`` op, so an emulation times it on the
slow link): FP32, or rounded to bf16/fp16 and all-reduced in that dtype, or int8
with one FP32 absmax scale per :data:`~potluck.plans.islands.INT8_BLOCK` values, all-gathered
and summed after dequantizing (a sum of int8 would overflow). It counts the bytes this rank
puts on the wire (the payload of each collective, in the wire format). Where some island's
transport is ``host`` the cross-island groups are gloo groups
(:meth:`~potluck.runtime.layout.Layout.on_host`) and the wire stages each payload through
pinned host memory and brings the sum back to the device.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from potluck.ops import OpKind
from potluck.placement import block_index, block_unit, expert_shard, parameter_units
from potluck.plans.islands import INT8_BLOCK, Compression, SyncMethod
from potluck.runtime.grads.buckets import Bucket, FullLayout, SyncedParam, local, plan_buckets
from potluck.runtime.grads.gather import bucket_units
from potluck.runtime.layout import Layout
from potluck.runtime.timing.clock import Clock, CommOp, NullClock, Waitable

INT8_MAX = 127.0


@dataclass(frozen=True)
class IslandReport:
    """What the exchanges across islands did by the end of one inner step."""

    outer_step: int  # outer steps (diloco) or pushes (bounded) done, counted by fragment 0
    bytes_sent: int  # bytes this rank put on the wire across islands in this step
    staleness: int  # bounded: pushes still in flight (at most plan.islands.staleness)


class IslandSync(Protocol):
    """What the trainer calls after each inner step."""

    def after_step(self, step: int) -> IslandReport | None: ...

    def drain(self) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        """``{"tensors": {name: tensor}, "counters": {name: int}}`` (copies)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class NoIslands:
    """One island (or islands synchronized every step): nothing crosses islands."""

    def after_step(self, step: int) -> IslandReport | None:
        return None

    def drain(self) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"tensors": {}, "counters": {}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


class Masters(Protocol):
    """An optimizer that keeps FP32 masters of (some) parameters."""

    def master_of(self, param: nn.Parameter) -> torch.Tensor | None: ...

    def masters_changed(self) -> None: ...


@dataclass
class _Entry:
    """One local parameter in the exchange: the FP32 tensor that holds its value."""

    item: SyncedParam
    value: torch.Tensor  # the master, or the parameter's local tensor
    weight: float  # its island's share of the batch over the island's holders of the unit


@dataclass
class Pending:
    """One bucket's exchange in flight: :meth:`wait` gives the sum over the group."""

    finish: Callable[[], torch.Tensor]

    def wait(self) -> torch.Tensor:
        return self.finish()


class CrossIslandWire:
    """Sums flat FP32 tensors over a cross-island group in the plan's wire format, and
    counts the bytes sent (the seam an emulator stretches to a slow link's time).

    ``host``: the groups are gloo groups beside the backend's (``Islands.host_staged``):
    each payload goes device -> pinned host memory -> the gloo collective, and the sum comes
    back to the device. ``clock``: the model's clock now (an emulation is set after the
    trainer), which times each exchange as one ``outer_sync`` op."""

    def __init__(self, compression: Compression, device: torch.device, host: bool = False,
                 clock: Callable[[], Clock] = NullClock) -> None:
        self.compression = compression
        self.device = device  # where the sums land (this rank's device)
        self.host = host
        self.clock = clock
        self.bytes_sent = 0

    def start(self, flat: torch.Tensor, group: dist.ProcessGroup | None,
              units: tuple[str, ...] = ()) -> Pending:
        """Start summing ``flat`` (the values of parameter ``units``) over ``group``
        (asynchronously); the sum comes back on the wire's device."""
        flat = flat.to(self.device)
        if self.compression is Compression.INT8:
            return self._start_int8(flat, group, units)
        dtype = {Compression.BF16: torch.bfloat16,
                 Compression.FP16: torch.float16}.get(self.compression, torch.float32)
        wire = self._staged(flat.to(dtype))
        self.bytes_sent += wire.numel() * wire.element_size()
        work = self._timed([dist.all_reduce(wire, group=group, async_op=True)], units)

        def finish() -> torch.Tensor:
            work.wait()
            return self._landed(wire.to(torch.float32))

        return Pending(finish)

    def _timed(self, works: list[Any], units: tuple[str, ...]) -> Waitable:
        """The collectives ``works`` handed to the clock as one ``outer_sync`` op."""
        return self.clock().start_comm(CommOp(OpKind.OUTER_SYNC, -1, units), _AllOf(works))

    def _start_int8(self, flat: torch.Tensor, group: dist.ProcessGroup | None,
                    units: tuple[str, ...]) -> Pending:
        values, scales = (self._staged(t) for t in quantize_int8(flat))
        self.bytes_sent += values.numel() + scales.numel() * scales.element_size()
        size = dist.get_world_size(group)
        all_values = [torch.empty_like(values) for _ in range(size)]
        all_scales = [torch.empty_like(scales) for _ in range(size)]
        work = self._timed([dist.all_gather(all_values, values, group=group, async_op=True),
                            dist.all_gather(all_scales, scales, group=group, async_op=True)],
                           units)

        def finish() -> torch.Tensor:
            work.wait()
            total = torch.zeros(flat.numel(), dtype=torch.float32, device=values.device)
            for v, s in zip(all_values, all_scales, strict=True):
                total += dequantize_int8(v, s, flat.numel())
            return self._landed(total)

        return Pending(finish)

    def _staged(self, payload: torch.Tensor) -> torch.Tensor:
        """The payload where the group's backend takes it: as it is, or (host-staged) copied
        to pinned host memory (pinned where the device is a GPU: its copy is a DMA, and the
        blocking copy has landed before gloo reads it)."""
        if not self.host or self.device.type == "cpu":
            return payload
        staged = torch.empty(payload.shape, dtype=payload.dtype, device="cpu",
                             pin_memory=True)
        staged.copy_(payload)
        return staged

    def _landed(self, total: torch.Tensor) -> torch.Tensor:
        """The sum on the wire's device (host-staged: copied back from host memory)."""
        return total.to(self.device) if self.host else total


@dataclass
class _AllOf:
    """Several collectives waited on as one."""

    works: list[Any]

    def wait(self) -> None:
        for work in self.works:
            work.wait()


def quantize_int8(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``flat`` as int8 values with one FP32 absmax scale per INT8_BLOCK values."""
    blocks = math.ceil(flat.numel() / INT8_BLOCK)
    padded = torch.zeros(blocks * INT8_BLOCK, dtype=torch.float32, device=flat.device)
    padded[:flat.numel()] = flat
    padded = padded.view(blocks, INT8_BLOCK)
    scales = padded.abs().amax(dim=1) / INT8_MAX
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    values = torch.round(padded / safe[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return values.view(-1)[:flat.numel()].clone(), scales


def dequantize_int8(values: torch.Tensor, scales: torch.Tensor, numel: int) -> torch.Tensor:
    """The FP32 values that :func:`quantize_int8` rounded to ``values`` and ``scales``."""
    blocks = scales.numel()
    padded = torch.zeros(blocks * INT8_BLOCK, dtype=torch.float32, device=values.device)
    padded[:numel] = values.to(torch.float32)
    return (padded.view(blocks, INT8_BLOCK) * scales[:, None]).view(-1)[:numel]


class _Exchange:
    """This rank's parameters in the cross-island exchange, by fragment, in buckets."""

    def __init__(self, layout: Layout, named: list[tuple[str, nn.Parameter, str]],
                 masters: Masters | None, device: torch.device,
                 clock: Callable[[], Clock] = NullClock) -> None:
        self.layout = layout
        self.islands = layout.plan.islands
        self.masters = masters
        self.wire = CrossIslandWire(self.islands.compression, device,
                                    self.islands.host_staged, clock)
        self.full = FullLayout(layout.role.tp_rank)
        units = parameter_units(layout.plan.model, layout.plan.ep)
        base_units = [u for u in units if expert_shard(u) is None]
        entries = [self._entry(name, param, unit) for name, param, unit in named]
        self.fragments: list[list[Bucket]] = [[] for _ in range(self.islands.fragments)]
        self.entries: dict[int, _Entry] = {id(e.item.param): e for e in entries}
        for f in range(self.islands.fragments):
            items = [e.item for e in entries
                     if self.islands.fragment_of(_unit_index(e.item.unit, base_units),
                                                 len(base_units)) == f]
            self.fragments[f] = plan_buckets(layout, items)

    def _entry(self, name: str, param: nn.Parameter, unit: str) -> _Entry:
        layout = self.layout
        item = SyncedParam(name, param, unit, layout.cross_island_group(unit))
        share = layout.plan.island_share(layout.role.pipeline)
        holders = len(set(layout.holders(unit)))
        master = self.masters.master_of(param) if self.masters is not None else None
        value = master if master is not None else local(param).data
        return _Entry(item, value, share / holders)

    def values(self, bucket: Bucket) -> list[torch.Tensor]:
        return [self.entries[id(item.param)].value for item in bucket.items]

    def start(self, bucket: Bucket, tensors: list[torch.Tensor]) -> Pending:
        """Start the weighted sum of ``tensors`` (one per bucket item) over the islands."""
        weighted = [t * self.entries[id(item.param)].weight
                    for item, t in zip(bucket.items, tensors, strict=True)]
        if bucket.aligned:
            flat = torch.cat([w.reshape(-1) for w in weighted])
        else:
            flat = self.full.flat(bucket.items, weighted, torch.float32)
        return self.wire.start(flat, bucket.group, bucket_units(bucket))

    def split(self, bucket: Bucket, flat: torch.Tensor) -> list[torch.Tensor]:
        """The bucket's summed ``flat`` cut back into this rank's tensors."""
        out, offset = [], 0
        for item, value in zip(bucket.items, self.values(bucket), strict=True):
            size = value.numel() if bucket.aligned else item.param.numel()
            part = flat[offset:offset + size]
            offset += size
            if bucket.aligned:
                out.append(part.view_as(value).to(value.device))
            else:
                mine = torch.empty_like(local(item.param), dtype=torch.float32)
                self.full.take(item.param, part, mine)
                out.append(mine.to(value.device))
        return out

    def written(self) -> None:
        """Values were changed: the optimizer copies its masters to the parameters."""
        if self.masters is not None:
            self.masters.masters_changed()

    def bytes_sent_world(self) -> int:
        """Every rank's bytes sent since the last call, summed (collective)."""
        sent = torch.tensor([float(self.wire.bytes_sent)], dtype=torch.float64,
                            device=self.wire.device)
        self.wire.bytes_sent = 0
        if dist.get_world_size() > 1:
            dist.all_reduce(sent)
        return int(sent.item())


def _unit_index(unit: str, base_units: list[str]) -> int:
    """The unit's position in model order (an expert unit: its block's)."""
    if expert_shard(unit) is not None:
        unit = block_unit(block_index(unit))
    return base_units.index(unit)


@dataclass
class _Sent:
    """One fragment's pseudo-gradients in flight (streaming DiLoCo)."""

    fragment: int
    due: int  # the inner step after which the average is applied
    pending: list[Pending]  # per bucket
    sent: list[list[torch.Tensor]] | None  # per bucket: the weights when sent (None: blocking)
    averaged: list[list[torch.Tensor]] | None = None  # per bucket, once it has arrived


class DilocoSync:
    """DiLoCo's outer step, fragment by fragment (module docstring)."""

    def __init__(self, exchange: _Exchange, lr: float, momentum: float) -> None:
        self.exchange = exchange
        self.islands = exchange.islands
        self.snapshots: dict[int, torch.Tensor] = {
            key: e.value.detach().to("cpu", torch.float32, copy=True)
            for key, e in exchange.entries.items()}
        self.optimizers = [self._outer_optimizer(f, lr, momentum)
                           for f in range(self.islands.fragments)]
        self.inflight: deque[_Sent] = deque()
        self.outer_steps = 0

    def _outer_optimizer(self, fragment: int, lr: float, momentum: float
                         ) -> torch.optim.Optimizer | None:
        params = [self.snapshots[id(item.param)] for bucket in self.exchange.fragments[fragment]
                  for item in bucket.items]
        if not params:
            return None
        return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=momentum > 0)

    @property
    def delay(self) -> int:
        """Inner steps between sending a fragment and applying its average (0: blocking)."""
        return self.islands.overlap_steps

    def after_step(self, step: int) -> IslandReport | None:
        while self.inflight and self.inflight[0].due <= step:
            self._apply(self.inflight.popleft())
        exchanged = [f for f in range(self.islands.fragments)
                     if self.islands.exchanges_at(step, f)]
        for fragment in exchanged:
            sent = self._send(fragment, step)
            if self.delay:
                self.inflight.append(sent)
            else:
                self._apply(sent)
        if 0 in exchanged:
            self.outer_steps += 1
        sent_bytes = self.exchange.bytes_sent_world() if exchanged else 0
        return IslandReport(self.outer_steps, sent_bytes, 0)

    @torch.no_grad()
    def _send(self, fragment: int, step: int) -> _Sent:
        """Start averaging the fragment's pseudo-gradients over the islands."""
        buckets = self.exchange.fragments[fragment]
        pending = [self.exchange.start(b, self._deltas(b)) for b in buckets]
        sent = ([[v.detach().float().clone() for v in self.exchange.values(b)] for b in buckets]
                if self.delay else None)
        return _Sent(fragment, step + self.delay, pending, sent)

    @torch.no_grad()
    def _apply(self, sent: _Sent) -> None:
        """Wait for the fragment's average, step its snapshot with the outer optimizer, and
        make it the weights (plus the island's progress since it sent, when delayed)."""
        buckets = self.exchange.fragments[sent.fragment]
        for bucket, averaged in zip(buckets, self._arrived(sent), strict=True):
            for item, delta in zip(bucket.items, averaged, strict=True):
                self.snapshots[id(item.param)].grad = delta.to("cpu")
        optimizer = self.optimizers[sent.fragment]
        if optimizer is None:
            return
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        for index, bucket in enumerate(buckets):
            for position, (item, value) in enumerate(
                    zip(bucket.items, self.exchange.values(bucket), strict=True)):
                outer = self.snapshots[id(item.param)].to(value.device)
                if sent.sent is not None:
                    outer = outer + (value.float() - sent.sent[index][position])
                value.copy_(outer)
        self.exchange.written()

    def _arrived(self, sent: _Sent) -> list[list[torch.Tensor]]:
        """The fragment's averaged pseudo-gradients, per bucket (waits for them once)."""
        if sent.averaged is None:
            buckets = self.exchange.fragments[sent.fragment]
            sent.averaged = [self.exchange.split(bucket, work.wait())
                             for bucket, work in zip(buckets, sent.pending, strict=True)]
        return sent.averaged

    def _deltas(self, bucket: Bucket) -> list[torch.Tensor]:
        """The pseudo-gradients: snapshot minus weights, in FP32."""
        return [self.snapshots[id(item.param)].to(value.device) - value.float()
                for item, value in zip(bucket.items, self.exchange.values(bucket), strict=True)]

    def drain(self) -> None:
        """Apply every fragment still in flight (the end of a run, a saved state)."""
        while self.inflight:
            self._apply(self.inflight.popleft())

    def state_dict(self) -> dict[str, Any]:
        """``tensors``: copies of the snapshots and the outer momentum, by parameter name;
        ``counters``: the outer steps done; each fragment in flight (its average, waited
        for, and the weights when sent, by ``inflight<i>.``, with its fragment and due step),
        so a resume applies it at the step the uninterrupted run does."""
        tensors = _by_name(self.exchange, self.snapshots, "snapshot.")
        tensors.update(_by_name(self.exchange, self._momentum(), "momentum."))
        counters = {"outer_steps": self.outer_steps, "inflight": len(self.inflight)}
        for index, sent in enumerate(self.inflight):
            prefix = f"inflight{index}."
            counters.update({f"{prefix}fragment": sent.fragment, f"{prefix}due": sent.due})
            tensors.update(self._in_flight_tensors(sent, prefix))
        return {"tensors": tensors, "counters": counters}

    def _in_flight_tensors(self, sent: _Sent, prefix: str) -> dict[str, torch.Tensor]:
        assert sent.sent is not None  # only delayed fragments stay in flight
        found = {}
        buckets = self.exchange.fragments[sent.fragment]
        for bucket, averaged, weights in zip(buckets, self._arrived(sent), sent.sent,
                                             strict=True):
            for item, mean, weight in zip(bucket.items, averaged, weights, strict=True):
                found[f"{prefix}average.{item.name}"] = mean.detach().to("cpu", copy=True)
                found[f"{prefix}sent.{item.name}"] = weight.detach().to("cpu", copy=True)
        return found

    def _restore_in_flight(self, state: dict[str, Any]) -> None:
        for sent in self.inflight:
            self._arrived(sent)  # the collectives in flight finish on every rank
        self.inflight.clear()
        tensors, counters = state["tensors"], state["counters"]
        for index in range(counters.get("inflight", 0)):
            prefix = f"inflight{index}."
            fragment = counters[f"{prefix}fragment"]
            buckets = self.exchange.fragments[fragment]
            averaged, weights = [], []
            for bucket in buckets:
                values = self.exchange.values(bucket)
                averaged.append([tensors[f"{prefix}average.{item.name}"].to(value.device)
                                 for item, value in zip(bucket.items, values, strict=True)])
                weights.append([tensors[f"{prefix}sent.{item.name}"].to(value.device)
                                for item, value in zip(bucket.items, values, strict=True)])
            self.inflight.append(_Sent(fragment, counters[f"{prefix}due"], [], weights,
                                       averaged))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._restore_in_flight(state)
        tensors = state["tensors"]
        _load_by_name(self.exchange, self.snapshots, tensors, "snapshot.")
        for optimizer in self.optimizers:
            if optimizer is not None:
                optimizer.state.clear()
                for snapshot in optimizer.param_groups[0]["params"]:
                    name = self._names[id(snapshot)]
                    if f"momentum.{name}" in tensors:
                        buffer = tensors[f"momentum.{name}"].clone()
                        optimizer.state[snapshot] = {"momentum_buffer": buffer}
        self.outer_steps = state["counters"]["outer_steps"]

    def _momentum(self) -> dict[int, torch.Tensor]:
        """The outer momentum of each parameter (by ``id``) that has one yet."""
        found = {}
        for key, snapshot in self.snapshots.items():
            for optimizer in self.optimizers:
                if optimizer is not None and snapshot in optimizer.state:
                    buffer = optimizer.state[snapshot].get("momentum_buffer")
                    if buffer is not None:
                        found[key] = buffer
        return found

    @property
    def _names(self) -> dict[int, str]:
        """Each snapshot's parameter name, by the snapshot's ``id``."""
        return {id(self.snapshots[key]): e.item.name for key, e in self.exchange.entries.items()}


def _by_name(exchange: _Exchange, tensors: dict[int, torch.Tensor], prefix: str
             ) -> dict[str, torch.Tensor]:
    """Copies of ``tensors`` (by parameter ``id``) by ``prefix`` and parameter name."""
    return {f"{prefix}{e.item.name}": tensors[key].detach().clone()
            for key, e in exchange.entries.items() if key in tensors}


def _load_by_name(exchange: _Exchange, tensors: dict[int, torch.Tensor],
                  saved: dict[str, torch.Tensor], prefix: str) -> None:
    with torch.no_grad():
        for key, entry in exchange.entries.items():
            tensors[key].copy_(saved[f"{prefix}{entry.item.name}"])


@dataclass
class _Push:
    """One fragment's update in flight."""

    fragment: int
    own: list[list[torch.Tensor]]  # per bucket: this island's update of each item
    pending: list[Pending] = field(default_factory=list)


class BoundedSync:
    """Periodic averaging with bounded staleness (module docstring)."""

    def __init__(self, exchange: _Exchange, staleness: int) -> None:
        self.exchange = exchange
        self.islands = exchange.islands
        self.staleness = staleness
        self.base: dict[int, torch.Tensor] = {
            key: e.value.detach().to(torch.float32, copy=True)
            for key, e in exchange.entries.items()}
        self.inflight: deque[_Push] = deque()
        self.pushes = 0

    def after_step(self, step: int) -> IslandReport | None:
        pushed = [f for f in range(self.islands.fragments)
                  if self.islands.exchanges_at(step, f)]
        for fragment in pushed:
            self._push(fragment)
            while sum(p.fragment == fragment for p in self.inflight) > self.staleness:
                self._apply(next(p for p in self.inflight if p.fragment == fragment))
        if 0 in pushed:
            self.pushes += 1
        sent = self.exchange.bytes_sent_world() if pushed else 0
        return IslandReport(self.pushes, sent, self._in_flight())

    def _in_flight(self) -> int:
        counts = [sum(p.fragment == f for p in self.inflight)
                  for f in range(self.islands.fragments)]
        return max(counts, default=0)

    @torch.no_grad()
    def _push(self, fragment: int) -> None:
        """Start averaging the fragment's update since its last push."""
        push = _Push(fragment, [])
        for bucket in self.exchange.fragments[fragment]:
            own = []
            for item, value in zip(bucket.items, self.exchange.values(bucket), strict=True):
                base = self.base[id(item.param)]
                own.append(value.float() - base)
                base.copy_(value)
            push.own.append(own)
            push.pending.append(self.exchange.start(bucket, own))
        self.inflight.append(push)

    @torch.no_grad()
    def _apply(self, push: _Push) -> None:
        """Wait for ``push``'s average; weights (and the base) += average - own update."""
        self.inflight.remove(push)
        buckets = self.exchange.fragments[push.fragment]
        for bucket, own, work in zip(buckets, push.own, push.pending, strict=True):
            averaged = self.exchange.split(bucket, work.wait())
            values = self.exchange.values(bucket)
            for item, value, mine, mean in zip(bucket.items, values, own, averaged, strict=True):
                correction = mean - mine
                value.add_(correction.to(value.dtype))
                self.base[id(item.param)].add_(correction)
        self.exchange.written()

    def drain(self) -> None:
        """Apply every push still in flight (the end of a run, a saved state)."""
        while self.inflight:
            self._apply(self.inflight[0])

    def state_dict(self) -> dict[str, Any]:
        """The weights at each fragment's last push (by parameter name) and the pushes
        done; the pushes in flight are applied first (:meth:`drain`)."""
        self.drain()
        return {"tensors": _by_name(self.exchange, self.base, "base."),
                "counters": {"pushes": self.pushes}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.drain()  # the collectives in flight finish on every rank; then overwritten
        _load_by_name(self.exchange, self.base, state["tensors"], "base.")
        self.pushes = state["counters"]["pushes"]


ADAPTIVE_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax,
                       torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adagrad,
                       torch.optim.RMSprop, torch.optim.Adafactor)
"""Optimizers that divide a step by a running estimate of the gradient's size."""


def inner_lr_scale(layout: Layout, optimizer: torch.optim.Optimizer) -> float:
    """The multiplier of the run's learning rate for this rank's island
    (:class:`~potluck.plans.islands.InnerLR`): ``1 / sqrt(share)`` under ``sqrt_share`` for
    an adaptive inner optimizer (the wrappers' own ``inner`` one is what steps), else 1."""
    islands = layout.plan.islands
    while hasattr(optimizer, "inner"):
        optimizer = optimizer.inner
    if not islands.split or not isinstance(optimizer, ADAPTIVE_OPTIMIZERS):
        return 1.0
    return islands.inner_lr.factor(layout.plan.island_share(layout.role.pipeline))


def island_sync(layout: Layout, named: list[tuple[str, nn.Parameter, str]],
                optimizer: Any, device: torch.device,
                clock: Callable[[], Clock] = NullClock) -> IslandSync:
    """The exchange the plan's islands need: ``named`` is this rank's ``(name, parameter,
    unit)``; ``optimizer``, where it keeps FP32 masters, is read and written instead of the
    parameters; ``device``: where collectives take their tensors; ``clock``: gives the
    model's clock when an exchange starts."""
    islands = layout.plan.islands
    if not islands.split:
        return NoIslands()
    masters = optimizer if hasattr(optimizer, "master_of") else None
    exchange = _Exchange(layout, named, masters, device, clock)
    if islands.sync is SyncMethod.DILOCO:
        return DilocoSync(exchange, islands.outer_lr, islands.outer_momentum)
    return BoundedSync(exchange, islands.staleness)
