"""Ranks of the shard tests (tests/runtime/test_shards.py): tensor-parallel parameters on a
two-rank gloo mesh, built with the placements potluck's TP gives them.

A "fake GPU" is a mesh that says it is ``cuda`` while its tensors stay on the host:
``Tensor.to`` towards ``cuda`` records the elements it would move and returns the
tensor itself. On a real GPU, ``distribute_tensor`` of a host tensor copies all of it
to the mesh's device before cutting the shard; that copy is what the fake GPU shows.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import (
    DeviceMesh,
    DTensor,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
)
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from potluck.runtime.grads.buckets import FullLayout, SyncedParam
from potluck.runtime.models.build import InitKind, initial_value, materialize

# (name, full shape, placement): an uneven vocabulary-parallel embedding (5 rows over 2
# ranks: 3 + 2), GPT-2's fused QKV (every rank keeps its columns of q, k and v), a
# column-parallel weight, a replicated norm weight.
PARAMS: tuple[tuple[str, tuple[int, ...], Placement], ...] = (
    ("embed", (5, 4), Shard(0)),
    ("qkv", (4, 12), _StridedShard(1, split_factor=3)),
    ("up", (8, 4), Shard(0)),
    ("norm", (4,), Replicate()),
)


def mesh_of_two() -> DeviceMesh:
    return init_device_mesh("cpu", (dist.get_world_size(),))


def on_meta(mesh: DeviceMesh, shape: tuple[int, ...], placement: Placement) -> nn.Parameter:
    meta = torch.empty(shape, device="meta")
    return nn.Parameter(distribute_tensor(meta, mesh, [placement], src_data_rank=None))


def expected_shard(name: str, mesh: DeviceMesh, shape: tuple[int, ...],
                   placement: Placement) -> torch.Tensor:
    """What torch's own ``distribute_tensor`` makes this rank's shard of the initial value."""
    full = initial_value(name, InitKind.NORMAL, torch.Size(shape), seed=0)
    return distribute_tensor(full, mesh, [placement], src_data_rank=None).to_local()


def _target(args: tuple, kwargs: dict) -> str | None:
    target = kwargs.get("device", args[0] if args else None)
    if isinstance(target, torch.device):
        return target.type
    return target if isinstance(target, str) else None


@contextmanager
def fake_gpu(mesh: DeviceMesh, moved: list[int]) -> Iterator[torch.device]:
    """The mesh says ``cuda``; moves to ``cuda`` are recorded (elements) and not made."""
    real_to = torch.Tensor.to

    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if _target(args, kwargs) == "cuda":
            moved.append(self.numel())
            return self
        return real_to(self, *args, **kwargs)

    mesh._device_type = "cuda"
    torch.Tensor.to = to
    try:
        yield torch.device("cuda")
    finally:
        torch.Tensor.to = real_to
        mesh._device_type = "cpu"


def materialize_on_fake_gpu(rank: int, world_size: int, out: Path) -> None:
    """Each parameter alone: the elements moved to the fake GPU, and the shard it got."""
    mesh = mesh_of_two()
    rows = []
    for name, shape, placement in PARAMS:
        module = nn.Module()
        module.register_parameter(name, on_meta(mesh, shape, placement))
        moved: list[int] = []
        with fake_gpu(mesh, moved) as gpu:
            materialize([module], gpu, seed=0, kinds={name: InitKind.NORMAL})
        local = getattr(module, name).to_local()
        expected = expected_shard(name, mesh, shape, placement)
        assert torch.equal(local, expected), f"{name}: rank {rank} got the wrong shard"
        rows.append({"name": name, "local": local.numel(), "moved": moved})
    _write(out, rank, rows)


def _storages(tree: Any) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tree_leaves(tree)
            if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and not t.is_meta}


class Allocations(TorchDispatchMode):
    """Every new tensor an op returns (not a view or an in-place result): its dtype and
    elements."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[torch.dtype, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        result = func(*args, **(kwargs or {}))
        inputs = _storages((args, kwargs))
        for tensor in tree_leaves(result):
            if isinstance(tensor, torch.Tensor) and not isinstance(tensor, DTensor) \
                    and not tensor.is_meta and tensor.untyped_storage().data_ptr() not in inputs:
                self.made.append((tensor.dtype, tensor.numel()))
        return result


def full_layout_round_trip(rank: int, world_size: int, out: Path) -> None:
    """Gradients written into a full-size flat tensor as a full-layout bucket does inside
    the backward hook (first call: nothing cached), summed over the ranks, taken back."""
    mesh = mesh_of_two()
    layout = FullLayout(tp_rank=rank)
    rows = []
    for name, shape, placement in PARAMS:
        full = torch.arange(float(torch.Size(shape).numel())).view(shape) + 1
        param = nn.Parameter(distribute_tensor(full, mesh, [placement], src_data_rank=None))
        item = SyncedParam(name, param, "block.0", None)  # type: ignore[arg-type]
        grad = param.to_local().detach().clone()
        with Allocations() as seen:
            flat = layout.flat([item], [grad])
        dist.all_reduce(flat)  # what the bucket's all-reduce does
        assert torch.equal(flat.view(shape), full), f"{name}: the shards do not add up"
        back = torch.empty_like(grad)
        layout.take(param, flat, back)
        assert torch.equal(back, grad), f"{name}: rank {rank} took back the wrong elements"
        rows.append({"name": name, "full": param.numel(), "local": grad.numel(),
                     "largest_dim": max(shape),
                     "made": [(str(dtype), size) for dtype, size in seen.made]})
    _write(out, rank, rows)


def _write(out: Path, rank: int, rows: list[dict[str, Any]]) -> None:
    (out / f"rank_{rank}.json").write_text(json.dumps(rows))
