"""A mixed-TP leader never blocks the host to command its followers.

No GPU here: the ``meta`` device stands for the leader's GPU, and :class:`FakeCudaSyncs`
counts what would block the host on CUDA, as torch 2.13's source does it:

- a copy from host to device (``copy_``, ``_to_copy``) waits for the device unless its
  source is pinned and the copy non-blocking (``aten/src/ATen/native/cuda/Copy.cu``,
  ``copy_kernel_cuda``: ``memcpy_and_sync`` otherwise);
- ``torch.tensor(values, device=gpu)`` builds the tensor in pageable host memory and copies
  it with ``non_blocking=False`` (``torch/csrc/utils/tensor_new.cpp``,
  ``internal_new_from_data``), a copy the meta device hides, so the fake wraps it;
- reading a device value on the host (``item``, ``int``: ``_local_scalar_dense``; ``tolist``,
  ``.cpu()``: a copy to the host) always waits; the fake reads zeros.

Pinning is faked too (no CUDA here to pin with): a pinned tensor is a clone the fake
remembers.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from potluck.runtime.parallel import mixed_tp

GPU = torch.device("meta")
aten = torch.ops.aten


class FakeCudaSyncs(TorchDispatchMode):
    """Records each op that would block the host on CUDA (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[str] = []
        self._pinned: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.is_pinned.default:
            return id(args[0]) in self._pinned
        if func is aten._pin_memory.default:
            pinned = args[0].clone()
            self._pinned.add(id(pinned))
            return pinned
        if func is aten._local_scalar_dense.default and args[0].device == GPU:
            self.syncs.append("read back")
            return 0
        if func is aten._to_copy.default and args[0].device == GPU \
                and kwargs.get("device") == torch.device("cpu"):
            self.syncs.append("read back")
            return torch.zeros(args[0].shape, dtype=kwargs.get("dtype", args[0].dtype))
        if func is aten._to_copy.default and args[0].device.type == "cpu":
            self._check_upload(args[0], kwargs.get("device"), kwargs.get("non_blocking", False))
        if func is aten.copy_.default:
            self._check_upload(args[1], args[0].device, len(args) > 2 and args[2])
        return func(*args, **kwargs)

    def _check_upload(self, source: torch.Tensor, target: torch.device | None,
                      non_blocking: bool) -> None:
        if source.device.type == "cpu" and target == GPU:
            if not (non_blocking and id(source) in self._pinned):
                self.syncs.append("pageable or blocking upload")

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        real = torch.tensor

        def tensor(data, *args, device=None, **kwargs):
            if device is not None and torch.device(device) == GPU:
                self.syncs.append("torch.tensor on the device")
            return real(data, *args, device=device, **kwargs)

        monkeypatch.setattr(torch, "tensor", tensor)


def _tp(leader: bool) -> SimpleNamespace:
    """One rank of a two-rank stage; its broadcasts go nowhere."""
    return SimpleNamespace(device=GPU, is_leader=leader, size=2, index=0 if leader else 1,
                           broadcast=lambda tensor: None)


@pytest.fixture
def fake(monkeypatch) -> FakeCudaSyncs:
    mode = FakeCudaSyncs()
    mode.install(monkeypatch)
    return mode


def test_announcing_a_command_does_not_block_the_leader(fake):
    commands = mixed_tp.Commands(_tp(leader=True))
    with fake:
        commands.announce(mixed_tp.FORWARD, 1, 3)
        commands.done()
    assert fake.syncs == []


def test_sending_an_activation_to_followers_does_not_block_the_leader(fake):
    x = torch.empty(2, 16, 8, dtype=torch.bfloat16, device=GPU)
    with fake:
        full = mixed_tp._broadcast_activation(x, _tp(leader=True))
    assert fake.syncs == [] and full.shape == x.shape


def test_a_follower_reads_what_it_receives_which_the_fake_counts(fake):
    """Followers must know what to run and what to allocate: one read each."""
    with fake:
        assert mixed_tp.Commands(_tp(leader=False)).receive() == (0, 0, 0)
        mixed_tp._broadcast_activation(mixed_tp.placeholder(GPU), _tp(leader=False))
    assert fake.syncs == ["read back", "read back"]


def test_device_longs_holds_the_values_on_cpu():
    assert mixed_tp.device_longs([3, -1, 7], torch.device("cpu")).tolist() == [3, -1, 7]
