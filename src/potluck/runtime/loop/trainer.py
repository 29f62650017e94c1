"""The training loop: step, optimizer, metrics.

:class:`Trainer` runs one step as: this replica's rows of global batch ``k``
-> ``ParallelModel.forward_backward`` (schedule, token-weighted loss,
gradient sum across replicas) -> the loss scale divided out (fp16) and gradient
clipping by the global norm -> optimizer step ->
``ParallelModel.sync_parameters`` (ZeRO-1: each replica
updated only the parameters whose optimizer states it keeps; the updates are
gathered) -> the learning-rate scheduler's step (after skipped steps too: the rate
is a function of the step index, :mod:`~potluck.runtime.loop.schedule`). Under a
ZeRO-1 plan any torch optimizer, the default AdamW or one passed in, keeps states
for this rank's share only; where the rank's stage offloads its optimizer
(``StageMemory.offload``) the optimizer steps host masters (:func:`offloaded`). It
measures each
step (its time, and its own peak memory on a GPU:
:mod:`~potluck.runtime.loop.peak_memory`) and hands :class:`StepMetrics` to its
callbacks on rank 0 (metrics.jsonl, progress bar, TensorBoard). Every rank
computes the same metrics; only rank 0 reports them. Under fp16 autocast a step whose
gradients hold an inf or NaN on any rank is skipped on every rank (``skipped`` in its
metrics) and the :class:`~potluck.runtime.loop.loss_scale.DynamicLossScale` lowered, which
makes that the rare overflow it is meant to be; the run stops
(:class:`~potluck.errors.TrainingError`, on every rank at the same step) after
:data:`MAX_SKIPPED_STEPS` skipped steps in a row that lowering the scale could not have
helped. Without loss scaling (bf16, fp32) nothing overflows from scaling: a step that is
not finite means the weights or the settings are, and the run stops at that step.

Under the data-parallel priority schedule (``plan.comm.dp_priority_schedule``) a step
ends without a barrier: nothing world-wide runs between a rank's optimizer step and its
next forward. The parameter all-gathers stay in flight
(:mod:`~potluck.runtime.grads.gather`); the next batch's token count (``next_rows``,
which :meth:`Trainer.fit` passes) and every rank's memory figures of the step before
ride the norm's all-reduce, which clipping needs anyway. A step's complete metrics
therefore reach the callbacks, and :meth:`Trainer.fit`'s history, with the next step,
or with :meth:`Trainer.flush` (the end of :meth:`Trainer.fit`, a checkpoint); who calls
:meth:`Trainer.step` directly calls :meth:`Trainer.flush` after the last one.

Data comes from any :class:`BatchSource` (``potluck.data.TokenDataset`` is
one): ``replica_rows(step, start, count)``
returns rows ``[start, start + count)`` of global batch ``step`` as token ids
``[count, seq_len + 1]``. A replica asks only for its own share.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from potluck.errors import TrainingError
from potluck.ops import OpKind
from potluck.plans import shards_parameters
from potluck.plans.memory import Offload
from potluck.runtime.grads.islands import (
    IslandReport,
    NoIslands,
    inner_lr_scale,
    island_sync,
)
from potluck.runtime.grads.master_weights import MasterWeightsOptimizer
from potluck.runtime.grads.offload import HostOffloadOptimizer
from potluck.runtime.loop.loss_scale import DynamicLossScale
from potluck.runtime.loop.peak_memory import PeakMemory, peak_memory
from potluck.runtime.loop.schedule import Schedule, advance, make_scheduler
from potluck.runtime.parallel_model import ParallelModel, grad_coefficient

log = logging.getLogger(__name__)

MAX_SKIPPED_STEPS = 8
"""Skipped fp16 steps in a row after which a run stops, counting only those that a lower
loss scale could not have saved (once the scale is at its floor). The default scale starts
at 2^16 with a floor of 1, so a run whose state is inf or NaN stops after at most 16 + 8
skips (more if the scale had grown). Eight in a row is far beyond a bad batch or two: data
differs from step to step, a skipped step leaves the weights as they were, and so each
further skip means the weights, the optimizer state or the learning rate are broken.
Without loss scaling (bf16, fp32) the first non-finite step stops the run."""


class BatchSource(Protocol):
    """Deterministic global batches; each replica reads its own rows."""

    def replica_rows(self, step: int, start: int, count: int) -> torch.Tensor: ...


class Callback(Protocol):
    def on_step(self, metrics: StepMetrics) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class StepMetrics:
    """One line of metrics.jsonl."""

    step: int
    loss: float
    tokens: int
    tokens_per_s: float
    step_time_s: float
    predicted_step_time_s: float | None
    peak_memory_gb: float  # this step's peak on a GPU, the process's so far on CPU (max of ranks)
    grad_norm: float
    lr: float
    loss_scale: float | None = None  # fp16 loss scale this step ran with
    skipped: bool = False  # inf/NaN gradients: no optimizer step
    dilation: float | None = None  # an emulated run's time stretch (None: not emulated)
    device_step_time_s: float | None = None  # emulated: the step on the plan's devices
    # islands that synchronize rarely (None without): outer steps (diloco) or pushes
    # (bounded) done, the bytes every rank sent across islands in this step, and the pushes
    # still in flight (bounded's staleness; 0 for diloco)
    outer_step: int | None = None
    bytes_exchanged_across_islands: int | None = None
    staleness: int | None = None
    memory: tuple[dict[str, Any], ...] = ()  # per rank: its step's peaks (rank_memory_rows;
    # none on CPU ranks that do not count their memory, ParallelModel's count_memory)
    # Trainer.step under the priority schedule returns the record before every rank's memory
    # is known: peak_memory_gb is then this rank's own and memory empty (see the module doc)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def default_optimizer(model: ParallelModel, lr: float, weight_decay: float = 0.0,
                      betas: tuple[float, float] = (0.9, 0.95)) -> torch.optim.Optimizer:
    """AdamW over this rank's parameters (DTensors where TP shards them), with torch's fused
    kernel where the update runs on a GPU or on host masters (:func:`offloaded`; torch 2.13
    fuses Adam on CPUs too), else its foreach kernels. Both are named: torch picks neither
    by itself for DTensors, and steps them one tensor at a time.

    One kernel call takes one kind of tensor, so a rank holding plain tensors and DTensors
    gets a param group of each (same settings) with the kernel named on the groups only:
    ``zero_grad`` reads the optimizer's defaults and would zero all groups in one call."""
    kernel = {"fused": True, "foreach": False} if (
        model.session.device.type == "cuda" or _offloads(model)) else \
        {"fused": False, "foreach": True}
    params = list(model.parameters())
    kinds = [kind for kind in ([p for p in params if not isinstance(p, DTensor)],
                               [p for p in params if isinstance(p, DTensor)]) if kind]
    settings = {"lr": lr, "betas": betas, "weight_decay": weight_decay}
    if len(kinds) == 1:
        return torch.optim.AdamW(kinds[0], **settings, **kernel)
    return torch.optim.AdamW([{"params": kind, **kernel} for kind in kinds], **settings)


MEMORY_COLUMNS = 6  # a memory table row's own figures, before its two per-rank blocks


def _island_fields(report: IslandReport | None) -> dict[str, int]:
    """The metrics fields of a step's exchanges across islands (none without islands)."""
    if report is None:
        return {}
    return {"outer_step": report.outer_step,
            "bytes_exchanged_across_islands": report.bytes_sent,
            "staleness": report.staleness}


def memory_columns(world: int) -> int:
    """The columns of a memory table row (:func:`memory_table`) among ``world`` ranks."""
    return MEMORY_COLUMNS + 2 * world


def memory_table(model: ParallelModel, meter: PeakMemory) -> torch.Tensor:
    """This rank's row of the step's memory table, the other rows zero (summed over the
    ranks: everyone's): the meter's peak (``peak_memory_gb``), then
    :func:`rank_memory_rows`' device bytes and host bytes, 1 where the meter reads a GPU's
    figures, its reserved and used bytes (:mod:`~potluck.runtime.loop.peak_memory`), the
    bytes held on each rank's device (the ledger's stashes) and what this rank's allocator
    reserved on each rank's device (its peers')."""
    layout, session = model.layout, model.session
    world, devices = layout.world_size, layout.device_of_rank
    peak = model.ledger.peak()
    table = torch.zeros(world, memory_columns(world), dtype=torch.float64, device=session.device)
    row = table[layout.rank]
    row[0] = meter.peak_bytes()
    row[1] = row[0] if session.use_gpu else peak.device_bytes
    row[2] = peak.host_bytes
    measured = meter.device_peaks()
    if measured is not None:
        row[3], row[4], row[5] = 1.0, measured.reserved_bytes, measured.used_bytes
    held, reserved = row[MEMORY_COLUMNS:MEMORY_COLUMNS + world], row[MEMORY_COLUMNS + world:]
    for device, nbytes in peak.peer_bytes.items():
        if device in devices:
            held[devices.index(device)] = nbytes
    for device, peer in meter.peer_peaks().items():
        if device in devices:
            reserved[devices.index(device)] = peer.reserved_bytes
    return table


def rank_memory_rows(model: ParallelModel, table: torch.Tensor) -> tuple[dict[str, Any], ...]:
    """Every rank's peaks of the step from the summed :func:`memory_table` (the same on every
    rank): ``device`` (the plan's id), ``device_bytes`` (a GPU's allocator peak; a CPU
    rank's ledger), ``host_bytes``, ``held_on`` (bytes this rank's stashes took on other
    devices, by device id); on GPUs also ``reserved_bytes`` and ``used_bytes`` (the
    allocator's peak reserve, the device's memory in use by every process) and
    ``reserved_on`` (what this rank's allocator reserved on its peers, by device id),
    which are None, and {}, on CPU ranks."""
    devices = model.layout.device_of_rank
    return tuple(_memory_row(devices, r, row) for r, row in enumerate(table.tolist()))


def _memory_row(devices: Sequence[str], rank: int, row: list[float]) -> dict[str, Any]:
    gpu, world = bool(row[3]), len(devices)
    held, reserved = row[MEMORY_COLUMNS:MEMORY_COLUMNS + world], row[MEMORY_COLUMNS + world:]
    return {"device": devices[rank], "device_bytes": row[1], "host_bytes": row[2],
            "held_on": {devices[p]: nbytes for p, nbytes in enumerate(held) if nbytes},
            "reserved_bytes": row[4] if gpu else None, "used_bytes": row[5] if gpu else None,
            "reserved_on": {devices[p]: nbytes for p, nbytes in enumerate(reserved) if nbytes}}


def swap_peers(model: ParallelModel) -> dict[str, torch.device]:
    """The devices other than its own where this rank's stages stash, by the plan's id."""
    own = model.session.device
    swaps = {getattr(stage, "swap", None) for stage in model.stages}
    return {swap.target.peer_id: swap.target.peer_device for swap in swaps
            if swap is not None and swap.target.peer_id is not None
            and swap.target.peer_device not in (None, own)}


def offloaded(model: ParallelModel, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``optimizer`` stepping on host masters where this rank's stage offloads it
    (:class:`~potluck.runtime.grads.offload.HostOffloadOptimizer`; under ZeRO only the
    owned share), else ``optimizer`` itself."""
    if not _offloads(model):
        return optimizer
    keep = model.zero.updates if model.zero is not None else None
    offload = HostOffloadOptimizer(optimizer, keep, modules=model.module.modules())
    dtype = model.session.autocast_dtype  # 16-bit GPU ranks; CPU ranks train in FP32
    if model.session.use_gpu and dtype is not None:
        model.sum_grads_in_fp32(offload.keep_device_parameters_in(
            model.parameters(), dtype, model.final_accumulations()))
    copy_grads_when_final(offload, model)
    return offload


def with_masters(model: ParallelModel, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``optimizer`` stepping FP32 masters of 16-bit device weights
    (:class:`~potluck.runtime.grads.master_weights.MasterWeightsOptimizer`; under ZeRO-1/2
    the owned share only) on a GPU rank computing in 16 bits whose plan says
    ``fp32_params: false``; else ``optimizer`` itself (FP32 weights under autocast, CPU
    ranks, an offloaded optimizer, whose masters are on the host, and ZeRO-3, where FSDP2
    keeps FP32 shards and gathers 16-bit weights)."""
    dtype = model.session.autocast_dtype
    plan = model.layout.plan
    if (not model.session.use_gpu or dtype is None or plan.training.execution.fp32_params
            or _offloads(model) or shards_parameters(plan)):
        return optimizer
    keep = model.zero.updates if model.zero is not None else None
    masters = MasterWeightsOptimizer(optimizer, keep)
    model.sum_grads_in_fp32(masters.keep_device_parameters_in(
        model.parameters(), dtype, model.final_accumulations()))
    return masters


def copy_grads_when_final(offload: HostOffloadOptimizer, model: ParallelModel) -> None:
    """Start each gradient's copy to the host once it is final for the step: a summed one
    when its bucket's sum is written back, any other after its last micro-batch's
    accumulation (an explicit TP stage's blocks: one hook per sub-batch)."""
    offload.copy_when_final(model.unsummed_accumulations())
    model.grad_sync.on_final = offload.grads_final


def _offloads(model: ParallelModel) -> bool:
    """Whether this rank's stage keeps its optimizer in host memory."""
    role = model.layout.role
    return model.layout.plan.stage_memory(role.pipeline, role.stage).offload is Offload.OPTIMIZER


class Trainer:
    """Steps a :class:`ParallelModel` with an optimizer; reports metrics on rank 0."""

    def __init__(self, model: ParallelModel, optimizer: torch.optim.Optimizer | None = None, *,
                 lr: float = 3e-4, max_grad_norm: float | None = 1.0,
                 schedule: Schedule | None = None, weight_decay: float = 0.0,
                 callbacks: Sequence[Callback] = (),
                 predicted_step_time_s: float | None = None,
                 loss_scale: DynamicLossScale | None = None, emulated: bool = False) -> None:
        """``schedule``: each step's learning rate (default: ``lr`` throughout; when given,
        the default optimizer starts from its ``lr``); ``weight_decay``: the default
        optimizer's; ``loss_scale``: default a :class:`DynamicLossScale` under fp16 autocast,
        else none; ``emulated``: the model's clock stretches ops (metrics carry the
        dilation)."""
        self.model = model
        if loss_scale is None and model.session.any_fp16:
            loss_scale = DynamicLossScale()
        self.loss_scale = loss_scale
        self.schedule = schedule or Schedule(lr=lr)
        self.optimizer = with_masters(model, offloaded(model, optimizer or default_optimizer(
            model, self.schedule.lr, weight_decay)))
        if model.zero is not None:
            model.zero.attach(self.optimizer)
        self.lr_scale = inner_lr_scale(model.layout, self.optimizer)
        self.scheduler = make_scheduler(self.optimizer, self.schedule, self.lr_scale)
        self.islands = island_sync(
            model.layout, [(n, p, model.units[n]) for n, p in model.named_parameters()],
            self.optimizer, model.session.device, lambda: self.model.clock)
        self.max_grad_norm = max_grad_norm
        self.callbacks = list(callbacks) if model.layout.rank == 0 else []
        prediction = model.layout.plan.prediction
        self.predicted_step_time_s = predicted_step_time_s or (
            prediction.iteration_time_s if prediction else None)
        self.emulated = emulated
        self.memory: PeakMemory = peak_memory(model.session.device, swap_peers(model))
        self.step_index = 0
        self.stop_requested = False  # set by an on_step hook: fit ends after that step
        self.skipped_in_a_row = 0  # skips a lower loss scale could not have avoided
        self.good_checkpoint: Path | None = None  # newest checkpoint a finite step ran from
        self.resumed_from: Path | None = None
        self._unconfirmed_checkpoint: Path | None = None
        # priority schedule: a step's metrics awaiting every rank's memory table, and the
        # token count of rows a step was told come next
        self._pending: tuple[StepMetrics, torch.Tensor] | None = None
        self._next_tokens: tuple[torch.Tensor, int] | None = None
        self._history: list[StepMetrics] | None = None  # fit's, while it runs

    def note_checkpoint(self, path: Path, *, resumed: bool = False) -> None:
        """A checkpoint of the current state was saved (or, ``resumed``, loaded). It becomes
        :attr:`good_checkpoint` once a step run from this state has finite gradients and loss:
        the state a step saves comes from that step's update, which its own loss cannot vouch
        for."""
        self._unconfirmed_checkpoint = path
        if resumed:
            self.resumed_from = path

    def step(self, rows: torch.Tensor, *, next_rows: torch.Tensor | None = None
             ) -> StepMetrics:
        """One training step on this replica's ``rows`` of the current global batch.
        ``next_rows``: the next step's rows, if known (the priority schedule then sums their
        token count in this step's norm all-reduce; see the module docstring)."""
        with self.model.session.guard():
            self.memory.start()
            self._count_states()
            self.model.ledger.start_step()
            start_s = time.perf_counter()
            scale = self.loss_scale.scale if self.loss_scale is not None else 1.0
            lowerable = self.loss_scale is not None and scale > self.loss_scale.min_scale
            output = self._forward_backward(rows, next_rows, scale)
            completed = self._take_carried(output, next_rows)
            self._update_or_skip(output, scale)
            report = self._cross_islands()
            self._synchronize()
            step_time_s = time.perf_counter() - start_s
            metrics = self._metrics(output, step_time_s, scale, report)
            advance(self.scheduler)
        for record in [*completed, *([] if self.model.priority else [metrics])]:
            self._report(record)
        self.step_index += 1
        if output.grads_finite and math.isfinite(output.loss) and self._unconfirmed_checkpoint:
            self.good_checkpoint, self._unconfirmed_checkpoint = self._unconfirmed_checkpoint, None
        self._count_skips(output.grads_finite, lowerable)
        return metrics

    def fit(self, source: BatchSource, steps: int,
            on_step: Callable[[StepMetrics], None] | None = None) -> list[StepMetrics]:
        """Train ``steps`` steps from the trainer's current step; returns every step's
        metrics, complete (under the priority schedule the last one after the final
        :meth:`flush`). ``on_step`` hears of each step as it ends, and may end the fit there
        (:attr:`stop_requested`)."""
        start, count = self.model.layout.batch_rows
        history: list[StepMetrics] = []
        self._history = history
        try:
            rows = None
            for done in range(1, steps + 1):
                if rows is None:
                    rows = source.replica_rows(self.step_index, start, count)
                ahead = (source.replica_rows(self.step_index + 1, start, count)
                         if self.model.priority and done < steps else None)
                metrics = self.step(rows, next_rows=ahead)
                if on_step is not None:
                    on_step(metrics)
                if self.stop_requested:
                    break
                rows = ahead
            self.islands.drain()
            self.flush()
        finally:
            self._history = None
            for callback in self.callbacks:
                callback.close()
        return history

    def flush(self) -> None:
        """Finish what steps under the priority schedule left in flight: the parameter
        all-gathers, and every rank's memory figures of the last step, whose metrics are
        then reported. Collective while a step's metrics are pending: every rank calls it
        (:meth:`fit` at its end, checkpoint saves and resumes do). Nothing otherwise."""
        with self.model.session.guard():
            self.model.flush()
            if self._pending is None:
                return
            (metrics, table), self._pending = self._pending, None
            dist.all_reduce(table)
        self._report(self._with_memory(metrics, table))

    def _cross_islands(self) -> IslandReport | None:
        """After the inner step: what crosses islands at this step (nothing without islands
        that synchronize rarely; :mod:`~potluck.runtime.grads.islands`)."""
        if isinstance(self.islands, NoIslands):
            return None
        self.model.flush()  # the parameter all-gathers still in flight (priority schedule)
        return self.islands.after_step(self.step_index + 1)

    def _update_or_skip(self, output: Any, scale: float) -> None:
        """Clip and step the optimizer, or skip a step whose gradients are not finite."""
        self._count_states()  # the step's gradients
        if output.grads_finite:
            self._unscale_and_clip(output.grad_norm, scale)
            self.model.clock.run(OpKind.OPTIMIZER, -1, self._update)
            if self.model.priority:  # the all-gathers start once the step is over
                self.model.sync_parameters()
        else:
            self._skip_step(scale)
        if self.loss_scale is not None:
            self.loss_scale.update(output.grads_finite)
        self._count_states()  # the optimizer's states (made at its first step)
        self.optimizer.zero_grad(set_to_none=False)

    def _unscale_and_clip(self, grad_norm: float, scale: float) -> None:
        """Divide the loss scale out and clip: in FP32 on the host copies of the gradients
        where the optimizer is offloaded (the device ones may be 16-bit), else in place."""
        if isinstance(self.optimizer, (HostOffloadOptimizer, MasterWeightsOptimizer)):
            coefficient = grad_coefficient(self.max_grad_norm, grad_norm, scale)
            self.optimizer.scale_gradients(coefficient)
        else:
            self.model.unscale_and_clip(self.max_grad_norm, grad_norm, scale)

    def _report(self, metrics: StepMetrics) -> None:
        for callback in self.callbacks:
            callback.on_step(metrics)
        if self._history is not None:
            self._history.append(metrics)

    # --- what the priority schedule carries in the norm's all-reduce -------------------------

    def _forward_backward(self, rows: torch.Tensor, next_rows: torch.Tensor | None,
                          scale: float) -> Any:
        if not self.model.priority:
            return self.model.forward_backward(rows, scale)
        return self.model.forward_backward(rows, scale, tokens=self._known_tokens(rows),
                                           carry=self._carry(next_rows))

    def _carry(self, next_rows: torch.Tensor | None) -> torch.Tensor:
        """1 and this rank's token count of ``next_rows`` if given (0, 0 if not, or when
        islands split the plan: the island's own count is summed in the step), then the
        pending step's memory table (zeros if none)."""
        world = self.model.layout.world_size
        carry = torch.zeros(2 + world * memory_columns(world), dtype=torch.float64,
                            device=self.model.session.device)
        if next_rows is not None and not self.model.layout.plan.islands.split:
            carry[0], carry[1] = 1.0, float(self.model.local_tokens(next_rows))
        if self._pending is not None:
            carry[2:] = self._pending[1].reshape(-1)
        return carry

    def _take_carried(self, output: Any, next_rows: torch.Tensor | None) -> list[StepMetrics]:
        """Keep the next rows' global token count if every rank gave them; complete the
        pending step's metrics with every rank's memory (none without a pending step)."""
        if output.carried is None:
            return []
        carried, world = output.carried, self.model.layout.world_size
        if next_rows is not None and int(carried[0]) == world:
            self._next_tokens = (next_rows, int(carried[1]))
        if self._pending is None:
            return []
        (metrics, table), self._pending = self._pending, None
        return [self._with_memory(metrics, carried[2:].view(table.shape))]

    def _known_tokens(self, rows: torch.Tensor) -> int | None:
        """The global token count of ``rows`` if the step before summed it (the same tensor
        it was given as ``next_rows``), else None."""
        known, self._next_tokens = self._next_tokens, None
        return known[1] if known is not None and known[0] is rows else None

    def _skip_step(self, scale: float) -> None:
        if self.model.layout.rank != 0:
            return
        if self.loss_scale is not None:
            log.info("step %d: fp16 gradients overflowed at loss scale %g; step skipped, "
                     "scale lowered", self.step_index, scale)

    def _count_skips(self, grads_finite: bool, lowerable: bool) -> None:
        """Stop after MAX_SKIPPED_STEPS fp16 skips in a row that a lower scale cannot avoid,
        at the first skip without loss scaling (identical on every rank: all of them see
        the same all-reduced gradient norm)."""
        if grads_finite:
            self.skipped_in_a_row = 0
            return
        if lowerable:
            return
        self.skipped_in_a_row += 1
        if self.loss_scale is None:
            self._stop_unscaled()
        if self.skipped_in_a_row < MAX_SKIPPED_STEPS:
            return
        self.flush()  # every rank stops at this step: the last metrics are still reported
        raise TrainingError(
            f"stopped after step {self.step_index - 1}: {self.skipped_in_a_row} steps in a row "
            "were skipped because their gradients were inf or NaN, which a lower loss scale "
            f"cannot fix ({self._suspects()}); {self._good()}")

    def _stop_unscaled(self) -> None:
        """Stop at a non-finite step without loss scaling (bf16, fp32): nothing to lower."""
        self.flush()  # every rank stops at this step: its metrics are still reported
        dtype = self.model.session.compute_dtype.value  # what this rank computes in
        raise TrainingError(
            f"stopped at step {self.step_index - 1}: its loss or gradients are inf or NaN in "
            f"{dtype}, where no loss scaling overflows ({self._suspects()}); {self._good()}")

    def _suspects(self) -> str:
        lr = float(self.optimizer.param_groups[0]["lr"])
        return f"the weights are no longer finite, or the learning rate {lr:g} is too high"

    def _good(self) -> str:
        if self.good_checkpoint:
            return f"the newest good checkpoint is {self.good_checkpoint}"
        if self.resumed_from:
            return f"no step since it resumed from {self.resumed_from} was finite"
        return "no checkpoint of this run is known to be good"

    def _update(self) -> None:
        self.optimizer.step()
        if self.model.zero is not None and isinstance(self.optimizer, HostOffloadOptimizer):
            self.optimizer.wait_for_parameters()  # the all-gather sends the updated values
        if not self.model.priority:
            self.model.sync_parameters()

    def _count_states(self) -> None:
        if not self.model.counts_memory:
            return
        host: list[torch.Tensor] = []
        if isinstance(self.optimizer, HostOffloadOptimizer):  # masters and states on the host
            host = self.optimizer.host_state_tensors()
            self.model.ledger.add_host_tensors(host)
        self.model.ledger.count_states(self.model.parameters(), self.optimizer, extra=host)

    def _synchronize(self) -> None:
        """Wait for the step's device work (to time it): all of it, or under the priority
        schedule the compute stream's only, so the parameter all-gathers travel on."""
        if not self.model.session.use_gpu:
            return
        if self.model.priority:
            torch.cuda.current_stream(self.model.session.device).synchronize()
        else:
            torch.cuda.synchronize(self.model.session.device)

    def _predicted_s(self) -> float | None:
        """The predicted step time stretched as the clock stretches ops (1x without
        emulation); none while an emulation's dilation is not yet calibrated (0)."""
        dilation = self.model.clock.dilation
        if self.predicted_step_time_s is None or not dilation:
            return None
        return self.predicted_step_time_s * dilation

    def _metrics(self, output: Any, step_time_s: float, scale: float,
                 report: IslandReport | None = None) -> StepMetrics:
        """The step's metrics, with every rank's memory summed now; under the priority
        schedule with this rank's own only, the table left pending for the next step."""
        table = memory_table(self.model, self.memory)
        metrics = StepMetrics(
            step=self.step_index, loss=output.loss, tokens=output.tokens,
            tokens_per_s=output.tokens / step_time_s if step_time_s > 0 else 0.0,
            step_time_s=step_time_s, predicted_step_time_s=self._predicted_s(),
            peak_memory_gb=float(table[self.model.layout.rank, 0]) / 1e9,
            grad_norm=output.grad_norm, lr=float(self.optimizer.param_groups[0]["lr"]),
            loss_scale=scale if self.loss_scale is not None else None,
            skipped=not output.grads_finite, **self._device_time(step_time_s),
            **_island_fields(report),
        )
        if self.model.priority:
            self._pending = (metrics, table)
            return metrics
        if self.model.layout.world_size > 1:
            dist.all_reduce(table)
        return self._with_memory(metrics, table)

    def _with_memory(self, metrics: StepMetrics, table: torch.Tensor) -> StepMetrics:
        """``metrics`` with every rank's memory from the summed :func:`memory_table`."""
        rows = rank_memory_rows(self.model, table) if self.model.counts_memory else ()
        return replace(metrics, peak_memory_gb=float(table[:, 0].max()) / 1e9, memory=rows)

    def _device_time(self, step_time_s: float) -> dict[str, float]:
        """An emulated step's dilation and its time on the plan's devices: the clock pads
        every op to ``dilation x`` its device time, so the step is divided by it."""
        dilation = self.model.clock.dilation
        if not self.emulated or not dilation:
            return {}
        return {"dilation": dilation, "device_step_time_s": step_time_s / dilation}
