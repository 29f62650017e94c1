"""Activation swapping moves activations only: a weight's 16-bit copy (autocast's cast of a
parameter, or a 16-bit parameter the swap was not handed, as FSDP2's unsharded weight)
stays on the device, and gradients are the same as without the swap."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from fake_streams import FakeEvent, FakeStream, FakeStreams, done_before, storage_key
from torch import nn

from potluck.plans.memory import Swap
from potluck.runtime.memory.ledger import MemoryLedger
from potluck.runtime.memory.swap import ActivationSwap, SwapTarget

CPU = torch.device("cpu")
WIDTH, ROWS = 256, 4


def _autocast_linear(x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):  # caches the weight's bf16 cast
        return linear(x)


def _cast_of_a_view(x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    return x.to(torch.bfloat16) @ linear.weight.t().to(torch.bfloat16)


def _unsharded_16_bit(x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    return nn.functional.linear(x.to(torch.bfloat16), linear.weight)


def _run(forward: Callable, dtype: torch.dtype, known: bool, swapped: bool):
    torch.manual_seed(0)
    linear = nn.Linear(WIDTH, WIDTH).to(dtype)
    leaf = torch.randn(ROWS, WIDTH, requires_grad=True)
    ledger = MemoryLedger()
    given = list(linear.parameters()) if known else []  # FSDP2 makes its weights later
    swap = ActivationSwap(SwapTarget(Swap.HOST, CPU), ledger, given)
    with swap.micro_batch() as batch, swap.block() if swapped else torch.enable_grad():
        out = forward(leaf * 2.0, linear)  # the block's input: an activation, not a leaf
    stashed = sum(stash.nbytes for stash in batch.stashes.values())
    host_bytes = ledger.now().host_bytes
    out.float().square().sum().backward()
    return stashed, host_bytes, [leaf.grad, linear.weight.grad]


@pytest.mark.parametrize(("forward", "dtype", "known"), [
    (_autocast_linear, torch.float32, True),
    (_cast_of_a_view, torch.float32, True),
    (_unsharded_16_bit, torch.bfloat16, False),
], ids=["autocast", "cast-of-a-view", "16-bit-weight-made-later"])
def test_a_swapped_block_stashes_its_activation_not_its_16_bit_weight(forward, dtype, known):
    stashed, host_bytes, grads = _run(forward, dtype, known, swapped=True)
    activation_bytes = ROWS * WIDTH * 2  # the input's bf16 cast; the weight is 128x larger
    assert (stashed, host_bytes) == (activation_bytes, activation_bytes)
    _, _, kept = _run(forward, dtype, known, swapped=False)
    for grad, reference in zip(grads, kept, strict=True):
        assert torch.equal(grad, reference)


# --- streams: one each way ---------------------------------------------------------------------
# No GPU here: torch.cuda's streams and events are fakes with vector clocks (a stream's
# work is ordered; wait_stream and wait_event order it after another stream's work so far,
# as CUDA does), so "copy A is done before B starts" is a comparison of clocks. The swap's
# copies are logged on the stream current at the time; each module's forward is work on
# the compute stream.


class FakeCuda(FakeStreams):
    """torch.cuda's streams (the compute stream first) and a log of the copies queued."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[tuple[str, dict[str, int], int, int, int]] = []
        # stream, clock, dst, src, the compute stream's work queued by then
        self.recorded: list[tuple[int, str]] = []  # record_stream: storage, stream

    def copy(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False
             ) -> torch.Tensor:
        assert non_blocking, "a swap copy that blocks the host"
        compute = self.streams[0].clock["compute"]
        self.copies.append((self.current.name, self.current.queue(), storage_key(dst),
                            storage_key(src), compute))
        return COPY(dst, src, non_blocking)


COPY = torch.Tensor.copy_


@pytest.fixture
def cuda(monkeypatch) -> FakeCuda:
    fake = FakeCuda()
    for name in ("Stream", "current_stream", "stream"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.Tensor, "copy_", lambda dst, src, non_blocking=False: fake.copy(
        dst, src, non_blocking))
    monkeypatch.setattr(torch.cuda, "synchronize", FakeStream.synchronize)
    monkeypatch.setattr(torch.Tensor, "record_stream",
                        lambda t, s: fake.recorded.append((storage_key(t), s.name)))
    empty = torch.empty

    def unpinned(*args, pin_memory: bool = False, **kwargs):
        assert pin_memory, "a host stash in pageable memory"
        return empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=None, **k: (
        unpinned(*a, pin_memory=pin_memory, **k) if pin_memory is not None else empty(*a, **k)))
    return fake


def test_swap_copies_out_on_one_stream_and_back_on_another_in_order(cuda):
    from potluck.runtime.memory.swap import CopyStreams

    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH))
    swap = ActivationSwap(SwapTarget(Swap.HOST, CPU), MemoryLedger(), list(block.parameters()),
                          streams=CopyStreams(CPU))
    for module in block:
        module.register_forward_pre_hook(lambda *_: cuda.current.queue() and None)
    waited: list[bool] = []  # per tensor unpacked: the compute stream waits for its copy back

    def unpack(saved):
        tensor = swap._unpack(saved)
        if isinstance(saved, torch.Tensor):  # kept on the device (a weight)
            return tensor
        back = [(s, c) for s, c, dst, _, _ in cuda.copies if dst == storage_key(tensor)][-1]
        waited.append(back[0] != "compute" and done_before(back[1], back[0], cuda.current.clock))
        return tensor

    outputs = []
    for _ in range(3):  # micro-batches, all forward, then all backward
        with swap.micro_batch() as batch:
            with torch.autograd.graph.saved_tensors_hooks(swap._pack, unpack):
                out = block(torch.randn(ROWS, WIDTH, requires_grad=True) * 2.0)
            swap.arm(out, batch)
        outputs.append(out)
    for out in reversed(outputs):
        out.sum().backward()

    compute, out_stream, back_stream = (s.name for s in cuda.streams)
    assert len(cuda.streams) == 3  # compute and one side stream each way, for every tensor
    pieces: dict[int, dict[str, int]] = {}  # a stash piece: the clock of the copy that wrote it
    copied_back = 0
    for stream, clock, dst, src, computed in cuda.copies:
        if src in pieces:  # coming back: prefetched, after the copy out of the same bytes
            assert stream == back_stream and done_before(pieces[src], out_stream, clock)
            copied_back += 1
        else:  # going out: after the compute stream's work so far (which made the tensor)
            assert stream == out_stream and clock[compute] == computed > 0
            pieces[dst] = clock
    assert pieces and copied_back == len(pieces)  # one piece per storage (all under 8 MB)
    assert waited and all(waited)  # prefetched, and the backward reads it after its copy
    streams_recorded = {stream for _, stream in cuda.recorded}
    assert streams_recorded == {out_stream, compute}  # sources freed after out; buffers' use
