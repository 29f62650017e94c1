"""ZeRO-3: parameters sharded too, with torch's own FSDP2 (``fully_shard``), per stage.

Under ``plan.zero == 3`` each block of a stage, and its embedding and head
modules, is ``fully_shard``-ed over the stage's **data-parallel mesh**: the
ranks that hold the same layers (at the same TP index) in every pipeline,
which is the aligned gradient sync group of the stage's units
(:meth:`potluck.runtime.layout.Layout.sync_group`). At rest a rank keeps
``1/d`` of the weights, gradients and optimizer states (the optimizer sees
FSDP2's sharded DTensor parameters); each micro-batch's forward and backward
all-gather a block's weights and reshard them after use (the last ones once
the backward is done, in a pipeline of one stage: below), and its backward
reduce-scatters the block's gradients, which FSDP2 adds into the sharded
``.grad`` (``set_gradient_divide_factor(1.0)``: the loss is already each
replica's share of the global mean, so replicas' gradients are summed).

Each stage module is ``fully_shard``-ed last, over the same mesh, as the one FSDP
root of its blocks (torch makes every FSDP module that runs forward outside an FSDP
parent a root, ``_fsdp_state.py`` ``_lazy_init``; a root is not resharded after forward
unless told, and each root's pre-forward makes the all-gather stream wait for the
compute stream, so per-block roots would hold every block's weights unsharded from
forward to backward and expose every gather). Parameters are gathered in the rank's
16-bit compute dtype and gradients reduced in FP32 (or the plan's 16-bit wire dtype),
FSDP2's :class:`MixedPrecisionPolicy`, as torchtitan runs it; autocast's weight-cast
cache is off there (:func:`~potluck.runtime.parallel_model.ParallelModel`), since FSDP2
reuses one unsharded parameter object across reshards.

Every FSDP module reshards after forward (``reshard_after_forward``, explicit), but for
the units a micro-batch's backward starts with when it follows that forward at once: in
a pipeline of one stage (whose schedule runs each micro-batch's forward, loss and
backward in turn), the head (final norm and output layer) and the last block of the
rank's last chunk stay gathered until their backward, which would gather them again
straight away (:func:`gathered_after_forward`; torchtitan's ``apply_fsdp`` keeps its
norm and output, and without pipelining its last block, gathered the same way). Under
pipeline parallelism every unit reshards: other micro-batches' forwards come between a
forward and its backward (1F1B's warm-up, GPipe, interleaving). The peak does not move:
the backward's first step holds the same two units (the head it runs, the last block it
prefetches), and the loss computed in between holds no other weights.

torch's pipeline stage switches gradient sync off for every micro-batch of an FSDP
module it is given (``PipelineStage.backward_maybe_with_nosync``) and reduces once
after the last, holding full-size gradients meanwhile; potluck hands it the stage
behind a plain wrapper
(:func:`potluck.runtime.parallel.pipeline.unmanaged`), so every micro-batch's backward
reduce-scatters and no full-size gradient accumulates, as the memory contract wants.
These parameters leave potluck's own
:class:`~potluck.runtime.grads.data_parallel.GradSync`, which counts their
local shards in the norm. A tied embedding/head stays out of FSDP
(``ignored_params``) and is synced as under ZeRO-2.

FSDP2 assumes every member of the mesh runs the same modules the same number of
times, so a plan whose replicas hold a stage's layers differently (other
splits or TP degrees), or run different numbers of micro-batches, is refused
in one line (:func:`check_zero3`, whose rule :func:`potluck.plans.zero3_problem`
the plan checks and the search share), as is zero bubble's split backward (its
weight pass writes ``.grad`` outside the autograd hooks FSDP2 reduces in).
Tensor parallelism composes as torchtitan's 2-D parallelism: the TP mesh is a slice of a ``(dp, tp)`` mesh
(:meth:`~potluck.runtime.layout.Layout.tp_mesh`) and FSDP2 shards the TP
DTensors further over the ``dp`` dimension.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from potluck.errors import ConfigError
from potluck.placement import TIED
from potluck.plans import Plan, shards_parameters, zero3_problem
from potluck.runtime.layout import Layout
from potluck.runtime.models.adapters import Family, get_path, has_path


def check_zero3(plan: Plan) -> None:
    """Refuse ZeRO-3 for a plan FSDP2 cannot run (the rule: :func:`potluck.plans.zero3_problem`,
    which the plan checks and the search call too)."""
    problem = zero3_problem(plan)
    if problem:
        raise ConfigError(problem)


def dp_ranks(layout: Layout) -> tuple[int, ...]:
    """The ranks holding this rank's layers at its TP index, one per pipeline."""
    role = layout.role
    return tuple(layout.stage_ranks(p, role.stage)[role.tp_rank]
                 for p in range(layout.plan.dp))


def dp_mesh(layout: Layout, device_type: str) -> DeviceMesh:
    """The stage's data-parallel mesh (1-D, or the ``dp`` slice of the 2-D TP mesh)."""
    if layout.role.tp > 1:
        return layout.tp_mesh(device_type)._get_root_mesh()["dp"]
    ranks = dp_ranks(layout)
    return DeviceMesh.from_group(layout.sync_process_group(ranks), device_type)


def apply_zero3(stages: list[nn.Module], layout: Layout, device: torch.device,
                family: Family | None, units: dict[str, str],
                precision: ShardPrecision) -> None:
    """Shard every block, embedding and head module of ``stages``, then each stage as
    their root (ZeRO-3 plans only; ``units``: each parameter name's unit, the tied
    weight's left out)."""
    plan = layout.plan
    check_zero3(plan)
    if not shards_parameters(plan):
        return
    if family is None:
        raise ConfigError("zero 3 runs models of a known family (LLaMA, Qwen, Mistral, GPT-2); "
                          "use --zero 2 for this model")
    mesh = dp_mesh(layout, device.type)
    ignored = {param for stage in stages for name, param in stage.named_parameters()
               if units[name] == TIED}
    policy = precision.policy()
    kept = gathered_after_forward(stages, family, layout.role.pp)
    for stage in stages:
        for unit in _units(stage, family):
            if any(p not in ignored for module in unit for p in module.parameters()):
                fully_shard(unit, mesh=mesh, mp_policy=policy, ignored_params=ignored,
                            reshard_after_forward=not any(id(m) in kept for m in unit))
        fully_shard(stage, mesh=mesh, mp_policy=policy, ignored_params=ignored,
                    reshard_after_forward=True)
        for module in stage.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM


@dataclass(frozen=True)
class ShardPrecision:
    """The dtypes FSDP2 gathers parameters in and reduces gradients in: ``param_dtype``
    the rank's 16-bit compute dtype (None: FP32 throughout, as on CPU ranks);
    ``reduce_dtype`` the plan's 16-bit wire dtype, else FP32."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None

    def policy(self) -> MixedPrecisionPolicy:
        reduce = self.reduce_dtype
        if reduce is None and self.param_dtype is not None:
            reduce = torch.float32  # never reduce 16-bit gradients in 16 bits unasked
        return MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=reduce)


def _units(stage: nn.Module, family: Family) -> list[list[nn.Module]]:
    """The stage's FSDP units, each gathered as one: its embeddings together (GPT-2's token
    and position tables), each block, and its head's modules together (final norm and
    output layer, as torchtitan groups them): fewer, larger collectives."""
    units = [[get_path(stage, path) for path in paths if has_path(stage, path)]
             for paths in (family.embed_paths, family.head_paths)]
    return [*(unit for unit in units if unit), *([block] for block in stage.blocks.values())]


def gathered_after_forward(stages: list[nn.Module], family: Family, pp: int) -> set[int]:
    """``id`` of the modules whose FSDP units stay gathered from a micro-batch's forward to
    its backward (the module docstring): with ``pp == 1``, whose schedule
    (:class:`~potluck.runtime.parallel.pipeline.LocalSchedule`) runs each micro-batch's
    backward right after its forward and loss, the head and the last block of the rank's
    last chunk; none under ``pp > 1``, nor of an earlier chunk, whose forward the next
    chunks' forwards follow."""
    if pp > 1:
        return set()
    last = stages[-1]
    head = [get_path(last, path) for path in family.head_paths if has_path(last, path)]
    return {id(module) for module in (*head, *list(last.blocks.values())[-1:])}


def managed_parameters(stages: list[nn.Module]) -> set[int]:
    """``id`` of every parameter an FSDP2 module of ``stages`` shards (the stage modules:
    a merged tree of several stages copies the containers, FSDP2's blocks among them)."""
    managed: set[int] = set()
    for sub in (module for stage in stages for module in stage.modules()):
        if isinstance(sub, FSDPModule):
            for group in fully_shard.state(sub)._fsdp_param_groups:
                managed |= {id(p.sharded_param) for p in group.fsdp_params}
    return managed
