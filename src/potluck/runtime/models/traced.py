"""Pipeline stages of models potluck has no family adapter for, by tracing.

Any ``nn.Module`` that maps token ids ``[b, s]`` to logits (a tensor, a tuple
starting with them, or an object with ``.logits``) and keeps its blocks in
one ``nn.ModuleList`` is cut by ``torch.distributed.pipelining.pipeline``
(torch.export) before the first block of each virtual stage of the plan.

Tracing runs on the meta device: real parameters and buffers are set aside,
the model is traced on meta tensors, and the real ones are put back into the
stage modules by name (meta parameters are initialized later, as usual).
Stage modules keep the model's parameter names. A second trace, cut before
the first and after the last block, tells which other parameters belong with
the embedding (used before the blocks) and which with the head (after them).
Tensor parallelism needs a family adapter and is refused for traced models.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import SplitPoint, pipeline

from potluck.errors import ConfigError
from potluck.placement import EMBED, HEAD, block_unit
from potluck.runtime.layout import Layout


def find_blocks(model: nn.Module, num_layers: int) -> str:
    """The path of the ``nn.ModuleList`` that holds the model's ``num_layers`` blocks."""
    candidates = [
        (sum(p.numel() for p in module.parameters()), name)
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and len(module) == num_layers and name
    ]
    if not candidates:
        raise ConfigError(
            f"{type(model).__name__} has no nn.ModuleList of {num_layers} blocks (the plan's "
            "layer count); keep the blocks in one ModuleList or plan for the right model"
        )
    return max(candidates)[1]


def virtual_stage_ranges(layout: Layout) -> list[tuple[int, int]]:
    """Layer ranges of this rank's pipeline, in virtual-stage order."""
    plan, role = layout.plan, layout.role
    stages = plan.pipelines[role.pipeline].stages
    return [stage.layer_ranges[chunk] for chunk in range(len(role.layer_ranges))
            for stage in stages]


def example_input(layout: Layout) -> torch.Tensor:
    """A meta micro-batch of token ids, shaped as this rank's pipeline feeds them."""
    plan = layout.plan
    micro_batch = plan.pipelines[layout.role.pipeline].micro_batch_size
    return torch.zeros(micro_batch, plan.training.seq_len, dtype=torch.long, device="meta")


def _set_aside(model: nn.Module) -> dict[str, torch.Tensor]:
    """Replace real parameters and buffers by meta ones (tracing needs one device);
    return the real ones by name."""
    saved: dict[str, torch.Tensor] = {}
    for owner_name, owner in model.named_modules(remove_duplicate=False):
        for table in (owner._parameters, owner._buffers):
            for leaf, tensor in table.items():
                if tensor is not None and not tensor.is_meta:
                    saved[f"{owner_name}.{leaf}" if owner_name else leaf] = tensor
                    table[leaf] = _to_meta(tensor)
    return saved


def _to_meta(tensor: torch.Tensor) -> torch.Tensor:
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(tensor.to("meta"), requires_grad=tensor.requires_grad)
    return tensor.to("meta")


def _restore(module: nn.Module, saved: dict[str, torch.Tensor]) -> None:
    for owner_name, owner in module.named_modules(remove_duplicate=False):
        for table in (owner._parameters, owner._buffers):
            for leaf in list(table):
                name = f"{owner_name}.{leaf}" if owner_name else leaf
                if name in saved:
                    table[leaf] = saved[name]


def _split(model: nn.Module, example: torch.Tensor, spec: dict[str, SplitPoint]) -> Any:
    """torch's tracing split, undoing the forward wrappers it leaves on the split modules."""
    saved = {name: model.get_submodule(name).__dict__.get("forward") for name in spec}
    try:
        return pipeline(model, mb_args=(example,), split_spec=spec)
    finally:
        for name, forward in saved.items():
            module = model.get_submodule(name)
            module.__dict__.pop("_orig_forward", None)
            if forward is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = forward


def _units(model: nn.Module, blocks_path: str, example: torch.Tensor) -> dict[str, str]:
    last = len(model.get_submodule(blocks_path)) - 1
    pipe = _split(model, example, {
        f"{blocks_path}.0": SplitPoint.BEGINNING, f"{blocks_path}.{last}": SplitPoint.END})
    units = {name: EMBED for name, _ in pipe.get_stage_module(0).named_parameters()}
    units.update({name: HEAD for name, _ in pipe.get_stage_module(2).named_parameters()})
    prefix = f"{blocks_path}."
    for name, _ in model.named_parameters():
        if name.startswith(prefix):
            units[name] = block_unit(int(name[len(prefix):].split(".", 1)[0]))
    return units


def trace_stages(model: nn.Module, layout: Layout,
                 blocks_path: str) -> tuple[list[nn.Module], dict[str, str]]:
    """This rank's virtual stages of ``model``, cut at the plan's layer bounds, and the
    gradient-sync unit of every parameter name."""
    role = layout.role
    example = example_input(layout)
    saved = _set_aside(model)
    try:
        units = _units(model, blocks_path, example)
        if role.num_virtual_stages == 1:
            stages = [model]
        else:
            ranges = virtual_stage_ranges(layout)
            spec = {f"{blocks_path}.{start}": SplitPoint.BEGINNING for start, _ in ranges[1:]}
            pipe = _split(model, example, spec)
            stages = [pipe.get_stage_module(index) for index in role.virtual_stage_ids]
    finally:
        _restore(model, saved)
    for stage in stages:
        _restore(stage, saved)
    return stages, units
