"""Expert parallelism: the routed experts of a mixture of experts split over replicas.

Under ``plan.ep > 1`` each group of ``ep`` replicas (:meth:`potluck.plans.Plan.expert_group`)
splits every MoE block's routed experts: the member at position ``j`` of the stage's
expert group (:meth:`~potluck.runtime.layout.Layout.expert_ranks`) holds experts
``[j*E/ep, (j+1)*E/ep)``. Each token goes to the member holding each of its top-k
experts and its result comes back (two all-to-alls each way per block; GShard, Lepikhin
et al. ICLR'21; Switch Transformer, Fedus et al. JMLR'22):

1. the ``tokens x k`` assignments are sorted by expert, so each member's share is one
   contiguous run; the counts are exchanged, then the hidden states and the local expert
   ids (the hidden states with torch's functional ``all_to_all_single_autograd``, whose
   backward sends the gradients the reverse way);
2. the member runs the model's own experts module on what it received, with its local
   weights and a routing weight of 1 (so any experts implementation transformers has for
   the model, eager or grouped, computes it);
3. the results travel back, are multiplied by the routing weights (the router learns
   through them) and summed per token.

The experts' parameters (transformers' fused ``[E, ...]`` tensors: a module with
``num_experts`` whose parameters all have that many rows, one of them 3-D) become
``Shard(0)`` DTensors over the expert group's mesh, so checkpoints save each member's
rows with their offsets and load under any other layout, and the optimizer keeps the
states of its own rows only. Their gradients are summed over the members of the same
shard in every expert group (their own unit, :func:`~potluck.placement.expert_unit`).
No capacity factor: no token is dropped, so the result equals one process's.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from potluck.errors import ConfigError
from potluck.placement import block_unit, expert_unit


def expert_modules(block: nn.Module) -> list[nn.Module]:
    """The routed-expert containers in ``block`` (see the module docstring)."""
    found = []
    for module in block.modules():
        count = getattr(module, "num_experts", None)
        params = [p for p in module._parameters.values() if p is not None]
        if (isinstance(count, int) and params and any(p.dim() == 3 for p in params)
                and all(p.dim() >= 2 and p.shape[0] == count for p in params)):
            found.append(module)
    return found


def apply_ep(blocks: Sequence[nn.Module], mesh: DeviceMesh, model_name: str) -> None:
    """Split the routed experts of ``blocks`` (this rank's) over ``mesh``; one ConfigError
    for a model whose experts are not transformers' fused tensors."""
    containers = [m for block in blocks for m in expert_modules(block)]
    if blocks and not containers:
        raise ConfigError(f"{model_name}: expert parallelism needs transformers' fused experts "
                          "(a module whose weights are [experts, ...] tensors) and this model has "
                          "none; set expert_parallel to 1")
    for experts in containers:
        _shard(experts, mesh)


def _shard(experts: nn.Module, mesh: DeviceMesh) -> None:
    ep = mesh.size()
    total = experts.num_experts
    if total % ep:
        raise ConfigError(f"expert_parallel {ep} does not divide the module's {total} experts; "
                          f"use a divisor of {total}")
    for name, param in list(experts._parameters.items()):
        if param is None:
            continue
        sharded = distribute_tensor(param.detach(), mesh, [Shard(0)], src_data_rank=None)
        experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
    experts.num_experts = total // ep
    experts.forward = ExpertDispatch(experts, mesh.get_group())


def expert_unit_names(stage: nn.Module, units: dict[str, str], shard: int) -> dict[str, str]:
    """``units`` with each sharded expert parameter of ``stage`` moved from its block's unit
    to the block's expert unit of ``shard``."""
    moved = dict(units)
    for name, param in stage.named_parameters():
        if isinstance(param, DTensor) and param.device_mesh.mesh_dim_names == ("ep",):
            index = int(units[name].split(".")[1])
            if units[name] != block_unit(index):
                raise RuntimeError(f"expert parameter {name} outside a block ({units[name]})")
            moved[name] = expert_unit(index, shard)
    return moved


class ExpertDispatch:
    """The forward of one experts module under expert parallelism (module docstring)."""

    def __init__(self, experts: nn.Module, group: dist.ProcessGroup) -> None:
        self.experts = experts
        self.group = group
        self.members = dist.get_world_size(group)
        self.local = experts.num_experts
        self.original = type(experts).forward

    def __call__(self, hidden: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        chosen = flat[order]
        token = torch.div(order, k, rounding_mode="floor")
        send_counts = torch.bincount(chosen // self.local, minlength=self.members)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        sends, receives = send_counts.tolist(), recv_counts.tolist()
        local_ids = self._exchange(chosen % self.local, receives, sends)
        arrived = self._travel(hidden[token], receives, sends)
        ones = torch.ones(local_ids.shape[0], 1, dtype=top_k_weights.dtype, device=hidden.device)
        with self._local_weights():
            done = self.original(self.experts, arrived, local_ids[:, None], ones)
        back = self._travel(done, sends, receives)
        weighted = back * top_k_weights.reshape(-1)[order, None].to(back.dtype)
        return torch.zeros_like(hidden).index_add_(0, token, weighted.to(hidden.dtype))

    def _travel(self, rows: torch.Tensor, receives: list[int], sends: list[int]) -> torch.Tensor:
        """``rows`` (runs by destination) exchanged, with a backward that sends gradients back."""
        moved = all_to_all_single_autograd(rows.contiguous(), receives, sends, self.group)
        return wait_tensor(moved)

    def _exchange(self, values: torch.Tensor, receives: list[int], sends: list[int]
                  ) -> torch.Tensor:
        out = values.new_empty(sum(receives))
        dist.all_to_all_single(out, values.contiguous(), receives, sends, group=self.group)
        return out

    @contextmanager
    def _local_weights(self) -> Iterator[None]:
        """The experts module's parameters as this member's local rows for one call (their
        gradients flow back into the DTensors)."""
        params = dict(self.experts._parameters)
        try:
            for name, param in params.items():
                if isinstance(param, DTensor):
                    self.experts._parameters[name] = param.to_local()
            yield
        finally:
            self.experts._parameters.update(params)
