"""Where this rank's shard of a tensor-parallel parameter sits in the full tensor.

A parameter is sharded along at most one dimension (potluck's TP meshes are
one-dimensional). :func:`shard_index` gives that dimension and the positions,
along it, of the local tensor's slices, in the local tensor's order:
contiguous for ``Shard`` (uneven splits as ``torch.chunk`` makes them), one
block per q, k and v for GPT-2's fused QKV (``_StridedShard``). The positions
come from distributing a probe of that one dimension with the parameter's own
placements (torch's semantics, no communication), so they take ``8 x size(dim)``
bytes: never a tensor of the parameter's size, never the parameter itself on
the device.

- :func:`host_shard`: this rank's shard of a full value kept on the host, so
  that :func:`~potluck.runtime.models.build.materialize` moves only the shard
  to the GPU (``distribute_tensor`` would first copy the whole fp32 value there:
  4.2 GB for a 128k x 8k embedding);
- :meth:`ShardIndex.write` / :meth:`ShardIndex.read`: put a local shard into,
  or take it out of, a flat full-size tensor in place (the gradient buckets
  whose members shard a parameter differently, :mod:`potluck.runtime.grads.buckets`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard


@dataclass(frozen=True)
class ShardIndex:
    """The dimension a parameter is sharded along and this rank's positions on it (``dim``
    None: the local tensor is the whole parameter)."""

    shape: torch.Size  # the full parameter's
    local_shape: torch.Size
    dim: int | None = None
    positions: torch.Tensor | None = None  # int64, ``local_shape[dim]`` of them

    def write(self, full: torch.Tensor, values: torch.Tensor) -> None:
        """Copy the local ``values`` into their places in the flat full-size ``full`` (in
        ``full``'s dtype)."""
        target = full.view(self.shape)
        values = values.reshape(self.local_shape)
        if self.dim is None:
            target.copy_(values)
        else:
            target.index_copy_(self.dim, self.positions, values.to(target.dtype))

    def read(self, full: torch.Tensor, out: torch.Tensor) -> None:
        """Copy this rank's elements of the flat full-size ``full`` into ``out``."""
        source = full.view(self.shape)
        if self.dim is None:
            out.copy_(source.view_as(out))
        else:
            out.copy_(source.index_select(self.dim, self.positions).view_as(out))


def sharded_dim(param: torch.Tensor) -> int | None:
    """The one dimension ``param`` is split along over its mesh (None: not split)."""
    if not isinstance(param, DTensor):
        return None
    dims = set()
    for placement in param.placements:
        if isinstance(placement, Shard | _StridedShard):
            dims.add(placement.dim % param.ndim)
        elif not isinstance(placement, Replicate):
            raise ValueError(f"a parameter placed {placement} has no shard to take")
    if len(dims) > 1:
        raise ValueError(f"a parameter sharded along dimensions {sorted(dims)}; potluck's "
                         "tensor parallelism splits one")
    return dims.pop() if dims else None


def shard_index(param: torch.Tensor) -> ShardIndex:
    """Where ``param``'s local tensor sits in the full parameter (see the module docstring)."""
    dim = sharded_dim(param)
    if dim is None:
        return ShardIndex(param.shape, param.shape)
    probe_shape = [1] * param.ndim
    probe_shape[dim] = param.shape[dim]
    probe = torch.arange(param.shape[dim]).view(probe_shape)
    local = distribute_tensor(probe, param.device_mesh, param.placements, src_data_rank=None)
    positions = local.to_local().reshape(-1)
    local_shape = list(param.shape)
    local_shape[dim] = positions.numel()
    return ShardIndex(param.shape, torch.Size(local_shape), dim, positions)


def host_shard(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``param``'s full value ``full``, cut where ``full`` is (the host)."""
    index = shard_index(param)
    if index.dim is None:
        return full
    return full.index_select(index.dim, index.positions.to(full.device))
