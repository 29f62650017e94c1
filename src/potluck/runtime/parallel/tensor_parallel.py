"""Tensor parallelism with DTensor: ``apply_tp`` per model family.

Megatron-style sharding with sequence parallelism (Korthikanti et al. 2022),
expressed with torch's parallel styles, as torchtitan does:

- between blocks, hidden states are sequence shards ``[b, s/t, h]``; norms run
  on the shards (``SequenceParallel``);
- attention and MLP all-gather their input, run column-wise (QKV, gate/up,
  fc) and row-wise (output projections) sharded matmuls, and reduce-scatter
  back to sequence shards;
- the embedding is vocabulary-parallel (row-wise), the head column-wise with
  logits left sharded over the vocabulary for ``loss_parallel``.

GPT-2's ``Conv1D`` (a transposed Linear, QKV fused in one matrix) gets two
small styles here: the fused QKV weight is a ``_StridedShard`` so each rank
holds the q, k and v columns of its own heads and ``full_tensor()`` is still
the original matrix.

A stage that runs the explicit TP executor (:func:`potluck.plans.explicit_tp`,
:mod:`potluck.runtime.parallel.tp_overlap`) gets the same placements through
*local* styles instead: no hooks, no DTensor communication; column-wise layers
compute their output shard from a replicated local input, row-wise ones their
partial product plus ``bias / tp`` (:class:`BiasShare`: its gradient is the full
one), norms run on replicated DTensors (no communication either). The executor
adds the partial sums itself. Checkpoints, gradient buckets and export see the
same DTensor parameters either way.

Parameters are distributed without communication (``src_data_rank=None``):
every rank of a TP group builds the same full values (meta or deterministic).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard

from potluck.errors import ConfigError
from potluck.model.derived import expert_count
from potluck.model.sharding import block_tp_plan, heads_problem, tp_refusal
from potluck.runtime.models.adapters import Family, get_path, is_tied


def _distribute(module: nn.Module, name: str, mesh: DeviceMesh, placement: Placement) -> None:
    param = getattr(module, name)
    dtensor = distribute_tensor(param.data, mesh, [placement], src_data_rank=None)
    module.register_parameter(name, nn.Parameter(dtensor, requires_grad=param.requires_grad))


def _local_input(x: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor input as a local tensor whose gradient is partial (each rank
    contributes the part that flows through its own output columns)."""
    if isinstance(x, DTensor):
        return x.to_local(grad_placements=[Partial()])
    return x


class Conv1DColwise(ParallelStyle):
    """Output features of a GPT-2 ``Conv1D`` split over ranks; input replicated, output local.

    ``split_factor`` > 1 treats the output as that many concatenated matrices
    (QKV) and gives each rank its slice of every one of them.
    """

    def __init__(self, split_factor: int = 1) -> None:
        super().__init__()
        self.split_factor = split_factor

    def _placement(self, dim: int) -> Placement:
        if self.split_factor == 1:
            return Shard(dim)
        return _StridedShard(dim, split_factor=self.split_factor)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _distribute(module, "weight", device_mesh, self._placement(1))
        _distribute(module, "bias", device_mesh, self._placement(0))

        def forward(x: torch.Tensor) -> torch.Tensor:
            x = _local_input(x)
            weight, bias = module.weight.to_local(), module.bias.to_local()
            out = torch.addmm(bias, x.reshape(-1, x.shape[-1]), weight)
            return out.view(*x.shape[:-1], weight.shape[1])

        module.forward = forward
        return module


class Conv1DRowwise(ParallelStyle):
    """Input features of a GPT-2 ``Conv1D`` split over ranks; output reduce-scattered
    to sequence shards, the (replicated) bias added after the reduction."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _distribute(module, "weight", device_mesh, Shard(0))
        _distribute(module, "bias", device_mesh, Replicate())

        def forward(x: torch.Tensor) -> torch.Tensor:
            weight = module.weight.to_local()
            partial = (x.reshape(-1, x.shape[-1]) @ weight).view(*x.shape[:-1], weight.shape[1])
            out = DTensor.from_local(partial, device_mesh, [Partial()], run_check=False)
            out = out.redistribute(device_mesh, [Shard(1)])
            return (out + module.bias).to_local()

        module.forward = forward
        return module


class BiasShare(torch.autograd.Function):
    """A replicated bias added to each rank's partial sum: ``bias / tp`` forward (the
    partial sums add up to one bias), the full gradient backward (every rank's bias
    gradient is the full one, as under DTensor's row-wise style)."""

    @staticmethod
    def forward(ctx: Any, bias: torch.Tensor, tp: int) -> torch.Tensor:
        return bias / tp

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _shared_bias(module: nn.Module, tp: int) -> torch.Tensor | None:
    bias = module.bias
    return None if bias is None else BiasShare.apply(bias.to_local(), tp)


class LocalColwise(ParallelStyle):
    """A Linear's output features split over ranks (``ColwiseParallel``'s placements),
    computed locally: a replicated local input in, the local output shard out."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _distribute(module, "weight", device_mesh, Shard(0))
        if module.bias is not None:
            _distribute(module, "bias", device_mesh, Shard(0))

        def forward(x: torch.Tensor) -> torch.Tensor:
            bias = None if module.bias is None else module.bias.to_local()
            return F.linear(x, module.weight.to_local(), bias)

        module.forward = forward
        return module


class LocalRowwise(ParallelStyle):
    """A Linear (or, ``conv1d``, a GPT-2 ``Conv1D``) whose input features are split over
    ranks (``RowwiseParallel``'s placements), computed locally: this rank's partial sum
    of the output, the replicated bias shared out (:class:`BiasShare`)."""

    def __init__(self, conv1d: bool = False) -> None:
        super().__init__()
        self.conv1d = conv1d

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _distribute(module, "weight", device_mesh, Shard(0 if self.conv1d else 1))
        if module.bias is not None:
            _distribute(module, "bias", device_mesh, Replicate())
        tp = device_mesh.size()

        def forward(x: torch.Tensor) -> torch.Tensor:
            weight = module.weight.to_local()
            out = x @ weight if self.conv1d else F.linear(x, weight)
            bias = _shared_bias(module, tp)
            return out if bias is None else out + bias

        module.forward = forward
        return module


class LocalReplicate(ParallelStyle):
    """A norm with replicated parameters (``SequenceParallel``'s placements) run on a
    replicated local input: the module's own forward on Replicate DTensors, which
    communicates nothing, its output back as a local tensor."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, _ in list(module.named_parameters(recurse=False)):
            _distribute(module, name, device_mesh, Replicate())
        own_forward = module.forward

        def forward(x: torch.Tensor) -> torch.Tensor:
            replicated = DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
            return own_forward(replicated).to_local()

        module.forward = forward
        return module


def _head_styles(family: Family) -> dict[str, ParallelStyle]:
    norm, head = family.head_paths
    return {
        norm: SequenceParallel(),
        head: ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                              use_local_output=False),
    }


class GatherSequence(ParallelStyle):
    """A module's hidden states (its first positional argument, else its ``hidden_states``
    keyword) from sequence shards to a replicated DTensor: an all-gather forward, a
    reduce-scatter of the partial gradients backward (``PrepareModuleInput``'s layouts for a
    module however it is called)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(x: torch.Tensor) -> DTensor:
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, [Shard(1)], run_check=False)
            return x.redistribute(device_mesh, [Replicate()])

        def hook(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                 ) -> tuple[tuple[Any, ...], dict[str, Any]]:
            if args:
                return (gather(args[0]), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": gather(kwargs["hidden_states"])}

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


def _style(kind: str) -> ParallelStyle:
    """torch's style for an entry of transformers' tensor-parallel plan
    (:data:`potluck.model.sharding.SPLIT_STYLES`): column-wise from replicated input,
    row-wise reduce-scattered to sequence shards, a per-head norm (``[b, s, heads, d]``)
    on its heads' shard with replicated weights whose gradients are summed."""
    if kind == "colwise":
        return ColwiseParallel()
    if kind == "rowwise":
        return RowwiseParallel(output_layouts=Shard(1))
    return SequenceParallel(sequence_dim=2, use_local_output=True)


def _decoder_block_styles(block: nn.Module, tp_plan: dict[str, str]) -> dict[str, ParallelStyle]:
    """Styles for a block from its model's own tensor-parallel plan: the norms on the hidden
    stream (the block's direct children that are norms: pre-, post- and feed-forward norms)
    run on sequence shards, the modules holding split layers gather their input first."""
    styles: dict[str, ParallelStyle] = {
        path: SequenceParallel(use_local_output=True) for path, child in block.named_children()
        if "norm" in type(child).__name__.lower()
    }
    for parent in {path.rsplit(".", 1)[0] for path in tp_plan if "." in path}:
        styles[parent] = GatherSequence()
    styles.update({path: _style(kind) for path, kind in tp_plan.items()})
    return styles


def _gpt2_block_styles() -> dict[str, ParallelStyle]:
    to_full = {"input_layouts": (Shard(1),), "desired_input_layouts": (Replicate(),)}
    return {
        "ln_1": SequenceParallel(),
        "attn": PrepareModuleInput(**to_full),
        "attn.c_attn": Conv1DColwise(split_factor=3),
        "attn.c_proj": Conv1DRowwise(),
        "ln_2": SequenceParallel(),
        "mlp": PrepareModuleInput(**to_full),
        "mlp.c_fc": Conv1DColwise(),
        "mlp.c_proj": Conv1DRowwise(),
    }


def _local_block_styles(family: Family) -> dict[str, ParallelStyle]:
    """The explicit executor's styles: the placements of :func:`_block_styles`, computed
    locally (the executor all-gathers, all-reduces and slices itself)."""
    if family.name == "gpt2":
        return {"ln_1": LocalReplicate(), "attn.c_attn": Conv1DColwise(split_factor=3),
                "attn.c_proj": LocalRowwise(conv1d=True), "ln_2": LocalReplicate(),
                "mlp.c_fc": Conv1DColwise(), "mlp.c_proj": LocalRowwise(conv1d=True)}
    columns = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
               "mlp.up_proj")
    return {"input_layernorm": LocalReplicate(), "post_attention_layernorm": LocalReplicate(),
            **{path: LocalColwise() for path in columns},
            "self_attn.o_proj": LocalRowwise(), "mlp.down_proj": LocalRowwise()}


def _embed_styles(family: Family) -> dict[str, ParallelStyle]:
    if family.name == "gpt2":
        # Positions are added to the full embedding, then each rank keeps its sequence shard.
        return {
            "transformer.wte": RowwiseParallel(input_layouts=Replicate(),
                                               output_layouts=Replicate()),
            "transformer.drop": PrepareModuleOutput(output_layouts=Replicate(),
                                                    desired_output_layouts=Shard(1)),
        }
    (embed,) = family.embed_paths
    return {embed: RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))}


def _block_styles(family: Family, block: nn.Module, config: Any) -> dict[str, ParallelStyle]:
    if family.name == "gpt2":
        return _gpt2_block_styles()
    return _decoder_block_styles(block, block_tp_plan(config.base_model_tp_plan))


def check_tp(model: nn.Module, family: Family | None, tp: int, seq_len: int) -> None:
    """One clear error when this model cannot be split ``tp`` ways."""
    if tp == 1:
        return
    config = getattr(model, "config", None)
    model_type = str(getattr(config, "model_type", ""))
    reason = tp_refusal(model_type, getattr(config, "base_model_tp_plan", None),
                        expert_count(model))
    if family is None or reason:
        name = type(model).__name__
        raise ConfigError(
            f"tensor parallelism is not supported for {name} "
            f"({reason or 'no block adapter'}); use a plan with tp=1 "
            "(pipeline and data parallel work for any model)"
        )
    if seq_len % tp:
        raise ConfigError(f"sequence length {seq_len} is not a multiple of tensor parallel {tp}")
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", 0)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    problem = heads_problem(tp, heads, kv_heads)
    if problem:
        raise ConfigError(f"tensor parallel {tp} {problem}")


def apply_tp(model: nn.Module, family: Family, mesh: DeviceMesh, layers: Iterable[int], *,
             embed: bool, head: bool, explicit: bool = False) -> None:
    """Shard, in place, the blocks ``layers`` (and the embedding / head when this
    rank holds them) of ``model`` over ``mesh``; a tied head stays tied. ``explicit``:
    the blocks compute locally, for the explicit TP executor."""
    tied = embed and head and is_tied(model, family)
    tp = mesh.size()
    blocks = get_path(model, family.blocks_path)
    for index in layers:
        block = blocks[index]
        styles = (_local_block_styles(family) if explicit
                  else _block_styles(family, block, model.config))
        parallelize_module(block, mesh, styles, src_data_rank=None)
        if family.name == "gpt2":
            block.attn.split_size = block.attn.embed_dim // tp
    plan: dict[str, ParallelStyle] = {}
    if embed:
        plan.update(_embed_styles(family))
    if head:
        plan.update(_head_styles(family))
    if plan:
        parallelize_module(model, mesh, plan, src_data_rank=None)
    if tied:
        head_module = get_path(model, family.head_paths[-1])
        head_module.weight = get_path(model, family.embed_paths[0]).weight
