"""Activation swapping: a stage's first blocks' saved tensors leave the device between a
micro-batch's forward and its backward pass.

Inside :meth:`ActivationSwap.block` (a :class:`torch.autograd.graph.saved_tensors_hooks`
around one swapped block's forward) every tensor autograd saves is copied, one storage
at a time and storages larger than ``chunk_bytes`` in pieces, to its stash: host memory
(pinned, on GPUs), the peer GPU the plan names (``swap_peer``, same machine), or for
``hybrid`` the first ``host_share`` of each storage's bytes to host memory and the rest
to the peer (Mbapp). On GPUs the copies run on a side stream; the device storage is
released once the copy is done (``record_stream``). When the micro-batch's backward
reaches the stage (a hook on the stage's output), every stash of that micro-batch is
brought back (prefetched, on GPUs on the side stream with an event per storage the
backward waits on); an unpack before that brings its storage back at once. Values,
dtypes, sizes, strides and offsets come back exactly as saved, so numerics are
bit-identical to keeping the tensors.

Never moved: parameters and their views (a weight transposed for a matmul), other
leaf tensors that require gradients (a stage's received input, which torch's schedule
holds anyway), tensor subclasses (a DTensor of tensor parallelism) and tensors of
another device. On CPU
ranks every stash is a separate CPU tensor that the
:class:`~potluck.runtime.memory.ledger.MemoryLedger` counts as host memory, or as
memory held on the peer device.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from potluck.plans.memory import Swap
from potluck.runtime.memory.ledger import Kind, MemoryLedger, Place, local_tensor, storage_key

CHUNK_BYTES = 8 << 20  # pieces of a large storage copied one after the other


@dataclass(frozen=True)
class SwapTarget:
    """Where one rank's stashes go."""

    swap: Swap
    device: torch.device  # the rank's own device
    peer_device: torch.device | None = None  # the peer GPU (on CPU ranks: the CPU)
    peer_id: str | None = None  # the plan's id of the peer device
    host_share: float = 0.5
    chunk_bytes: int = CHUNK_BYTES

    def split(self, nbytes: int) -> list[tuple[Place, int, int]]:
        """``(place, start, end)`` byte ranges of a storage of ``nbytes``."""
        if self.swap is Swap.HOST:
            host = nbytes
        elif self.swap is Swap.PEER:
            host = 0
        else:
            host = round(self.host_share * nbytes)
        ranges = [(Place.HOST, 0, host), (Place.PEER, host, nbytes)]
        return [(place, a, min(a + self.chunk_bytes, end)) for place, start, end in ranges
                for a in range(start, end, self.chunk_bytes)]


def _bytes_of(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


class _Stashed:
    """One storage's bytes away from the device, and their way back."""

    def __init__(self, swap: ActivationSwap, storage: torch.UntypedStorage) -> None:
        self.swap = swap
        self.source = StorageWeakRef(storage)  # while held, no other storage gets its key
        self.nbytes = storage.nbytes()
        self.pieces: list[tuple[int, int, torch.Tensor]] = []
        self.restored: torch.Tensor | None = None  # the storage's bytes back on the device
        self.event: torch.cuda.Event | None = None
        source = _bytes_of(storage, swap.target.device)
        with swap.side_stream():
            for place, start, end in swap.target.split(self.nbytes):
                piece = swap.allocate(place, end - start)
                piece.copy_(source[start:end], non_blocking=swap.on_gpu)
                self.pieces.append((start, end, piece))
        if swap.on_gpu:
            source.record_stream(swap.stream)

    def restore(self, prefetch: bool = False) -> torch.UntypedStorage:
        """The storage back on the device (copied now, or the prefetched copy once ready)."""
        swap = self.swap
        if self.restored is None:
            device = swap.target.device
            with swap.side_stream(prefetch):
                buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
                for start, end, piece in self.pieces:
                    buffer[start:end].copy_(piece, non_blocking=swap.on_gpu)
                if swap.on_gpu and prefetch:
                    self.event = torch.cuda.Event()
                    self.event.record(swap.stream)
            if swap.on_gpu and prefetch:  # made on the side stream, used on the current one
                buffer.record_stream(torch.cuda.current_stream(device))
            self.pieces = []
            self.restored = buffer
            swap.track(buffer, Kind.ACTIVATIONS, Place.DEVICE)
        if self.event is not None:
            torch.cuda.current_stream(swap.target.device).wait_event(self.event)
            self.event = None
        return self.restored.untyped_storage()


@dataclass(frozen=True)
class _Saved:
    """What autograd keeps for one swapped tensor: its storage's stash and its view."""

    stash: _Stashed
    dtype: torch.dtype
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


class _MicroBatch:
    """The stashes of one micro-batch's forward through one stage module."""

    def __init__(self) -> None:
        self.stashes: weakref.WeakValueDictionary[int, _Stashed] = weakref.WeakValueDictionary()

    def prefetch(self) -> None:
        for stash in reversed(list(self.stashes.values())):  # the backward's order
            stash.restore(prefetch=True)


class ActivationSwap:
    """One rank's activation swapping (see the module docstring)."""

    def __init__(self, target: SwapTarget, ledger: MemoryLedger | None = None,
                 parameters: Iterable[torch.Tensor] = ()) -> None:
        self.target = target
        self.ledger = ledger
        tensors = [local_tensor(p) for p in parameters]
        self._parameters = {storage_key(p): StorageWeakRef(p.untyped_storage()) for p in tensors}
        self.on_gpu = target.device.type == "cuda"
        self.stream = torch.cuda.Stream(target.device) if self.on_gpu else None
        self._current: _MicroBatch | None = None

    # --- where bytes go ----------------------------------------------------------------------

    def allocate(self, place: Place, nbytes: int) -> torch.Tensor:
        if place is Place.HOST:
            piece = torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=self.on_gpu)
        else:
            piece = torch.empty(nbytes, dtype=torch.uint8, device=self.target.peer_device)
        self.track(piece, Kind.STASH, place)
        return piece

    def track(self, tensor: torch.Tensor, kind: Kind, place: Place) -> None:
        if self.ledger is not None:
            peer = self.target.peer_id if place is Place.PEER else None
            self.ledger.track(tensor, kind, place, peer)

    @contextmanager
    def side_stream(self, enabled: bool = True) -> Iterator[None]:
        """On GPUs, run copies on the side stream once the current stream's work is done."""
        if not self.on_gpu or not enabled:
            if self.on_gpu:
                torch.cuda.current_stream(self.target.device).wait_stream(self.stream)
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.target.device))
        with torch.cuda.stream(self.stream):
            yield

    # --- hooks -------------------------------------------------------------------------------

    @contextmanager
    def micro_batch(self) -> Iterator[_MicroBatch]:
        """One forward of a stage module: the stashes its swapped blocks make."""
        outer, self._current = self._current, _MicroBatch()
        try:
            yield self._current
        finally:
            self._current = outer

    @contextmanager
    def block(self) -> Iterator[None]:
        """Swap what autograd saves inside this context (one swapped block's forward)."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def arm(self, output: torch.Tensor, batch: _MicroBatch) -> None:
        """Prefetch ``batch``'s stashes when the backward reaches ``output``."""
        if output.requires_grad and len(batch.stashes):
            output.register_hook(lambda _grad: batch.prefetch())

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor | _Saved:
        batch = self._current
        if batch is None or self._stays(tensor):
            return self.ledger.pack(tensor) if self.ledger is not None else tensor.detach()
        key = storage_key(tensor)
        stash = batch.stashes.get(key)
        if stash is None or stash.source.expired():
            stash = _Stashed(self, tensor.untyped_storage())
            batch.stashes[key] = stash
        return _Saved(stash, tensor.dtype, tensor.size(), tensor.stride(),
                      tensor.storage_offset())

    def _stays(self, tensor: torch.Tensor) -> bool:
        """Whether a saved tensor stays on the device (see the module docstring)."""
        return (type(tensor) is not torch.Tensor  # a parameter, a DTensor
                or (tensor.requires_grad and tensor.grad_fn is None)
                or storage_key(tensor) in self._parameters  # a weight transposed for a matmul
                or tensor.device != self.target.device or tensor.layout is not torch.strided)

    def _unpack(self, saved: torch.Tensor | _Saved) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):
            return saved
        storage = saved.stash.restore()
        empty = torch.empty(0, dtype=saved.dtype, device=self.target.device)
        return empty.set_(storage, saved.offset, saved.size, saved.stride)
