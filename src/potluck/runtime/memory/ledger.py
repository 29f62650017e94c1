"""The bytes of the tensors one rank holds, by where they live, and their peak per step.

The memory contract of issue 13 counts a CPU rank's "device bytes" as the tensors it
holds on its device: parameters, gradients, optimizer states that are not offloaded,
live saved activations (the tensors autograd keeps for the backward pass) and swap
stashes it holds for peers; its "host bytes" as offloaded states and host-swap stashes.
A :class:`MemoryLedger` counts exactly those, by storage (two views of one storage count
once, the first category that registered it wins): it registers storages with weak
references (:class:`torch.multiprocessing.reductions.StorageWeakRef`) and, at every
event that changes activations (a tensor saved, a stash made or brought back), sums
the storages still alive. Saved activations come from
:meth:`MemoryLedger.saving`, a :class:`torch.autograd.graph.saved_tensors_hooks` the
runtime holds around a step's schedule: checkpointed regions and swapped blocks push
their own hooks inside it, and their kept inputs still pass through it (torch's
non-reentrant checkpoint saves its inputs under the hooks around it).

Model states not on the device (ZeRO-Offload's optimizer states and master weights)
are counted as host bytes once registered with :meth:`MemoryLedger.add_host_tensors`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef


class Place(str, Enum):
    """Where a counted storage lives."""

    DEVICE = "device"  # the rank's own device
    HOST = "host"  # host memory (offloaded states, host-swap stash)
    PEER = "peer"  # another device's memory, held for this rank (peer-swap stash)


class Kind(str, Enum):
    """What a counted storage is."""

    PARAMETERS = "parameters"
    GRADIENTS = "gradients"
    OPTIMIZER = "optimizer"
    ACTIVATIONS = "activations"
    STASH = "stash"


@dataclass
class _Entry:
    ref: StorageWeakRef
    nbytes: int
    place: Place
    kind: Kind
    peer: str | None = None


def storage_key(tensor: torch.Tensor) -> int:
    """One number per storage: views of one storage share it."""
    return tensor.untyped_storage()._cdata


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the bytes this rank holds), any other tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


@dataclass(frozen=True)
class MemorySample:
    """Bytes a rank holds at one moment (or their peaks over a step)."""

    device_bytes: float
    host_bytes: float
    peer_bytes: dict[str, float]  # held on other devices for this rank, by device id


class MemoryLedger:
    """Counts the storages a rank holds; :meth:`start_step` and :meth:`peak` bound a step."""

    def __init__(self) -> None:
        self._states: dict[int, _Entry] = {}
        self._transient: dict[int, _Entry] = {}
        self._host_keys: dict[int, StorageWeakRef] = {}
        self._state_totals = (0.0, 0.0)
        self._peak = MemorySample(0.0, 0.0, {})

    # --- model states ------------------------------------------------------------------------

    def add_host_tensors(self, tensors: Iterable[torch.Tensor]) -> None:
        """Model-state tensors that live in host memory (offloaded optimizer states, master
        weights): counted as host bytes wherever they are found."""
        for tensor in tensors:
            tensor = local_tensor(tensor)
            self._host_keys[storage_key(tensor)] = StorageWeakRef(tensor.untyped_storage())

    def count_states(self, parameters: Iterable[torch.Tensor],
                     optimizer: torch.optim.Optimizer | None = None,
                     extra: Iterable[torch.Tensor] = ()) -> None:
        """Register the model states the rank holds now: parameters, their gradients,
        ``optimizer``'s states and ``extra`` tensors (e.g. gradient shards, buffers)."""
        self._states = {}
        params = [local_tensor(p) for p in parameters]
        for param in params:
            self._register(self._states, param, Kind.PARAMETERS)
        for param in params:
            if param.grad is not None:
                self._register(self._states, param.grad, Kind.GRADIENTS)
        for tensor in _optimizer_tensors(optimizer):
            self._register(self._states, tensor, Kind.OPTIMIZER)
        for tensor in extra:
            self._register(self._states, local_tensor(tensor), Kind.OPTIMIZER)
        self._state_totals = _totals(self._states.values())[:2]
        self.sample()

    def _register(self, table: dict[int, _Entry], tensor: torch.Tensor, kind: Kind,
                  place: Place = Place.DEVICE, peer: str | None = None) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        old = table.get(key) or self._states.get(key)
        if old is not None and not old.ref.expired():
            return
        host = self._host_keys.get(key)
        if host is not None and not host.expired():
            place = Place.HOST
        table[key] = _Entry(StorageWeakRef(storage), storage.nbytes(), place, kind, peer)

    # --- activations and stashes -------------------------------------------------------------

    def track(self, tensor: torch.Tensor, kind: Kind = Kind.ACTIVATIONS,
              place: Place = Place.DEVICE, peer: str | None = None) -> None:
        """Count ``tensor``'s storage while it lives, then sample."""
        self._register(self._transient, tensor, kind, place, peer)
        self.sample()

    @contextmanager
    def saving(self) -> Iterator[None]:
        """Count every tensor autograd saves inside this context (see the module docstring)."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            yield

    def _pack(self, tensor: torch.Tensor) -> Any:
        self.track(tensor)
        return tensor.detach() if tensor.requires_grad else tensor  # no cycle via grad_fn

    @contextmanager
    def recomputing(self) -> Iterator[None]:
        """Inside a checkpoint's recomputation: count what it saves again, then hand each
        tensor on to the checkpoint's own hook."""
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is None:
            yield
            return
        pack, unpack = top

        def counted(tensor: torch.Tensor) -> Any:
            self.track(tensor)
            return pack(tensor)

        with torch.autograd.graph.saved_tensors_hooks(counted, unpack):
            yield

    # --- totals ----------------------------------------------------------------------------

    def now(self) -> MemorySample:
        """What the rank holds at this moment."""
        self._transient = {k: e for k, e in self._transient.items() if not e.ref.expired()}
        entries = [e for k, e in self._transient.items() if k not in self._states]
        device, host, peers = _totals(entries)
        return MemorySample(device + self._state_totals[0], host + self._state_totals[1], peers)

    def sample(self) -> None:
        """Fold the present into this step's peak."""
        now, peak = self.now(), self._peak
        peers = dict(peak.peer_bytes)
        for device, held in now.peer_bytes.items():
            peers[device] = max(peers.get(device, 0.0), held)
        self._peak = MemorySample(max(peak.device_bytes, now.device_bytes),
                                  max(peak.host_bytes, now.host_bytes), peers)

    def start_step(self) -> None:
        """A step begins: its peak starts from what the rank holds now."""
        self._peak = MemorySample(0.0, 0.0, {})
        self.sample()

    def peak(self) -> MemorySample:
        """The step's peak so far (device, host, and per peer device)."""
        self.sample()
        return self._peak


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _totals(entries: Iterable[_Entry]) -> tuple[float, float, dict[str, float]]:
    device = host = 0.0
    peers: dict[str, float] = {}
    for entry in entries:
        if entry.ref.expired():
            continue
        if entry.place is Place.DEVICE:
            device += entry.nbytes
        elif entry.place is Place.HOST:
            host += entry.nbytes
        else:
            peers[entry.peer or "?"] = peers.get(entry.peer or "?", 0.0) + entry.nbytes
    return device, host, peers


def _optimizer_tensors(optimizer: torch.optim.Optimizer | None) -> Iterator[torch.Tensor]:
    if optimizer is None:
        return
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                yield local_tensor(value)
