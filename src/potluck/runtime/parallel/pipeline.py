"""Pipeline parallelism: cut a model into the plan's stages and run torch's schedules.

A :class:`StageModule` holds one virtual stage: the embedding (first stage),
the blocks of its layer range, the final norm and head (last stage). It
mounts those submodules under the model's own attribute paths, so its
parameter names are the model's (``model.layers.5.mlp.up_proj.weight``) and
state dicts reshard across plans. Its ``forward`` is the model family's own
sequence of calls (:mod:`potluck.runtime.models.adapters`).

Schedules are torch's, exactly the plan's (each schedule module of
:mod:`potluck.schedules` names its torch class, and the plan checks refuse
what that class cannot run), with ``scale_grads=False``: the loss is already a
token-weighted share of the global batch's mean. A pipeline of one stage uses
:class:`LocalSchedule`, a plain micro-batch loop with the same interface.
Uneven stages are just different layer ranges; each pipeline lane (ranks with
the same TP index) gets its own process group. A stage the plan runs with the
explicit TP executor (:func:`potluck.plans.explicit_tp`) hands its blocks to a
:class:`~potluck.runtime.parallel.tp_overlap.TPExecutor`; its interface (sequence
shards in and out) is the same.

**Split P2P channels** (``plan.comm.split_p2p_channels``): each stage sends and
receives gradients on the lane's second process group
(:attr:`~potluck.runtime.layout.Layout.lane_group_backward`), activations on the
lane group, and the schedule is the one whose every transfer is a batch of its
own (:meth:`~potluck.schedules.base.PipelineSchedule.torch_schedule_split`):
sends posted as soon as their data exists and waited at the end of the step,
receives waited right before the compute that needs them.

**Pipelines whose stages span vendors** (HETHUB-style; NVIDIA, AMD or CPU stages, each
of one vendor: :func:`~potluck.plans.vendors.vendors_problem`): no backend joins the
vendors, so the lanes stay on the gloo world and every transfer is staged through host
memory: the PipelineStages are built with device ``cpu`` (host receive buffers) and each
stage module is a :class:`HostStaged` (inputs to the rank's device on entry, outputs to the
host on exit; autograd brings the gradients back the same way).

torch's schedules assume virtual stage ``v`` runs at group rank ``v % pp`` of
the lane's group, and a group numbers its members in ascending global rank;
torchrun numbers ranks machine by machine, so a lane such as ranks
``(0, 2, 3, 1)`` (a pipeline that wraps around to its first machine) breaks
that. :func:`build_schedule` therefore gives every stage the real group rank of
each stage's rank, and a multi-stage schedule the rank's position in the
pipeline, whose op list it then runs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleMulti
from torch.utils._pytree import tree_map_only
from torch.utils.checkpoint import checkpoint

from potluck.ops import OpKind
from potluck.plans import explicit_tp
from potluck.runtime.layout import Layout
from potluck.runtime.memory.ledger import MemoryLedger
from potluck.runtime.memory.swap import ActivationSwap
from potluck.runtime.models.adapters import Family, get_path
from potluck.runtime.parallel.mixed_tp import (
    BACKWARD,
    FORWARD,
    INFER_BACKWARD,
    INFER_FORWARD,
    Commands,
    FollowerSchedule,
    TPGroup,
    from_leader,
    to_leader,
)
from potluck.runtime.parallel.tp_overlap import TPExecutor
from potluck.runtime.timing.clock import Clock, NullClock
from potluck.schedules import schedule_for

log = logging.getLogger(__name__)
HOST = torch.device("cpu")  # where a pipeline that spans vendors passes its tensors
WHOLE_RANK = -2  # emulation clock: all of this rank's virtual stages at once
LossFn = Callable[[Any, torch.Tensor], torch.Tensor]
WeightPass = Callable[[nn.Module], AbstractContextManager[None]]


def _mount(root: nn.Module, path: str, module: nn.Module) -> None:
    """Attach ``module`` at ``path`` under ``root``, making plain containers on the way."""
    *parents, leaf = path.split(".")
    node = root
    for part in parents:
        if not hasattr(node, part):
            node.add_module(part, nn.Module())
        node = getattr(node, part)
    node.add_module(leaf, module)


class StageModule(nn.Module):
    """One virtual stage of a model, with the model's parameter names."""

    def __init__(self, model: nn.Module, family: Family, layers: tuple[int, int], *,
                 first: bool, last: bool, seq_shards: int = 1,
                 boundary: TPGroup | None = None) -> None:
        super().__init__()
        self.family = family
        self.first, self.last = first, last
        self.seq_shards = seq_shards
        self.boundary = boundary  # set in mixed-TP pipelines: full activations at the edges
        self.full_recompute: frozenset[str] = frozenset()  # blocks checkpointed whole
        self.swapped: frozenset[str] = frozenset()  # blocks whose saved tensors swap
        self.swap: ActivationSwap | None = None
        self.ledger: MemoryLedger | None = None
        self.explicit: TPExecutor | None = None  # runs the blocks with explicit TP
        self.config = getattr(model, "config", None)
        paths = [*(family.embed_paths if first else ()), *family.shared_paths,
                 *(family.head_paths if last else ())]
        for path in paths:
            _mount(self, path, get_path(model, path))
        blocks = get_path(model, family.blocks_path)
        kept = nn.ModuleDict({str(i): blocks[i] for i in range(*layers)})
        _mount(self, family.blocks_path, kept)

    @property
    def blocks(self) -> nn.ModuleDict:
        return get_path(self, self.family.blocks_path)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swap is None or not self.swapped or not torch.is_grad_enabled():
            return self._track(self._forward(x, None))
        with self.swap.micro_batch() as batch:
            output = self._forward(x, self.swap)
        self.swap.arm(output, batch)
        return self._track(output)

    def _forward(self, x: torch.Tensor, swap: ActivationSwap | None) -> torch.Tensor:
        family = self.family
        if self.first:
            hidden, seq_len = family.embed(self, x), x.shape[1]
        else:
            if self.boundary is not None:
                x = from_leader(x, self.boundary)
            hidden, seq_len = x, x.shape[1] * self.seq_shards
        if self.explicit is not None:
            hidden = self.explicit.run(self, hidden, seq_len)
        else:
            hidden = self._blocks(hidden, seq_len, swap)
        if self.last:
            return family.head(self, hidden)
        return hidden if self.boundary is None else to_leader(hidden, self.boundary)

    def _blocks(self, hidden: torch.Tensor, seq_len: int, swap: ActivationSwap | None
                ) -> torch.Tensor:
        context = self.family.context(self, hidden, seq_len)
        for name, block in self.blocks.items():
            with swap.block() if swap is not None and name in self.swapped else nullcontext():
                hidden = self._block(name, block, hidden, context)
        return hidden

    def _block(self, name: str, block: nn.Module, hidden: torch.Tensor, context: Any) -> Any:
        if name not in self.full_recompute:
            return self.family.block(block, hidden, context)
        return checkpoint(counted_recomputation(self.family.block, self.ledger), block, hidden,
                          context, use_reentrant=False)

    def _track(self, output: Any) -> Any:
        """The stage's output stays alive until its backward (torch's schedule keeps it)."""
        if self.ledger is not None and isinstance(output, torch.Tensor) and output.requires_grad:
            self.ledger.track(output)
        return output


def counted_recomputation(forward: Callable[..., Any],
                          ledger: MemoryLedger | None) -> Callable[..., Any]:
    """``forward`` for torch's checkpoint: when it runs again in the backward pass, the
    ledger counts what the recomputation saves."""
    if ledger is None:
        return forward

    def run(*args: Any, **kwargs: Any) -> Any:
        if torch._C._current_graph_task_id() == -1:
            return forward(*args, **kwargs)
        with ledger.recomputing():
            return forward(*args, **kwargs)

    return run


def stage_tp_group(layout: Layout, device: torch.device) -> TPGroup | None:
    """This rank's stage as a leader/followers group, in a mixed-TP pipeline (else None)."""
    role = layout.role
    if role.tp == 1 or not layout.mixed_tp(role.pipeline):
        return None
    return TPGroup(layout.stage_group, layout.rank, device)


def split_stages(model: nn.Module, family: Family, layout: Layout,
                 device: torch.device) -> list[StageModule]:
    """This rank's virtual stages of ``model`` (apply_pp, first half)."""
    role = layout.role
    chunks = len(role.layer_ranges)
    boundary = stage_tp_group(layout, device)
    stages = [
        StageModule(model, family, layers, first=(chunk == 0 and role.holds_embedding),
                    last=(chunk == chunks - 1 and role.holds_head), seq_shards=role.tp,
                    boundary=boundary)
        for chunk, layers in enumerate(role.layer_ranges)
    ]
    if explicit_tp(layout.plan, role.pipeline, role.stage):
        sub_batches = layout.plan.stage_comm(role.pipeline, role.stage).tp_overlap_chunks
        for stage, stage_id in zip(stages, role.virtual_stage_ids, strict=True):
            stage.explicit = TPExecutor(layout.stage_group, sub_batches, stage_id)
    return stages


def set_stage_clock(stages: Sequence[nn.Module], clock: Clock) -> None:
    """Time the explicit TP executors' segments of ``stages`` with ``clock``."""
    for stage in stages:
        executor = getattr(stage, "explicit", None)
        if executor is not None:
            executor.clock = clock


def sub_batch_accumulations(stages: Sequence[nn.Module]) -> dict[str, int]:
    """Parameters accumulated more than once per micro-batch, by name: an explicit TP
    stage's blocks accumulate once per sub-batch."""
    counts = {}
    for stage in stages:
        executor = getattr(stage, "explicit", None)
        if executor is None:
            continue
        prefix = f"{stage.family.blocks_path}."
        counts.update({name: executor.chunks for name, _ in stage.named_parameters()
                       if name.startswith(prefix)})
    return counts


class LocalSchedule:
    """A pipeline of one stage: forward and backward each micro-batch in turn."""

    def __init__(self, module: nn.Module, n_microbatches: int, loss_fn: LossFn,
                 clock: Clock = NullClock(), stage_id: int = 0) -> None:
        self.module = module
        self.n_microbatches = n_microbatches
        self.loss_fn = loss_fn
        self.clock = clock
        self.stage_id = stage_id

    def step(self, *args: torch.Tensor, target: torch.Tensor | None = None,
             losses: list | None = None, return_outputs: bool = False) -> None:
        (inputs,) = args
        for x, y in zip(inputs.tensor_split(self.n_microbatches),
                        target.tensor_split(self.n_microbatches), strict=True):
            loss = self.clock.run(OpKind.FORWARD, self.stage_id,
                                  lambda x=x, y=y: self.loss_fn(self.module(x), y))
            self.clock.run(OpKind.BACKWARD, self.stage_id, loss.backward)
            if losses is not None:
                losses.append(loss.detach())


def _chunk_id(args: tuple, kwargs: dict, name: str) -> int:
    return int(args[0]) if args else int(kwargs[name])


class HookedStage(PipelineStage):
    """A PipelineStage that announces each op to its followers (mixed-TP pipelines), times it
    with a clock (emulation, tracing) and sends gradients on a channel of their own (split P2P
    channels); all optional."""

    clock: Clock = NullClock()
    commands: Commands | None = None
    weight_pass: WeightPass | None = None  # the gradient sync's wrapper of zero-bubble W passes
    backward_group: dist.ProcessGroup | None = None  # gradients' group (None: the stage's group)

    def _run(self, kind: OpKind, fn: Callable[[], Any]) -> Any:
        return self.clock.run(kind, self.stage_index, fn)

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        if self.commands is not None:
            chunk = _chunk_id(args, kwargs, "fwd_chunk_id")
            self.commands.announce(FORWARD, self.stage_index, chunk)
        run = super().forward_one_chunk
        return self._run(OpKind.FORWARD, lambda: run(*args, **kwargs))

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        if self.commands is not None:
            chunk = _chunk_id(args, kwargs, "bwd_chunk_id")
            self.commands.announce(BACKWARD, self.stage_index, chunk)
        run = super().backward_one_chunk
        kind = OpKind.BACKWARD if kwargs.get("full_backward", True) else OpKind.BACKWARD_INPUT
        return self._run(kind, lambda: run(*args, **kwargs))

    def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        run = super().backward_weight_one_chunk
        with self.weight_pass(self.submod) if self.weight_pass else nullcontext():
            return self._run(OpKind.BACKWARD_WEIGHT, lambda: run(*args, **kwargs))

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list:
        return self._tag(super().get_fwd_recv_ops(fwd_chunk_id), OpKind.RECV_FORWARD, fwd_chunk_id)

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list:
        return self._tag(super().get_fwd_send_ops(fwd_chunk_id), OpKind.SEND_FORWARD, fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list:
        ops = self._on_backward_group(super().get_bwd_recv_ops(bwd_chunk_id))
        return self._tag(ops, OpKind.RECV_BACKWARD, bwd_chunk_id)

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list:
        ops = self._on_backward_group(super().get_bwd_send_ops(bwd_chunk_id))
        return self._tag(ops, OpKind.SEND_BACKWARD, bwd_chunk_id)

    def _on_backward_group(self, ops: list) -> list:
        """The same transfers on the gradients' group (same ranks, so the same global peer)."""
        group = self.backward_group
        if group is None or group is self.group:
            return ops
        return [dist.P2POp(op.op, op.tensor, op.peer, group, op.tag) for op in ops]

    def _tag(self, ops: list, kind: OpKind, micro_batch: int) -> list:
        """Name the ops for a tracing clock (:mod:`potluck.runtime.timing.recorder`)."""
        return self.clock.tag_p2p(ops, kind, self.stage_index, micro_batch)

    def _compute_outputs(self, *args: Any, module: nn.Module, **kwargs: Any) -> Any:
        """Shape inference's forward (first step): followers run it too."""
        if self.commands is not None:
            self.commands.announce(INFER_FORWARD, self.stage_index, 0)
        return super()._compute_outputs(*args, module=module, **kwargs)

    def _compute_input_grads(self, *args: Any, **kwargs: Any) -> Any:
        """Shape inference's input-gradient pass: followers run it too."""
        if self.commands is not None:
            self.commands.announce(INFER_BACKWARD, self.stage_index, 0)
        return super()._compute_input_grads(*args, **kwargs)


class AnnouncingSchedule:
    """A leader's torch schedule that tells its followers when a step is over."""

    def __init__(self, schedule: Any, commands: Commands) -> None:
        self.schedule = schedule
        self.commands = commands

    def step(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.schedule.step(*args, **kwargs)
        finally:
            self.commands.done()


def build_schedule(modules: Sequence[nn.Module], layout: Layout, loss_fn: LossFn,
                   device: torch.device, clock: Clock = NullClock(),
                   weight_pass: WeightPass | None = None) -> Any:
    """The plan's schedule over this rank's stage modules (apply_pp, second half);
    ``weight_pass`` wraps zero bubble's separate weight-gradient passes."""
    role, plan = layout.role, layout.plan
    n_microbatches = plan.pipelines[role.pipeline].num_micro_batches
    if role.pp == 1:  # the chunks of a one-stage pipeline simply run in order
        if len(modules) == 1:
            return LocalSchedule(modules[0], n_microbatches, loss_fn, clock)
        return LocalSchedule(nn.Sequential(*modules), n_microbatches, loss_fn, clock, WHOLE_RANK)
    tp_group = stage_tp_group(layout, device)
    commands = Commands(tp_group) if tp_group is not None else None
    if layout.is_follower:
        by_stage = dict(zip(role.virtual_stage_ids, modules, strict=True))
        return FollowerSchedule(by_stage, commands, n_microbatches, loss_fn, clock)
    stages = _torch_stages(modules, layout, device, clock, commands, weight_pass)
    # the layout's check_plan has refused what this schedule's torch class cannot run
    schedule = schedule_for(plan.schedule)
    split = plan.comm.split_p2p_channels
    build = schedule.torch_schedule_split if split else schedule.torch_schedule
    runner = build(stages, n_microbatches, loss_fn)
    seat_stages(runner, stages, lane_group_ranks(layout), role.stage)
    return runner if commands is None else AnnouncingSchedule(runner, commands)


def _torch_stages(modules: Sequence[nn.Module], layout: Layout, device: torch.device,
                  clock: Clock, commands: Commands | None,
                  weight_pass: WeightPass | None) -> list[PipelineStage]:
    """This rank's virtual stages as torch's PipelineStages on its lane (gradients on the
    lane's backward group: a second one when the plan splits P2P channels). On a lane that
    passes host tensors, each is built with device ``cpu``, so that its receive buffers
    (activations, gradients, the warm-up's votes and metadata) are host tensors, and its
    module is :func:`host_staged`; torch 2.13's ``PipelineStage`` leaves the module where it
    is (only the traced ``_PipelineStage`` moves it to the stage's device)."""
    role = layout.role
    hooked = (not isinstance(clock, NullClock) or commands is not None
              or weight_pass is not None or layout.plan.comm.split_p2p_channels)
    kind = HookedStage if hooked else PipelineStage
    stages = []
    for module, stage_id in zip(modules, role.virtual_stage_ids, strict=True):
        stage = kind(host_staged(unmanaged(module), layout, stage_id, device), stage_id,
                     role.num_virtual_stages, HOST if layout.lane_on_host else device,
                     group=layout.lane_group)
        stage.clock, stage.commands, stage.weight_pass = clock, commands, weight_pass
        stage.backward_group = layout.lane_group_backward
        stages.append(stage)
    return stages


def host_staged(module: nn.Module, layout: Layout, stage_id: int,
                device: torch.device) -> nn.Module:
    """``module`` as the stage of a pipeline that spans vendors sees it (its lane passes host
    tensors over gloo, :attr:`~potluck.runtime.layout.Layout.lane_on_host`): a
    :class:`HostStaged` around it, whose output stays on ``device`` at the pipeline's last
    virtual stage (the loss is computed there); anything else as it is."""
    if not layout.lane_on_host:
        return module
    return HostStaged(module, device, last=stage_id == layout.role.num_virtual_stages - 1)


class HostStaged(nn.Module):
    """A stage module whose inputs arrive in host memory and whose outputs leave in it: its
    inputs are copied to the rank's device on entry, its outputs to host memory on exit
    (unless ``last``). Autograd carries the gradients back across both copies, so the
    backward pass receives and sends host tensors too. On a CPU rank both copies are no-ops."""

    def __init__(self, stage: nn.Module, device: torch.device, last: bool) -> None:
        super().__init__()
        self.stage = stage
        self.device = device
        self.last = last

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        move = tree_map_only(torch.Tensor, lambda t: t.to(self.device), (args, kwargs))
        output = self.stage(*move[0], **move[1])
        return output if self.last else tree_map_only(torch.Tensor, lambda t: t.to(HOST), output)


def unmanaged(module: nn.Module) -> nn.Module:
    """``module`` as torch's pipeline stage should see it: a ZeRO-3 stage (an FSDP module)
    behind a plain parent, since torch would otherwise switch its gradient reduction off
    for every micro-batch and reduce full-size gradients once after the last
    (``PipelineStage.backward_maybe_with_nosync``, ``perform_reduce_grad``); anything else
    as it is."""
    return _Unmanaged(module) if isinstance(module, FSDPModule) else module


class _Unmanaged(nn.Module):
    """A plain parent of an FSDP stage module; forwards to it."""

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.stage(*args, **kwargs)


def lane_group_ranks(layout: Layout) -> dict[int, int]:
    """For each virtual stage of this rank's pipeline, the group rank (in this rank's lane
    group) of the rank that runs it."""
    role = layout.role
    lane = layout.lane_ranks(role.pipeline, role.tp_rank)
    members = dist.get_process_group_ranks(layout.lane_group)
    return {v: members.index(lane[v % role.pp]) for v in range(role.num_virtual_stages)}


def seat_stages(runner: Any, stages: Sequence[PipelineStage], group_ranks: dict[int, int],
                pipeline_rank: int) -> None:
    """Override what torch's schedule assumed at construction (stage ``v`` at group rank
    ``v % pp``): each stage sends to and receives from ``group_ranks``' peers, and a
    multi-stage schedule runs the op list of position ``pipeline_rank`` in the pipeline
    (its op lists are by position; its own stage-to-position map stays)."""
    for stage in stages:
        stage.stage_index_to_group_rank = dict(group_ranks)
    if isinstance(runner, PipelineScheduleMulti):
        runner.rank = pipeline_rank
