"""Activation swapping: a stage's first blocks' saved tensors leave the device between a
micro-batch's forward and its backward pass.

Inside :meth:`ActivationSwap.block` (a :class:`torch.autograd.graph.saved_tensors_hooks`
around one swapped block's forward) every tensor autograd saves is copied, one storage
at a time and storages larger than ``chunk_bytes`` in pieces, to its stash: host memory
(pinned, on GPUs), the peer GPU the plan names (``swap_peer``, same machine), or for
``hybrid`` the first ``host_share`` of each storage's bytes to host memory and the rest
to the peer (Mbapp). On GPUs the copies run on two side streams, one each way
(:class:`CopyStreams`): every stash goes out on one, once the compute stream has made
its tensor, and ends with an event; the device storage is released once the copy is
done (``record_stream``). When the micro-batch's backward reaches the stage (a hook on
the stage's output), every stash of that micro-batch is brought back on the other
(prefetched: after its own stash's event, with an event per storage the backward waits
on), so one micro-batch's stashes come back while the next one's go out; an unpack
before that brings its storage back at once, on the compute stream. Values, dtypes,
sizes, strides and offsets come back exactly as saved, so numerics are bit-identical to
keeping the tensors.

Never moved: parameters and their views (a weight transposed for a matmul), tensors
made from one parameter alone (autocast's 16-bit cast of a weight, which its cache
holds for the whole autocast region anyway; the cast of a view; a view of a 16-bit
weight FSDP2 gathered after the swap was made: :func:`made_from_a_parameter`), other
leaf tensors that require gradients (a stage's received input, which torch's schedule
holds anyway), tensor subclasses (a DTensor of tensor parallelism) and tensors of
another device. A stash is therefore the swapped blocks' activations only, which is
what the cost model's swapped bytes count. On CPU ranks every stash is a separate CPU
tensor that the :class:`~potluck.runtime.memory.ledger.MemoryLedger` counts as host
memory, or as memory held on the peer device.
"""

from __future__ import annotations

import weakref
from collections.abc import Container, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from potluck.plans.memory import Swap
from potluck.runtime.memory.ledger import Kind, MemoryLedger, Place, local_tensor, storage_key

CHUNK_BYTES = 8 << 20  # pieces of a large storage copied one after the other
PARAMETER_CHAIN_NODES = 4  # autograd nodes followed back from a saved tensor to a parameter


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


def made_from_a_parameter(tensor: torch.Tensor, parameters: Container[int] = (),
                          most_nodes: int = PARAMETER_CHAIN_NODES) -> bool:
    """Whether autograd made ``tensor`` from one parameter alone: its history is a chain of
    at most ``most_nodes`` one-input nodes (a cast, a view) ending at the parameter's
    ``AccumulateGrad`` (a leaf that is an ``nn.Parameter`` or whose storage key is in
    ``parameters``), and it holds no more elements than that parameter."""
    node = tensor.grad_fn
    for _ in range(most_nodes):
        if node is None:
            return False
        inputs = [n for n, _ in node.next_functions if n is not None]
        if len(inputs) != 1:
            return False
        node = inputs[0]
        leaf = getattr(node, "variable", None)  # only AccumulateGrad has one
        if leaf is not None:
            local = local_tensor(leaf)
            elements = tensor.untyped_storage().nbytes() // tensor.element_size()
            return ((isinstance(leaf, nn.Parameter) or storage_key(local) in parameters)
                    and elements <= local.numel())
    return False


class CopyStreams:
    """A GPU's two copy streams, one each way: ``out`` (device to stash, or to the host for
    optimizer offload, :mod:`~potluck.runtime.grads.offload`) and ``back`` (to the device).
    Whatever the number of tensors and micro-batches, these two; the host never waits (no
    ``synchronize``): streams wait on streams and events."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.out = torch.cuda.Stream(device)
        self.back = torch.cuda.Stream(device)

    def compute(self) -> torch.cuda.Stream:
        """The stream the model computes on (the device's current stream)."""
        return torch.cuda.current_stream(self.device)

    @contextmanager
    def copying_out(self) -> Iterator[torch.cuda.Event]:
        """Copies on ``out`` after the compute stream's work so far; the event it yields
        is recorded once they are queued (a stash's bytes are all out once it is done)."""
        done = torch.cuda.Event()
        self.out.wait_stream(self.compute())
        with torch.cuda.stream(self.out):
            yield done
        done.record(self.out)

    @contextmanager
    def copying_back(self, out: torch.cuda.Event, prefetch: bool
                     ) -> Iterator[torch.cuda.Event | None]:
        """Copies after the stash's ``out`` event: prefetched on ``back`` (the event it
        yields is recorded once they are queued, for the compute stream to wait on),
        else on the compute stream itself (it yields none)."""
        if not prefetch:
            self.compute().wait_event(out)
            yield None
            return
        done = torch.cuda.Event()
        self.back.wait_event(out)
        with torch.cuda.stream(self.back):
            yield done
        done.record(self.back)


class _Stashed:
    """One storage's bytes away from the device, and their way back."""

    def __init__(self, swap: ActivationSwap, storage: torch.UntypedStorage) -> None:
        self.swap = swap
        self.source = StorageWeakRef(storage)  # while held, no other storage gets its key
        self.nbytes = storage.nbytes()
        self.pieces: list[tuple[int, int, torch.Tensor]] = []
        self.restored: torch.Tensor | None = None  # the storage's bytes back on the device
        self.out: torch.cuda.Event | None = None  # on GPUs: its copies out are done
        self.back: torch.cuda.Event | None = None  # on GPUs: its prefetch is done
        source = _bytes_of(storage, swap.target.device)
        streams = swap.streams
        with streams.copying_out() if streams is not None else nullcontext() as self.out:
            for place, start, end in swap.target.split(self.nbytes):
                piece = swap.allocate(place, end - start)
                piece.copy_(source[start:end], non_blocking=streams is not None)
                self.pieces.append((start, end, piece))
        if streams is not None:
            source.record_stream(streams.out)

    def restore(self, prefetch: bool = False) -> torch.UntypedStorage:
        """The storage back on the device (copied now, or the prefetched copy once ready)."""
        swap, streams = self.swap, self.swap.streams
        if self.restored is None:
            copying = (streams.copying_back(self.out, prefetch) if streams is not None
                       else nullcontext())
            with copying as self.back:
                buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=swap.target.device)
                for start, end, piece in self.pieces:
                    buffer[start:end].copy_(piece, non_blocking=streams is not None)
            if self.back is not None:  # made on the back stream, used on the compute stream
                buffer.record_stream(streams.compute())
            self.pieces = []
            self.restored = buffer
            swap.track(buffer, Kind.ACTIVATIONS, Place.DEVICE)
        if self.back is not None:
            streams.compute().wait_event(self.back)
            self.back = None
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
                 parameters: Iterable[torch.Tensor] = (),
                 streams: CopyStreams | None = None) -> None:
        """``streams``: the GPU copy streams (default: made on a CUDA ``target.device``)."""
        self.target = target
        self.ledger = ledger
        tensors = [local_tensor(p) for p in parameters]
        self._parameters = {storage_key(p): StorageWeakRef(p.untyped_storage()) for p in tensors}
        if streams is None and target.device.type == "cuda":
            streams = CopyStreams(target.device)
        self.streams = streams
        self._current: _MicroBatch | None = None

    # --- where bytes go ----------------------------------------------------------------------

    def allocate(self, place: Place, nbytes: int) -> torch.Tensor:
        if place is Place.HOST:
            pinned = self.streams is not None
            piece = torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=pinned)
        else:
            piece = torch.empty(nbytes, dtype=torch.uint8, device=self.target.peer_device)
        self.track(piece, Kind.STASH, place)
        return piece

    def track(self, tensor: torch.Tensor, kind: Kind, place: Place) -> None:
        if self.ledger is not None:
            peer = self.target.peer_id if place is Place.PEER else None
            self.ledger.track(tensor, kind, place, peer)

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
                or made_from_a_parameter(tensor, self._parameters)  # its 16-bit cast
                or tensor.device != self.target.device or tensor.layout is not torch.strided)

    def _unpack(self, saved: torch.Tensor | _Saved) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):
            return saved
        storage = saved.stash.restore()
        empty = torch.empty(0, dtype=saved.dtype, device=self.target.device)
        return empty.set_(storage, saved.offset, saved.size, saved.stride)
