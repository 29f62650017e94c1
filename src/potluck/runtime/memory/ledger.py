"""The bytes of the tensors one rank holds, by where they live, and their peak per step.

The memory contract of issue 13 counts a CPU rank's "device bytes" as the tensors it
holds on its device: parameters, gradients, optimizer states that are not offloaded,
live saved activations (the tensors autograd keeps for the backward pass) and swap
stashes it holds for peers; its "host bytes" as offloaded states and host-swap stashes.
A :class:`MemoryLedger` counts exactly those, by storage (two views of one storage count
once; a saved view of a parameter counts as the parameter). Model states are
registered with weak references to their storages
(:class:`torch.multiprocessing.reductions.StorageWeakRef`) at the step's start and
after its backward and optimizer step; a transient tensor (a saved activation, a
stash, a stage's output) counts while the tensor object the ledger was given lives
(``weakref.finalize``): for a saved tensor, the object autograd keeps, released when
its node's backward is done or its graph is freed. Totals are kept as tensors come and
go, so each event (a tensor saved, a stash made or brought back) costs O(1). Saved activations come from
:meth:`MemoryLedger.saving`, a :class:`torch.autograd.graph.saved_tensors_hooks` the
runtime holds around a step's schedule: checkpointed regions and swapped blocks push
their own hooks inside it, and their kept inputs still pass through it (torch's
non-reentrant checkpoint saves its inputs under the hooks around it).

Model states not on the device (ZeRO-Offload's optimizer states and master weights)
are counted as host bytes once registered with :meth:`MemoryLedger.add_host_tensors`.
Model states that are neither parameters, their ``.grad`` nor ``optimizer.state`` (a
sharded gradient's buffer, an offloaded master copy) are the ``extra`` tensors given to
:meth:`MemoryLedger.count_states` each time states are counted; a transient
buffer (a ZeRO-3 block's gathered weights) is counted while it lives with
:meth:`MemoryLedger.track`.
"""

from __future__ import annotations

import weakref
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


def storage_key(tensor: torch.Tensor) -> int:
    """One number per storage: views of one storage share it."""
    return tensor.untyped_storage()._cdata


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the bytes this rank holds), any other tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


@dataclass
class _Live:
    """A transient storage: its bytes, where they are, how many tracked objects hold it."""

    nbytes: int
    place: Place
    peer: str | None = None
    holders: int = 0


@dataclass
class MemorySample:
    """Bytes a rank holds at one moment (or their peaks over a step)."""

    device_bytes: float
    host_bytes: float
    peer_bytes: dict[str, float]  # held on other devices for this rank, by device id


class MemoryLedger:
    """Counts the storages a rank holds; :meth:`start_step` and :meth:`peak` bound a step."""

    def __init__(self) -> None:
        self._states: dict[int, _Entry] = {}
        self._live: dict[int, _Live] = {}
        self._device_bytes = self._host_bytes = 0
        self._peer_bytes: dict[str, int] = {}
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
        params = list(parameters)  # DTensors where TP shards them: their grads are too
        for param in params:
            self._register(local_tensor(param), Kind.PARAMETERS)
        for param in params:
            if param.grad is not None:
                self._register(local_tensor(param.grad), Kind.GRADIENTS)
        for tensor in _optimizer_tensors(optimizer):
            self._register(tensor, Kind.OPTIMIZER)
        for tensor in extra:
            self._register(local_tensor(tensor), Kind.OPTIMIZER)
        self._state_totals = _totals(self._states.values())
        self.sample()

    def _register(self, tensor: torch.Tensor, kind: Kind) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        old = self._states.get(key)
        if old is not None and not old.ref.expired():
            return
        host = self._host_keys.get(key)
        place = Place.HOST if host is not None and not host.expired() else Place.DEVICE
        self._states[key] = _Entry(StorageWeakRef(storage), storage.nbytes(), place, kind)

    # --- activations and stashes -------------------------------------------------------------

    def track(self, tensor: torch.Tensor, kind: Kind = Kind.ACTIVATIONS,
              place: Place = Place.DEVICE, peer: str | None = None) -> None:
        """Count ``tensor``'s storage while this tensor object lives (several objects of one
        storage count it once), then fold the present into the step's peak."""
        local = local_tensor(tensor)  # a DTensor's bytes are its shard's
        key = storage_key(local)
        state = self._states.get(key)
        if state is not None and not state.ref.expired():
            return
        entry = self._live.get(key)
        if entry is None:
            nbytes = local.untyped_storage().nbytes()
            entry = self._live[key] = _Live(nbytes, place, peer)
            self._add(entry, nbytes)
        entry.holders += 1
        weakref.finalize(tensor, self._release, key, entry)
        self.sample()

    def _release(self, key: int, entry: _Live) -> None:
        entry.holders -= 1
        if entry.holders == 0 and self._live.get(key) is entry:
            del self._live[key]
            self._add(entry, -entry.nbytes)

    def _add(self, entry: _Live, nbytes: int) -> None:
        if entry.place is Place.DEVICE:
            self._device_bytes += nbytes
        elif entry.place is Place.HOST:
            self._host_bytes += nbytes
        else:
            peer = entry.peer or "?"
            self._peer_bytes[peer] = self._peer_bytes.get(peer, 0) + nbytes

    @contextmanager
    def saving(self) -> Iterator[None]:
        """Count every tensor autograd saves inside this context (see the module docstring)."""
        with torch.autograd.graph.saved_tensors_hooks(self.pack, _unpack):
            yield

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        """What autograd keeps for a saved tensor: a new object of its storage, counted."""
        packed = tensor.detach()  # no reference cycle through grad_fn; lives as long as saved
        self.track(packed)
        return packed

    @contextmanager
    def recomputing(self) -> Iterator[None]:
        """Inside a checkpoint's recomputation: count what it saves again (the object torch's
        checkpoint keeps for the backward), handing each tensor on to its own hook."""
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is None:
            yield
            return
        pack, unpack = top

        def counted(tensor: torch.Tensor) -> Any:
            kept = pack(tensor)
            if isinstance(kept, torch.Tensor):
                self.track(kept)
            return kept

        with torch.autograd.graph.saved_tensors_hooks(counted, unpack):
            yield

    # --- totals ----------------------------------------------------------------------------

    def now(self) -> MemorySample:
        """What the rank holds at this moment."""
        device, host = self._state_totals
        return MemorySample(device + self._device_bytes, host + self._host_bytes,
                            {k: float(v) for k, v in self._peer_bytes.items() if v})

    def sample(self) -> None:
        """Fold the present into this step's peak."""
        device, host = self._state_totals
        peak = self._peak
        peak.device_bytes = max(peak.device_bytes, device + self._device_bytes)
        peak.host_bytes = max(peak.host_bytes, host + self._host_bytes)
        for name, held in self._peer_bytes.items():
            peak.peer_bytes[name] = max(peak.peer_bytes.get(name, 0.0), float(held))

    def start_step(self) -> None:
        """A step begins: its peak starts from what the rank holds now."""
        self._peak = MemorySample(0.0, 0.0, {})
        self.sample()

    def peak(self) -> MemorySample:
        """The step's peak so far (device, host, and per peer device)."""
        self.sample()
        return MemorySample(self._peak.device_bytes, self._peak.host_bytes,
                            {k: v for k, v in self._peak.peer_bytes.items() if v})


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _totals(entries: Iterable[_Entry]) -> tuple[float, float]:
    """Device and host bytes of the model states still alive."""
    device = host = 0.0
    for entry in entries:
        if entry.ref.expired():
            continue
        if entry.place is Place.HOST:
            host += entry.nbytes
        else:
            device += entry.nbytes
    return device, host


def _optimizer_tensors(optimizer: torch.optim.Optimizer | None) -> Iterator[torch.Tensor]:
    if optimizer is None:
        return
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                yield local_tensor(value)
