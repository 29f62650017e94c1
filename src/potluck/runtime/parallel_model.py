"""Turn a plain model into this rank's part of a plan, and run one training step.

:func:`parallelize` first refuses a plan whose execution traits the runtime
does not run (:func:`~potluck.runtime.launch.checks.check_execution`), then
applies parallelism to an unmodified model in a fixed order (the step names
are torchtitan's):

1. ``apply_tp`` (:func:`~potluck.runtime.parallel.tensor_parallel.apply_tp`):
   shard the blocks (and embedding/head) this rank holds over its stage's
   tensor-parallel mesh (on the meta device: no memory yet; a model passed in
   with real weights has them parked on the host first,
   :func:`~potluck.runtime.models.build.park_on_meta`);
2. ``apply_pp``: keep this rank's virtual stages (the family adapter's
   :func:`~potluck.runtime.parallel.pipeline.split_stages`, or the tracing
   split :func:`~potluck.runtime.models.traced.trace_stages` for other models);
   everything else is dropped; their schedule is
   :func:`~potluck.runtime.parallel.pipeline.build_schedule`'s;
3. materialize the local parameters with their layout-independent initial
   values (a TP shard is cut on the host, only it goes to the device), then the
   stage's recomputation and activation swapping
   (:func:`~potluck.runtime.parallel.recompute.apply_memory`; a
   :class:`~potluck.runtime.memory.ledger.MemoryLedger` counts what the rank holds: on
   GPU ranks its states and stashes, on CPU ranks, with ``count_memory``, everything),
   and ``apply_compile`` (:mod:`~potluck.runtime.parallel.compile`): each block and the
   loss compiled where the execution's ``compile`` trait asks for it;
4. ``apply_dp``: the gradient groups and buckets of every local parameter
   (:class:`~potluck.runtime.grads.data_parallel.GradSync`; their all-reduces
   overlap the backward pass when the plan's execution says so) and, with
   ``plan.shards_optimizer``, which replica keeps the optimizer states of which parameter
   (:func:`~potluck.runtime.grads.zero.assign_owners`); under ZeRO-3 the blocks,
   embedding and head are first ``fully_shard``-ed
   (:func:`~potluck.runtime.grads.zero3.apply_zero3`) and their parameters left
   to FSDP2.

The result, :class:`ParallelModel`, owns the stage modules, the schedule,
the gradient sync and the ZeRO-1 sharding. :meth:`ParallelModel.forward_backward`
takes this replica's rows of a global batch (``[rows, seq_len + 1]`` token
ids), runs the schedule with the token-weighted loss, sums gradients across
replicas and returns the global loss and gradient norm. The optimizer step is
the caller's (:class:`~potluck.runtime.loop.trainer.Trainer` does it, then
:meth:`ParallelModel.sync_parameters`). Under ``plan.comm.dp_priority_schedule`` the
token count is summed without a barrier (known from the step before, or an all-reduce
in flight that only the first loss waits for) and ZeRO's parameter all-gathers are left
in flight into the next forward (:mod:`~potluck.runtime.grads.gather`), finished by
:meth:`ParallelModel.flush` before anything else reads the parameters.

**Islands** that synchronize rarely (``plan.islands.split``): the step's token count, loss
and gradient norm are the island's (summed over :attr:`Layout.island_group`), so each
island's gradient is its own batch's token-weighted mean gradient and clipping uses its
own norm. One more all-reduce, over the world, gives the loss reported (every island's
token-weighted mean), the global token count, the caller's ``carry`` and whether every
island's gradients are finite: a step is skipped on every island or none, so the
trainer's stop decisions stay the same on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import loss_parallel

from potluck.cluster.topology import Cluster
from potluck.errors import ConfigError
from potluck.ops import OpKind
from potluck.placement import EMBED, HEAD, TIED, block_unit, expert_shard
from potluck.plans import explicit_tp, shards_parameters
from potluck.plans.memory import StageMemory, Swap
from potluck.runtime.grads.buckets import BUCKET_ELEMENTS, Bucket, SyncedParam, local
from potluck.runtime.grads.data_parallel import GradSync
from potluck.runtime.grads.fp32_accumulation import FP32Accumulation
from potluck.runtime.grads.gather import (
    GatherPoint,
    ParameterGathers,
    bucket_units,
    gather_points,
)
from potluck.runtime.grads.sparse_embedding import sparse_embedding_name
from potluck.runtime.grads.zero import Zero1, assign_owners
from potluck.runtime.grads.zero3 import (
    ShardPrecision,
    apply_zero3,
    check_zero3,
    managed_parameters,
)
from potluck.runtime.launch.checks import check_execution, check_explicit_tp
from potluck.runtime.launch.session import Session, gpu_ordinal
from potluck.runtime.layout import Layout
from potluck.runtime.loop.loss import IGNORE_INDEX, TokenLoss
from potluck.runtime.memory.ledger import MemoryLedger
from potluck.runtime.memory.swap import ActivationSwap, SwapTarget
from potluck.runtime.models.adapters import Family, blocks_of, detect_family, is_tied
from potluck.runtime.models.build import (
    WeightSource,
    init_kinds,
    init_std,
    materialize,
    park_on_meta,
)
from potluck.runtime.models.moe import install_router_loss, router_loss_of
from potluck.runtime.models.traced import find_blocks, trace_stages
from potluck.runtime.parallel.compile import apply_compile
from potluck.runtime.parallel.expert_parallel import apply_ep, expert_unit_names
from potluck.runtime.parallel.pipeline import (
    StageModule,
    build_schedule,
    set_stage_clock,
    split_stages,
    sub_batch_accumulations,
)
from potluck.runtime.parallel.recompute import apply_memory
from potluck.runtime.parallel.tensor_parallel import apply_tp, check_tp
from potluck.runtime.timing.clock import Clock, CommOp, NullClock, Waitable


@dataclass(frozen=True)
class StepOutput:
    """What one forward/backward over the global batch gives back (same on every rank)."""

    loss: float  # token-weighted mean over the global batch
    tokens: int  # target tokens in the global batch
    grad_norm: float  # L2 norm of the summed gradients (the island's; loss scale divided out)
    grads_finite: bool = True  # False: some gradient on some rank is inf or NaN
    carried: torch.Tensor | None = None  # the caller's ``carry``, summed over every rank


@dataclass
class TokenCount:
    """The global batch's target tokens: known, or an all-reduce still in flight."""

    total: torch.Tensor
    work: Waitable | None = None

    def wait(self) -> int:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return int(self.total.item())


def _check_model(model: nn.Module, layout: Layout, blocks: nn.ModuleList) -> None:
    spec = layout.plan.model
    if len(blocks) != spec.num_layers:
        raise ConfigError(
            f"the model has {len(blocks)} blocks but the plan was made for {spec.name} with "
            f"{spec.num_layers}; make the plan for this model"
        )


def _family_units(names: Iterator[str], family: Family, tied: bool) -> dict[str, str]:
    units = {}
    prefix = f"{family.blocks_path}."
    tied_names = {family.embedding_weight, family.head_weight} if tied else set()
    for name in names:
        if name in tied_names:
            units[name] = TIED
        elif name.startswith(prefix):
            units[name] = block_unit(int(name[len(prefix):].split(".", 1)[0]))
        elif any(name.startswith(f"{path}.") for path in family.embed_paths):
            units[name] = EMBED
        else:
            units[name] = HEAD
    return units


def _stages_of_family(model: nn.Module, family: Family, session: Session
                      ) -> tuple[list[nn.Module], dict[str, str], dict[str, str]]:
    layout, role = session.layout, session.layout.role
    plan = layout.plan
    _check_model(model, layout, blocks_of(model, family))
    tied = is_tied(model, family)
    mesh = layout.tp_mesh(session.device.type)
    layers = [i for start, end in role.layer_ranges for i in range(start, end)]
    if mesh is not None:
        apply_tp(model, family, mesh, layers, embed=role.holds_embedding, head=role.holds_head,
                 explicit=explicit_tp(plan, role.pipeline, role.stage))
    experts_mesh = layout.expert_mesh(session.device.type)
    if experts_mesh is not None:
        blocks = blocks_of(model, family)
        apply_ep([blocks[i] for i in layers], experts_mesh, plan.model.name)
    stages: list[nn.Module] = list(split_stages(model, family, layout, session.device))
    names = (name for stage in stages for name, _ in stage.named_parameters())
    aliases = {family.head_weight: family.embedding_weight} if tied else {}
    units = _family_units(names, family, tied)
    if experts_mesh is not None:
        shard = layout.expert_shard_of(role.pipeline, role.stage)
        for stage in stages:
            units = expert_unit_names(stage, units, shard)
    return stages, units, aliases


def _stages_of_any(model: nn.Module, session: Session
                   ) -> tuple[list[nn.Module], dict[str, str], dict[str, str]]:
    layout = session.layout
    if layout.plan.ep > 1:
        raise ConfigError(f"{type(model).__name__}: expert parallelism runs only with a block "
                          "adapter (a model type potluck adapts); set expert_parallel to 1")
    blocks_path = find_blocks(model, layout.plan.model.num_layers)
    _check_model(model, layout, model.get_submodule(blocks_path))
    return trace_stages(model, layout, blocks_path, session.device)


def _keep_router_loss(model: nn.Module, family: Family | None, layout: Layout) -> None:
    """The routers' auxiliary loss on this rank's blocks, when the model's config asks for
    it (:mod:`potluck.runtime.models.moe`); refused for traced models."""
    loss = router_loss_of(model)
    if loss is None:
        return
    if family is None:
        raise ConfigError(f"{type(model).__name__}: the routers' auxiliary loss runs only with "
                          "a block adapter; set output_router_logits to false in its config")
    blocks = blocks_of(model, family)
    plan, role = layout.plan, layout.role
    share = plan.pipelines[role.pipeline].micro_batch_size / plan.training.global_batch
    local = [blocks[i] for start, end in role.layer_ranges for i in range(start, end)]
    install_router_loss(local, loss, share)


def parallelize(model: nn.Module, session: Session, *, seed: int = 0,
                bucket_elements: int = BUCKET_ELEMENTS, count_memory: bool = False,
                weights: WeightSource | None = None) -> ParallelModel:
    """This rank's part of ``model`` under the session's plan (see the module docstring).

    Parameters still on the meta device get potluck's deterministic initial
    values for ``seed``, or with ``weights`` (pretrained weights already checked against
    the model) their pretrained values, of which this rank reads only its part; real
    parameters (a loaded checkpoint) keep theirs.
    Gradients cross the wire in buckets of at most ``bucket_elements`` elements.
    ``count_memory``: a CPU rank's ledger counts the bytes it holds (see
    :class:`ParallelModel`); GPU ranks always count their states and stashes.
    """
    layout = session.layout
    check_execution(layout.plan)
    check_explicit_tp(layout.plan)
    check_zero3(layout.plan)
    family = detect_family(model)
    check_tp(model, family, layout.role.tp, layout.plan.training.seq_len)
    sparse = sparse_embedding_name(layout.plan, model, family)
    kinds, std = init_kinds(model), init_std([model])  # traced stages lose the model's config
    sharded = layout.role.tp > 1 or layout.plan.ep > 1
    host_values = park_on_meta(model) if sharded else {}  # TP, EP shards cut on the host
    _keep_router_loss(model, family, layout)
    if family is not None:
        stages, units, aliases = _stages_of_family(model, family, session)
    else:
        stages, units, aliases = _stages_of_any(model, session)
    materialize(stages, session.device, seed, aliases, kinds, std, host_values=host_values,
                weights=weights)
    ledger = MemoryLedger()
    role = layout.role
    memory = layout.plan.stage_memory(role.pipeline, role.stage)
    counted = ledger if count_memory and not session.use_gpu else None  # GPUs: their allocator
    params = [p for stage in stages for p in stage.parameters()]
    swap = activation_swap(session, memory, ledger, params)
    apply_memory(stages, memory, layout.plan.recompute, swap, counted)
    compiled = apply_compile(stages, layout, session.use_gpu)
    apply_zero3(stages, layout, session.device, family, units,
                ShardPrecision(session.autocast_dtype, _wire_dtype(session)))
    parallel = ParallelModel(session, stages, units, bucket_elements, ledger,
                             sparse_embedding=sparse, count_memory=count_memory)
    if compiled.loss:
        parallel.loss_fn.compile()
    return parallel


def activation_swap(session: Session, memory: StageMemory, ledger: MemoryLedger,
                    parameters: list[nn.Parameter]) -> ActivationSwap | None:
    """This rank's swapping, if its stage swaps; one ConfigError line for a peer that is
    not a device of the same machine."""
    if not memory.swaps:
        return None
    peer_device, peer_id = None, memory.swap_peer
    if memory.swap.uses_peer:
        peer_device = _peer_device(session, peer_id)
    host_share = memory.host_share if memory.swap is Swap.HYBRID else 1.0
    target = SwapTarget(memory.swap, session.device, peer_device, peer_id, host_share)
    return ActivationSwap(target, ledger, parameters)


def _peer_device(session: Session, peer_id: str | None) -> torch.device:
    plan, own = session.plan, session.layout.role.device
    cluster = Cluster(plan.cluster)
    if peer_id is None or peer_id == own:
        raise ConfigError(f"the stage on {own} swaps to a peer but names none (or itself); "
                          "set swap_peer to another device of its machine")
    if cluster.device(peer_id).node != cluster.device(own).node:
        raise ConfigError(f"the stage on {own} swaps to {peer_id}, on another machine; "
                          "name a device of the same machine as swap_peer")
    if not session.use_gpu:
        return session.device
    return torch.device("cuda", gpu_ordinal(plan, peer_id))


def _wire_dtype(session: Session) -> torch.dtype | None:
    """Gradients cross the network in 16 bits when the plan says so and training is in
    bf16 (as the cost model assumes); fp32 runs reduce in fp32."""
    execution = session.plan.training.execution
    if execution.grad_reduce_bytes == 2 and session.all_bf16:
        return torch.bfloat16
    return None


def _merge_into(root: nn.Module, module: nn.Module) -> None:
    """Mount ``module``'s submodules under ``root`` by name, sharing leaves, copying
    containers, so several stages form one tree with the model's parameter names."""
    for name, child in module.named_children():
        existing = root._modules.get(name)
        if child._parameters or child._buffers or not child._modules:
            if existing is None:
                root.add_module(name, child)
            elif existing is not child:
                raise RuntimeError(f"two stages both hold module {name!r}")
            continue
        if existing is None:
            existing = nn.Module()
            root.add_module(name, existing)
        _merge_into(existing, child)


class ParallelModel:
    """This rank's stages of a model, their schedule and gradient sync."""

    def __init__(self, session: Session, stages: list[nn.Module], units: dict[str, str],
                 bucket_elements: int = BUCKET_ELEMENTS,
                 ledger: MemoryLedger | None = None, *,
                 sparse_embedding: str | None = None, count_memory: bool = False) -> None:
        """``sparse_embedding``: the input embedding's name when the plan sums its gradient
        sparsely (:func:`~potluck.runtime.grads.sparse_embedding.sparse_embedding_name`);
        ``count_memory``: on a CPU rank, count the model states and every tensor autograd
        saves in the ledger each step (the memory rows of its metrics; a few percent of a
        small CPU step, so off unless asked for). GPU ranks measure their device with the
        allocator; their ledger counts model states (offloaded host bytes) and stashes."""
        self.session = session
        self.ledger = ledger or MemoryLedger()
        self.counts_memory = count_memory or session.use_gpu
        self.layout = session.layout
        self.stages = stages
        self.loss_fn = TokenLoss()
        self.clock: Clock = NullClock()
        self.module = nn.Module()
        for stage in stages:
            _merge_into(self.module, stage)
        fsdp = managed_parameters(stages)  # ZeRO-3: FSDP2 syncs these
        self.fsdp_names = frozenset(n for n, p in self.module.named_parameters() if id(p) in fsdp)
        self.expert_names = frozenset(n for n, _ in self.module.named_parameters()
                                      if expert_shard(units[n]) is not None)
        self.units = {name: units[name] for name, _ in self.module.named_parameters()}
        params = [SyncedParam(name, param, units[name], self.layout.sync_group(units[name]))
                  for name, param in self.module.named_parameters() if id(param) not in fsdp]
        plan = session.plan
        owners = assign_owners(self.layout, params) if plan.shards_optimizer else None
        self.grad_sync = GradSync(
            self.layout, params, _wire_dtype(session),
            micro_batches=plan.pipelines[self.layout.role.pipeline].num_micro_batches,
            overlap=plan.training.execution.overlap_grad_reduce, bucket_elements=bucket_elements,
            owners=owners, shard_grads=plan.zero >= 2,
            norm_params=[p for p in self.module.parameters() if id(p) in fsdp],
            sparse=sparse_embedding, before_reduce=self.flush,
            accumulations=sub_batch_accumulations(stages))
        self.zero = (Zero1(self.layout, params, self.grad_sync.buckets, owners)
                     if owners is not None else None)
        self.priority = plan.comm.dp_priority_schedule
        self.gathers = self._parameter_gathers()
        self.schedule = self._build_schedule()

    def _parameter_gathers(self) -> ParameterGathers | None:
        """Under the priority schedule with ZeRO: the all-gathers left in flight, waited for
        by the modules that use their buckets and before anything reads the state dict."""
        if not self.priority or self.zero is None:
            return None
        gathers = ParameterGathers(self.zero, self._start_gather)
        gathers.hook(self._gather_points())
        self.module.register_state_dict_pre_hook(lambda *_: self.flush())
        return gathers

    def _start_gather(self, bucket: Bucket, work: Any) -> Waitable:
        """A bucket's parameter all-gather, handed to the clock (which may time it)."""
        op = CommOp(OpKind.PARAM_ALLGATHER, -1, units=bucket_units(bucket))
        return self.clock.start_comm(op, work)

    def _gather_points(self) -> list[GatherPoint]:
        """Where the forward waits for a bucket: in a family's stage, each module holding its
        parameters; a traced stage (one graph whose submodules never run as modules) waits
        for all of its buckets when it starts."""
        buckets, points = self.zero.buckets, []
        for stage in self.stages:
            if isinstance(stage, StageModule):
                points += gather_points(list(stage.modules()), buckets, recurse=False)
            else:
                points += gather_points([stage], buckets, recurse=True)
        return points

    def _build_schedule(self) -> Any:
        weight_pass = self.grad_sync.weight_pass if self.grad_sync.ready is not None else None
        return build_schedule(self.stages, self.layout, self.loss_fn, self.session.device,
                              self.clock, weight_pass)

    def set_clock(self, clock: Clock) -> None:
        """Route every op through ``clock``: emulation, tracing (rebuilds the schedule)."""
        self.clock = clock
        set_stage_clock(self.stages, clock)
        self.schedule = self._build_schedule()

    # --- what users and checkpointing see --------------------------------------------------

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.module.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Local parameters under the model's own names (DTensors where TP shards them)."""
        return self.module.named_parameters()

    def state_dict(self) -> dict[str, Any]:
        return self.module.state_dict()

    def train(self, mode: bool = True) -> None:
        for stage in self.stages:
            stage.train(mode)

    # --- one step ----------------------------------------------------------------------------

    def forward_backward(self, rows: torch.Tensor, loss_scale: float = 1.0, *,
                         tokens: int | None = None, carry: torch.Tensor | None = None
                         ) -> StepOutput:
        """Forward and backward of this replica's ``rows``; gradients summed over replicas.

        With ``loss_scale`` (fp16), gradients are left multiplied by it: the caller
        divides it out (:meth:`unscale_and_clip`); the returned loss and norm are unscaled.
        ``tokens``: the global batch's target-token count, when the caller already knows it
        (no collective then); ``carry``: float64 values summed over every rank along with
        the loss and the norm (the same all-reduce), returned as ``StepOutput.carried``.
        """
        rows = rows.to(self.session.device)
        inputs, targets = rows[:, :-1], rows[:, 1:]
        count = self._global_tokens(rows, tokens)
        self.loss_fn.defer_scale(lambda: loss_scale / max(count.wait(), 1))
        losses: list[torch.Tensor] = []
        self.grad_sync.start(inputs)  # buckets start reducing as their gradients become final
        with self._loss_context(), self._autocast(), self._counting():
            self._run_schedule(inputs, targets, losses)
        self.clock.run(OpKind.DP_ALLREDUCE, -1, self.grad_sync.finish)
        return self._reduce(losses, count.wait(), loss_scale, carry)

    def sync_parameters(self) -> None:
        """After the optimizer step: with ZeRO-1/2, copy each parameter's update from the
        replica that owns its optimizer state to the others (nothing to do otherwise).
        Under the priority schedule the all-gathers are only started: see :meth:`flush`."""
        if self.gathers is not None:
            self.gathers.launch()
        elif self.zero is not None:
            self.zero.gather_parameters()

    def flush(self) -> None:
        """Finish the parameter all-gathers still in flight (priority schedule) and write
        their values back. Forward pre-hooks wait for each bucket as the next forward needs
        it; call this before reading parameters any other way (the state dict does)."""
        if self.gathers is not None:
            self.gathers.flush()

    def final_accumulations(self) -> dict[int, int]:
        """By ``id``, each parameter whose gradient is final only after the step's last
        micro-batch (all but FSDP2's and those ZeRO-2 reduce-scatters after every
        micro-batch), with how many accumulations make it final: one per micro-batch,
        times an explicit TP stage's sub-batches."""
        taken = self.grad_sync.reduced_every_micro_batch()
        per_micro_batch = sub_batch_accumulations(self.stages)
        micro_batches = self.layout.plan.pipelines[self.layout.role.pipeline].num_micro_batches
        return {id(param): micro_batches * per_micro_batch.get(name, 1)
                for name, param in self.named_parameters()
                if id(param) not in taken and name not in self.fsdp_names}

    def unsummed_accumulations(self) -> Iterator[tuple[nn.Parameter, int]]:
        """Each parameter no replica sums (in no gradient bucket, not FSDP2's), with how
        many accumulations make its gradient final for a step (:meth:`final_accumulations`)."""
        summed = {id(item.param) for bucket in self.grad_sync.buckets for item in bucket.items}
        finals = self.final_accumulations()
        for param in self.parameters():
            if id(param) not in summed and id(param) in finals:
                yield param, finals[id(param)]

    def sum_grads_in_fp32(self, accumulation: FP32Accumulation) -> None:
        """Gradients summed over micro-batches by ``accumulation`` (16-bit weights): they
        appear only once final, so their buckets copy them instead of holding them as views
        between steps, and its leftovers are written before the remaining buckets start."""
        self.grad_sync.gradients_apart(accumulation.params())
        self.grad_sync.on_schedule_end = accumulation.finish

    def local_tokens(self, rows: torch.Tensor) -> int:
        """The target tokens of ``rows`` that this rank counts toward the global batch's
        (its replica's leader counts them, every other rank 0)."""
        if not self.layout.is_replica_leader:
            return 0
        return int((rows[:, 1:] != IGNORE_INDEX).sum())

    def _counting(self) -> Any:
        """On CPU ranks that count memory the ledger counts the tensors autograd saves (a
        GPU's allocator measures its device; the ledger still counts stashes there)."""
        if self.session.use_gpu or not self.counts_memory:
            return nullcontext()
        return self.ledger.saving()

    def _loss_context(self) -> Any:
        return loss_parallel() if self.layout.role.tp > 1 else nullcontext()

    def _autocast(self) -> Any:
        """bf16/fp16 autocast on GPUs for the whole schedule (any stage module), else nothing.
        Under ZeRO-3 without its cache of weight casts: FSDP2 gathers the weights in 16 bits
        already, and reuses one unsharded parameter object across reshards, so a cached cast
        would outlive the weights it was cast from (ATen ``autocast_mode.cpp``,
        ``cached_cast``: FP32 leaves that require grad)."""
        dtype = self.session.autocast_dtype
        if dtype is None:
            return nullcontext()
        cache = not shards_parameters(self.layout.plan)
        return torch.autocast(self.session.device.type, dtype=dtype, cache_enabled=cache)

    def _run_schedule(self, inputs: torch.Tensor, targets: torch.Tensor,
                      losses: list[torch.Tensor]) -> None:
        role = self.layout.role
        args = (inputs,) if role.holds_embedding else ()
        kwargs: dict[str, Any] = {"return_outputs": False}
        if role.holds_head:
            kwargs.update(target=targets, losses=losses)
        self.schedule.step(*args, **kwargs)

    def _global_tokens(self, rows: torch.Tensor, known: int | None) -> TokenCount:
        """The global batch's target tokens: ``known``, else summed over the replicas'
        leaders; under the priority schedule asynchronously (waited for by the first loss,
        or after the schedule on ranks without the head), so a step starts with no barrier."""
        if known is not None:
            return TokenCount(torch.tensor(float(known)))
        total = torch.tensor([float(self.local_tokens(rows))], dtype=torch.float64,
                             device=self.session.device)
        group = self.layout.island_group
        if not self.priority:
            _sum_over_ranks(total, group)
            return TokenCount(total)
        work = dist.all_reduce(total, group=group, async_op=True)
        op = CommOp(OpKind.DP_ALLREDUCE, -1, key=("global_tokens",))
        return TokenCount(total, self.clock.start_comm(op, work))

    def _reduce(self, losses: list[torch.Tensor], tokens: int, loss_scale: float,
                carry: torch.Tensor | None = None) -> StepOutput:
        loss_sum = 0.0
        if self.layout.is_loss_reporter:
            loss_sum = float(sum(_scalar(loss) for loss in losses))
        split = self.layout.plan.islands.split
        extra = carry.numel() if carry is not None and not split else 0
        totals = torch.zeros(2 + extra, dtype=torch.float64, device=self.session.device)
        totals[0] = loss_sum
        totals[1] = self.grad_sync.norm_squared()  # small tensors live on the device (nccl)
        if extra:
            totals[2:] = carry.reshape(-1)
        # an inf or NaN gradient anywhere makes every rank's sum so
        _sum_over_ranks(totals, self.layout.island_group)
        norm_squared = float(totals[1])
        output = StepOutput(loss=float(totals[0]) / loss_scale, tokens=tokens,
                            grad_norm=math.sqrt(norm_squared) / loss_scale
                            if math.isfinite(norm_squared) else math.inf,
                            grads_finite=math.isfinite(norm_squared),
                            carried=totals[2:] if extra else None)
        return self._over_islands(output, carry) if split else output

    def _over_islands(self, output: StepOutput, carry: torch.Tensor | None) -> StepOutput:
        """The island's ``output`` with the world's loss (each island's token-weighted mean,
        weighted by its tokens), token count, finiteness and ``carry`` summed: one
        all-reduce. The island's lowest rank speaks for it."""
        extra = carry.numel() if carry is not None else 0
        world = torch.zeros(3 + extra, dtype=torch.float64, device=self.session.device)
        island = self.layout.island_ranks(
            self.layout.plan.islands.island_of(self.layout.role.pipeline))
        if self.layout.rank == island[0]:
            world[0], world[1] = output.loss * output.tokens, output.tokens
        world[2] = 0.0 if output.grads_finite else 1.0
        if carry is not None:
            world[3:] = carry.reshape(-1)
        _sum_over_ranks(world)
        return StepOutput(loss=float(world[0]) / max(float(world[1]), 1.0),
                          tokens=int(world[1]), grad_norm=output.grad_norm,
                          grads_finite=float(world[2]) == 0.0,
                          carried=world[3:] if carry is not None else None)

    def unscale_and_clip(self, max_norm: float | None, grad_norm: float,
                         loss_scale: float = 1.0) -> None:
        """Divide the loss scale out of the gradients and scale them so the global norm
        (``grad_norm``, already unscaled) is at most ``max_norm`` (as clip_grad_norm_)."""
        coef = grad_coefficient(max_norm, grad_norm, loss_scale)
        if coef == 1.0:
            return
        with torch.no_grad():  # local shards: no DTensor dispatch per gradient
            grads = [local(p.grad) for p in self.parameters() if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, coef)


def _sum_over_ranks(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """All-reduce ``tensor`` in place over ``group`` (default: the world; nothing to do
    alone)."""
    if dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, group=group)


def grad_coefficient(max_norm: float | None, grad_norm: float, loss_scale: float) -> float:
    """What the gradients are multiplied by before the update: the loss scale divided out,
    and clipped to ``max_norm`` by the (unscaled) global ``grad_norm`` as clip_grad_norm_."""
    clip = 1.0 if max_norm is None else min(1.0, max_norm / (grad_norm + 1e-6))
    return clip / loss_scale


def _scalar(loss: torch.Tensor) -> float:
    value = loss.to_local() if hasattr(loss, "to_local") else loss  # replicated: local is full
    return float(value.detach())
