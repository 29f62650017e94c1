"""Pipeline parallelism: cut a model into the plan's stages and run torch's schedules.

A :class:`StageModule` holds one virtual stage: the embedding (first stage),
the blocks of its layer range, the final norm and head (last stage). It
mounts those submodules under the model's own attribute paths, so its
parameter names are the model's (``model.layers.5.mlp.up_proj.weight``) and
state dicts reshard across plans. Its ``forward`` is the model family's own
sequence of calls (:mod:`potluck.runtime.families`).

Schedules are torch's (GPipe, 1F1B, interleaved 1F1B, interleaved zero
bubble), with ``scale_grads=False``: the loss is already a token-weighted
share of the global batch's mean. A pipeline of one stage uses
:class:`LocalSchedule`, a plain micro-batch loop with the same interface.
Uneven stages are just different layer ranges; each pipeline lane (ranks with
the same TP index) gets its own process group.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)
from torch.utils.checkpoint import checkpoint

from potluck.errors import ConfigError
from potluck.model.counts import Recompute
from potluck.plans import Schedule
from potluck.runtime.families import Family, get_path
from potluck.runtime.layout import Layout

log = logging.getLogger(__name__)
LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


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

    def __init__(self, model: nn.Module, family: Family, layers: tuple[int, int],
                 first: bool, last: bool, seq_shards: int = 1) -> None:
        super().__init__()
        self.family = family
        self.first, self.last = first, last
        self.layer_range = layers
        self.seq_shards = seq_shards
        self.recompute = Recompute.NONE
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
        family = self.family
        if self.first:
            hidden, seq_len = family.embed(self, x), x.shape[1]
        else:
            hidden, seq_len = x, x.shape[1] * self.seq_shards
        context = family.context(self, hidden, seq_len)
        for block in self.blocks.values():
            if self.recompute is Recompute.FULL:
                hidden = checkpoint(family.block, block, hidden, context, use_reentrant=False)
            else:
                hidden = family.block(block, hidden, context)
        return family.head(self, hidden) if self.last else hidden


def split_stages(model: nn.Module, family: Family, layout: Layout) -> list[StageModule]:
    """This rank's virtual stages of ``model`` (apply_pp, first half)."""
    role = layout.role
    chunks = len(role.layer_ranges)
    seq_shards = role.tp
    return [
        StageModule(model, family, layers, first=(chunk == 0 and role.holds_embedding),
                    last=(chunk == chunks - 1 and role.holds_head), seq_shards=seq_shards)
        for chunk, layers in enumerate(role.layer_ranges)
    ]


class LocalSchedule:
    """A pipeline of one stage: forward and backward each micro-batch in turn."""

    def __init__(self, module: nn.Module, n_microbatches: int, loss_fn: LossFn,
                 clock: Any = None) -> None:
        self.module = module
        self.n_microbatches = n_microbatches
        self.loss_fn = loss_fn
        self.clock = clock

    def step(self, *args: torch.Tensor, target: torch.Tensor | None = None,
             losses: list | None = None, return_outputs: bool = False) -> None:
        (inputs,) = args
        for x, y in zip(inputs.tensor_split(self.n_microbatches),
                        target.tensor_split(self.n_microbatches), strict=True):
            loss = self._timed("forward", lambda x=x, y=y: self.loss_fn(self.module(x), y))
            self._timed("backward", loss.backward)
            if losses is not None:
                losses.append(loss.detach())

    def _timed(self, kind: str, fn: Callable[[], Any]) -> Any:
        return fn() if self.clock is None else self.clock.run(kind, 0, fn)


class ClockedStage(PipelineStage):
    """A PipelineStage whose compute goes through an emulation clock (timing only)."""

    clock: Any = None

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        run = super().forward_one_chunk
        return self.clock.run("forward", self.stage_index, lambda: run(*args, **kwargs))

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        run = super().backward_one_chunk
        kind = "backward" if kwargs.get("full_backward", True) else "backward_input"
        return self.clock.run(kind, self.stage_index, lambda: run(*args, **kwargs))

    def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        run = super().backward_weight_one_chunk
        return self.clock.run("backward_weight", self.stage_index, lambda: run(*args, **kwargs))


def _schedule_class(schedule: Schedule, virtual_stages: int, n_microbatches: int,
                    pp: int) -> type:
    if schedule is Schedule.ONE_F_ONE_B and virtual_stages == 1 and n_microbatches < pp:
        log.warning("1F1B needs at least as many micro-batches (%d) as stages (%d); this "
                    "pipeline runs GPipe, which computes the same gradients", n_microbatches, pp)
        return ScheduleGPipe
    if schedule is Schedule.INTERLEAVED:
        return ScheduleInterleaved1F1B
    if schedule is Schedule.ZERO_BUBBLE:
        return ScheduleInterleavedZeroBubble
    if virtual_stages > 1:
        raise ConfigError(
            f"schedule {schedule.value} runs one stage per device; a plan with "
            f"{virtual_stages} virtual stages needs schedule interleaved or zb"
        )
    return ScheduleGPipe if schedule is Schedule.GPIPE else Schedule1F1B


def build_schedule(modules: Sequence[nn.Module], layout: Layout, loss_fn: LossFn,
                   device: torch.device, clock: Any = None) -> Any:
    """The plan's schedule over this rank's stage modules (apply_pp, second half)."""
    role, plan = layout.role, layout.plan
    n_microbatches = plan.pipelines[role.pipeline].num_micro_batches
    if role.pp == 1 and len(modules) == 1:
        return LocalSchedule(modules[0], n_microbatches, loss_fn, clock)
    stage_class = PipelineStage if clock is None else ClockedStage
    stages = []
    for module, stage_id in zip(modules, role.virtual_stage_ids, strict=True):
        stage = stage_class(module, stage_id, role.num_virtual_stages, device,
                            group=layout.lane_group)
        stage.clock = clock
        stages.append(stage)
    schedule_class = _schedule_class(plan.schedule, len(modules), n_microbatches, role.pp)
    if schedule_class in (ScheduleGPipe, Schedule1F1B):
        return schedule_class(stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=False)
    return schedule_class(stages, n_microbatches, loss_fn=loss_fn, scale_grads=False)
