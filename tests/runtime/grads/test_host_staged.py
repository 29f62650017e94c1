"""Islands joined through host memory (``Island.transport = host``): the cross-island groups
are gloo groups beside the backend's, and the wire stages each payload device -> pinned host
memory -> gloo -> device. On CPU ranks the path is forced by the transport; a fake CUDA device
(``Tensor.to`` to ``cuda`` keeps the data on the CPU and remembers it) shows where each tensor
is."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from island_workers import as_tensors, split, train_islands
from runtime_helpers import TINY_LLAMA, make_plan, pipe

from potluck.plans import Compression, Island, Transport
from potluck.runtime.grads.islands import CrossIslandWire
from potluck.runtime.layout import Layout

ONE_STAGE = [(1, (0, 4))]
CUDA = torch.device("cuda", 0)


def _host(plan):
    """``plan`` with its second island's transport host (one is enough: every cross-island
    group then goes through the host)."""
    first, second = plan.islands.islands
    islands = (first, Island(second.pipelines, Transport.HOST))
    return replace(plan, islands=replace(plan.islands, islands=islands))


def test_host_staged_islands_train_as_the_backend_ones():
    """Same losses and weights, bit for bit: staging moves the values, never rounds them."""
    plan = split(make_plan(TINY_LLAMA, [pipe(ONE_STAGE, 1, 2)] * 2), (0,), (1,), inner_steps=2,
                 compression=Compression.BF16)
    backend, host = train_islands(plan, 2), train_islands(_host(plan), 2)
    for a, b in zip(backend, host, strict=True):
        assert [m.loss for m in a.metrics] == [m.loss for m in b.metrics]
        assert [m.bytes_exchanged_across_islands for m in a.metrics] == \
            [m.bytes_exchanged_across_islands for m in b.metrics]
        for name, value in as_tensors(a.weights[2]).items():
            assert torch.equal(value, as_tensors(b.weights[2])[name]), name


def _created_groups(plan, monkeypatch) -> list[tuple[tuple[int, ...], str | None]]:
    """Every group ``Layout.create_groups`` makes on rank 0, with its backend (None: the
    default group's)."""
    made: list[tuple[tuple[int, ...], str | None]] = []

    def new_group(ranks, backend=None):
        made.append((tuple(ranks), backend))
        return object()

    monkeypatch.setattr(dist, "new_group", new_group)
    Layout.for_local_ranks(plan, 0).create_groups()
    return made


def test_the_cross_island_groups_of_host_staged_islands_are_gloo_groups(monkeypatch):
    """Two islands of two replicas: the cross-island groups (all four ranks) are gloo; the
    islands' own groups keep the job's backend; without host transport, nothing is gloo."""
    plan = split(make_plan(TINY_LLAMA, [pipe(ONE_STAGE, 1, 1)] * 4), (0, 1), (2, 3),
                 inner_steps=2)
    made = _created_groups(_host(plan), monkeypatch)
    assert {ranks for ranks, backend in made if backend == "gloo"} == {(0, 1, 2, 3)}
    assert {backend for ranks, backend in made if ranks != (0, 1, 2, 3)} == {None}
    assert all(backend is None for _, backend in _created_groups(plan, monkeypatch))


class FakeDevice:
    """Which storages are "on the GPU" and which host buffers were pinned; what each
    collective was given."""

    def __init__(self) -> None:
        self.on_device: set[int] = set()
        self.pinned: set[int] = set()
        self.given: list[torch.Tensor] = []

    def where(self, tensor: torch.Tensor) -> str:
        key = tensor.untyped_storage().data_ptr()
        return "device" if key in self.on_device else "pinned" if key in self.pinned else "host"


class _Done:
    def wait(self) -> None:
        return None


TO, EMPTY = torch.Tensor.to, torch.empty


@pytest.fixture
def fake(monkeypatch) -> FakeDevice:
    fake = FakeDevice()

    def to(tensor, *args, **kwargs):
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        if device is None or device.type != "cuda":
            return TO(tensor, *args, **kwargs)
        moved = TO(tensor, "cpu", dtype or tensor.dtype, copy=True)
        fake.on_device.add(moved.untyped_storage().data_ptr())
        return moved

    def empty(*args, pin_memory: bool = False, **kwargs):
        tensor = EMPTY(*args, **kwargs)
        if pin_memory:
            fake.pinned.add(tensor.untyped_storage().data_ptr())
        return tensor

    def all_reduce(tensor, group=None, async_op=False):
        fake.given.append(tensor)
        tensor.mul_(2)  # two ranks holding the same values
        return _Done()

    def all_gather(out, tensor, group=None, async_op=False):
        fake.given.append(tensor)
        for slot in out:
            slot.copy_(tensor)
        return _Done()

    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(dist, "all_gather", all_gather)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    return fake


@pytest.mark.parametrize("compression", list(Compression))
def test_a_host_staged_wire_hands_gloo_pinned_host_tensors_and_lands_the_sum_on_the_device(
        fake, compression):
    flat = torch.linspace(-1.0, 1.0, 10)
    total = CrossIslandWire(compression, CUDA, host=True).start(flat, None).wait()
    assert [fake.where(t) for t in fake.given] and \
        all(fake.where(t) == "pinned" for t in fake.given)
    assert fake.where(total) == "device"
    torch.testing.assert_close(total, 2 * flat, atol=2 * 2.0**-7, rtol=0)


def test_the_backend_wire_hands_the_collective_device_tensors(fake):
    CrossIslandWire(Compression.NONE, CUDA).start(torch.ones(4), None).wait()
    assert [fake.where(t) for t in fake.given] == ["device"]
