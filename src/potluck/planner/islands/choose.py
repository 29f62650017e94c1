"""The planner's choice of islands: split the cluster where its links are slow, lay out each
island with today's search, and pick H, compression and fragments by time to a target loss.

1. **Where to split** (:mod:`.split`): at a gap in link speed, or evenly on a slow network.
2. **Each island's layout**: today's search (:func:`potluck.planner.search.search`) on a
   cluster of the island's machines only, with its share of the global batch. Shares start
   in proportion to each island's peak FLOPS and are set once more in proportion to the
   islands' predicted throughput, so that islands of different speeds finish an inner step
   together. The schedule and ZeRO stage (up to 2) are those of the island searched first
   (the one of least memory), pinned for the others; plan-wide communication scheduling is
   the first island's (the plan's prediction prices it for all).
3. **How to synchronize**: for each H in :data:`INNER_STEPS`, each compression and each
   number of fragments (and, for ``bounded``, each staleness), the time to the target =
   tokens to the target (the target times the convergence penalty's factor,
   :mod:`.convergence`) / tokens per second with the exposed outer exchange
   (:mod:`.exchange`). The least wins. DiLoCo's outer optimizer is planned by H
   (:func:`outer_step`).

``auto`` keeps the faster to the target of that plan and the best synchronous one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from itertools import product

from potluck.cluster.spec import ClusterSpec
from potluck.cluster.topology import Cluster, Device, device_id
from potluck.errors import ConfigError, InfeasibleError
from potluck.model import counts
from potluck.model.spec import ModelSpec
from potluck.planner import gemm
from potluck.planner.evaluate import predict
from potluck.planner.islands import convergence
from potluck.planner.islands.convergence import Penalty
from potluck.planner.islands.exchange import (
    OuterExchange,
    between_islands,
    exposed_per_step_s,
    island_devices,
    outer_exchange,
    whole_exchange_s,
)
from potluck.planner.islands.split import GAP_FACTOR, SLOW_LINK_BYTES_PER_S, Split, mixes_vendors
from potluck.planner.options import SearchOptions
from potluck.plans import DType, Pipeline, Plan, TrainingShape, check_plan
from potluck.plans.islands import (
    DILOCO_OUTER_LR,
    DILOCO_OUTER_MOMENTUM,
    Compression,
    Island,
    Islands,
    SyncMethod,
    Transport,
)

INNER_STEPS = (10, 50, 100, 250, 500)  # H tried (DiLoCo 2023 used 500; its ablations fewer)
LEAST_PUBLISHED_H = 50
"""The least H at which DiLoCo's published outer step (Nesterov, lr 0.7, momentum 0.9) was
evaluated (Douillard et al. 2023, arXiv:2311.08105, section 3.1: H = 50 against 1000)."""
FRAGMENTS = (1, 2, 4)  # streaming DiLoCo's fragments tried
STALENESS = (1, 2)  # bounded: pushes an island may run ahead, tried
REBALANCE_TOLERANCE = 1.05  # islands' inner steps within 5 %: shares kept

Search = Callable[[ClusterSpec, ModelSpec, TrainingShape, SearchOptions], Plan]


@dataclass(frozen=True)
class IslandChoice:
    """A plan with islands and why: its split, its exchange, its penalty, its time to target."""

    plan: Plan
    split: Split
    exchange: OuterExchange
    penalty: Penalty
    target_tokens: float
    time_to_target_s: float


def time_to_target_s(target_tokens: float, token_factor: float, tokens_per_s: float) -> float:
    """Seconds to train ``target_tokens`` times the convergence penalty's factor."""
    return target_tokens * token_factor / tokens_per_s


def sub_cluster(spec: ClusterSpec, machines: tuple[str, ...]) -> tuple[ClusterSpec, dict[str, str]]:
    """A cluster of ``machines`` only (``<group>.<index>``), and each of its device ids to
    the id of the same device in ``spec``."""
    indices: dict[str, list[int]] = {}
    for machine in machines:
        group, index = machine.rsplit(".", 1)
        indices.setdefault(group, []).append(int(index))
    groups = tuple(replace(g, count=len(indices[g.name])) for g in spec.nodes if g.name in indices)
    names = {g.name for g in groups}
    links = tuple(link for link in spec.links if set(link.between) <= names)
    ids = {device_id(g.name, i, local): device_id(g.name, node, local)
           for g in groups for i, node in enumerate(indices[g.name])
           for local in range(g.gpus_per_node)}
    return replace(spec, nodes=groups, links=links), ids


def remapped(pipeline: Pipeline, ids: dict[str, str], plan: Plan, k: int) -> Pipeline:
    """``pipeline`` (number ``k`` of ``plan``) on the full cluster's device ids, its stages'
    memory with the plan-wide recomputation filled in."""
    stages = []
    for i, stage in enumerate(pipeline.stages):
        memory = plan.stage_memory(k, i)
        if memory.swap_peer is not None:
            memory = replace(memory, swap_peer=ids[memory.swap_peer])
        stages.append(replace(stage, devices=tuple(ids[d] for d in stage.devices), memory=memory))
    return replace(pipeline, stages=tuple(stages))


def peak_flops(devices: Iterable[Device], dtype: DType) -> float:
    """An island's peak FLOPS, of its ``devices``: its first batch share."""
    return sum(gemm.peak_flops(d.type, dtype) for d in devices)


def island_speeds(spec: ClusterSpec, split: Split, dtype: DType) -> list[float]:
    """Each island's peak FLOPS: the first batch shares."""
    cluster = Cluster(spec)
    return [peak_flops((d for d in cluster.devices if d.node in machines), dtype)
            for machines in split.islands]


def batch_rows(global_batch: int, speeds: list[float]) -> list[int]:
    """``global_batch`` rows split in proportion to ``speeds``, each island at least one."""
    if global_batch < len(speeds):
        raise ConfigError(f"--global-batch {global_batch} is smaller than the {len(speeds)} "
                          "islands; raise it")
    total = sum(speeds)
    rows = [max(1, int(global_batch * s / total)) for s in speeds]
    while sum(rows) < global_batch:  # the island with the most speed per row takes one more
        rows[max(range(len(rows)), key=lambda j: speeds[j] / rows[j])] += 1
    while sum(rows) > global_batch:  # the one with the most rows per speed gives one back
        rows[max((j for j in range(len(rows)) if rows[j] > 1),
                 key=lambda j: rows[j] / speeds[j])] -= 1
    return rows


def _island_plans(spec: ClusterSpec, model: ModelSpec, training: TrainingShape,
                  options: SearchOptions, split: Split, rows: list[int], search: Search
                  ) -> list[tuple[Plan, dict[str, str]]]:
    """Each island's best layout for its rows, plan-wide choices pinned to those of the
    island searched first: the one of least memory, so that a split whose smallest island
    cannot hold the model fails before the large islands are searched."""
    plans: dict[int, tuple[Plan, dict[str, str]]] = {}
    for index in sorted(range(split.count), key=lambda i: _memory_bytes(spec, split.islands[i])):
        sub, ids = sub_cluster(spec, split.islands[index])
        best = island_layout(sub, model, training, options, rows[index], search)
        if not plans:
            options = replace(options, zero=best.zero, schedule=best.schedule,
                              virtual_stages=best.virtual_stages)
        plans[index] = (best, ids)
    return [plans[i] for i in range(split.count)]


def island_layout(sub: ClusterSpec, model: ModelSpec, training: TrainingShape,
                  options: SearchOptions, rows: int, search: Search) -> Plan:
    """The best layout of an island (``sub``: a cluster of its devices only) for ``rows``
    rows of each global batch, of ZeRO stage at most 2 (stage 3 gathers every step, across
    islands too)."""
    shaped = replace(training, global_batch=rows)
    best = search(sub, model, shaped, options)
    if best.zero == 3:
        best = search(sub, model, shaped, replace(options, zero=2))
    return best


def _memory_bytes(spec: ClusterSpec, machines: tuple[str, ...]) -> float:
    """The device memory of ``machines``."""
    return sum(d.type.memory_bytes for d in Cluster(spec).devices if d.node in machines)


def assemble(spec: ClusterSpec, training: TrainingShape,
             parts: list[tuple[Plan, dict[str, str]]], islands: Islands) -> Plan:
    """One plan of every island's pipelines (``islands``' members filled in; on a cluster of
    several vendors, each island's transport host)."""
    first = parts[0][0]
    pipelines: list[Pipeline] = []
    members = []
    transport = islands_transport(Cluster(spec))
    for plan, ids in parts:
        start = len(pipelines)
        pipelines += [remapped(p, ids, plan, k) for k, p in enumerate(plan.pipelines)]
        members.append(Island(tuple(range(start, len(pipelines))), transport))
    used = {d for p in pipelines for d in p.devices}
    unused = tuple(d.id for d in Cluster(spec).devices if d.id not in used)
    return Plan(spec, first.model, training, tuple(pipelines), schedule=first.schedule,
                virtual_stages=first.virtual_stages, zero=first.zero, comm=first.comm,
                islands=replace(islands, islands=tuple(members)), unused_devices=unused)


def islands_transport(cluster: Cluster) -> Transport:
    """How islands of ``cluster``'s devices reach each other: through host memory when its
    machines are of several vendors (no backend joins two), else over the job's backend."""
    return Transport.HOST if mixes_vendors(cluster) else Transport.BACKEND


def rebalanced_speeds(parts: list[tuple[Plan, dict[str, str]]], rows: list[int]
                      ) -> list[float] | None:
    """Throughput per island when their inner steps differ by more than the tolerance."""
    steps = [plan.prediction.iteration_time_s for plan, _ in parts]
    if max(steps) <= REBALANCE_TOLERANCE * min(steps):
        return None
    return [r / s for r, s in zip(rows, steps, strict=True)]


def split_plan(spec: ClusterSpec, model: ModelSpec, training: TrainingShape,
               options: SearchOptions, split: Split, search: Search, sync: SyncMethod) -> Plan:
    """The islands of ``split`` laid out, batch shares balanced (ConfigError: one does not fit)."""
    rows = batch_rows(training.global_batch, island_speeds(spec, split, training.dtype))
    parts = _island_plans(spec, model, training, options, split, rows, search)
    speeds = rebalanced_speeds(parts, rows)
    if speeds is not None:
        rows = batch_rows(training.global_batch, speeds)
        parts = _island_plans(spec, model, training, options, split, rows, search)
    return assemble(spec, training, parts, Islands(sync=sync, inner_steps=1))


def outer_step(inner_steps: int) -> tuple[float, float]:
    """DiLoCo's outer learning rate and momentum for H = ``inner_steps``: the published
    Nesterov step from :data:`LEAST_PUBLISHED_H` on, where its source evaluated it; below,
    plain periodic averaging (outer lr 1, no momentum), the outer step of local SGD (Stich,
    ICLR 2019, arXiv:1805.09767; post-local SGD, Lin et al., ICLR 2020, arXiv:1808.07217),
    which at H = 1 is synchronous data parallelism exactly, where a momentum of 0.9 over the
    inner optimizer's own steps would move the weights up to lr / (1 - momentum) = 7 times
    their mean progress (on the judged CPU runs, README "Training across slow links", it
    cost +160 % to +184 % loss at H = 10 where averaging cost +2.5 % to +6.7 %)."""
    if inner_steps >= LEAST_PUBLISHED_H:
        return DILOCO_OUTER_LR, DILOCO_OUTER_MOMENTUM
    return 1.0, 0.0


def _settings(sync: SyncMethod) -> Iterator[Islands]:
    """Every synchronization of ``sync`` the choice tries."""
    stalenesses = STALENESS if sync is SyncMethod.BOUNDED else (0,)
    fragments = (1,) if sync is SyncMethod.BOUNDED else FRAGMENTS
    for h, compression, f, s in product(INNER_STEPS, Compression, fragments, stalenesses):
        lr, momentum = outer_step(h)
        yield Islands(sync=sync, inner_steps=h, compression=compression, fragments=f, staleness=s,
                      outer_lr=lr, outer_momentum=momentum)


def choose_sync(plan: Plan, split: Split, target_tokens: float, sync: SyncMethod
                ) -> IslandChoice:
    """``plan``'s islands (of ``split``) synchronized the way that reaches
    ``target_tokens``' loss first."""
    cluster = Cluster(plan.cluster)
    inner = predict(replace(plan, islands=replace(plan.islands, sync=sync, inner_steps=1)))
    step_s = inner.iteration_time_s - inner.breakdown.outer_s
    link = between_islands(cluster, island_devices(cluster, plan))
    params = counts.total_params(plan.model)
    tokens_per_step = plan.training.global_batch * plan.training.seq_len
    best: tuple[tuple[float, float], Islands] | None = None
    whole_s = {c: whole_exchange_s(cluster, replace(plan, islands=replace(
        plan.islands, sync=sync, compression=c)), link) for c in Compression}
    for setting in _settings(sync):
        islands = replace(setting, islands=plan.islands.islands)
        exposed = exposed_per_step_s(islands, whole_s[islands.compression], step_s)
        factor = convergence.penalty(islands, params, target_tokens).token_factor
        time_s = time_to_target_s(target_tokens, factor, tokens_per_step / (step_s + exposed))
        key = (time_s, islands.compression.bytes_per_value)  # a tie: the fewer bytes
        if best is None or key < best[0]:
            best = (key, islands)
    assert best is not None
    chosen = replace(plan, islands=best[1])
    chosen = replace(chosen, prediction=predict(chosen))
    check_plan(chosen)
    exchange = outer_exchange(cluster, chosen, step_s)
    return IslandChoice(chosen, split, exchange,
                        convergence.penalty(best[1], params, target_tokens), target_tokens,
                        best[0][0])


def best_islands(spec: ClusterSpec, model: ModelSpec, training: TrainingShape,
                 options: SearchOptions, splits: list[Split], target_tokens: float,
                 search: Search, sync: SyncMethod) -> IslandChoice | None:
    """The fastest to the target over ``splits`` (None: no island fits on any)."""
    best: IslandChoice | None = None
    for split in splits:
        try:
            plan = split_plan(spec, model, training, options, split, search, sync)
        except (ConfigError, InfeasibleError):
            continue  # an island holds too little to train the model
        choice = choose_sync(plan, split, target_tokens, sync)
        if best is None or choice.time_to_target_s < best.time_to_target_s:
            best = choice
    return best


def sync_time_to_target_s(plan: Plan, target_tokens: float) -> float:
    """A synchronous plan's time to ``target_tokens`` (no penalty)."""
    assert plan.prediction is not None
    return time_to_target_s(target_tokens, 1.0, plan.prediction.tokens_per_s)


def _gbps(bytes_per_s: float) -> str:
    return "local" if math.isinf(bytes_per_s) else f"{bytes_per_s * 8 / 1e9:.3g} Gb/s"


def _hours(seconds: float) -> str:
    return "never" if math.isinf(seconds) else f"{seconds / 3600:,.1f} h"


def choice_notes(choice: IslandChoice, sync_s: float | None) -> tuple[str, ...]:
    """What ``potluck plan`` says of a plan with islands: where and why it splits, what the
    exchange moves, what it costs in convergence, and its time to target against sync."""
    islands, split, exchange = choice.plan.islands, choice.split, choice.exchange
    parts = " | ".join(", ".join(machines) for machines in split.islands)
    against = ("" if sync_s is None else
               f" against {_hours(sync_s)} synchronous ({sync_s / choice.time_to_target_s:.2f}x)")
    why = ("" if split.inside_bytes_per_s >= GAP_FACTOR * split.between_bytes_per_s else
           f" (every link between machines under {_gbps(SLOW_LINK_BYTES_PER_S)}: split evenly)")
    if islands.host_staged:
        why = (" (islands of one vendor each: no backend joins two, so they meet through "
               "host memory over gloo)")
    stale = (f" at most {islands.staleness} push(es) stale"
             if islands.sync is SyncMethod.BOUNDED else "")
    return (
        f"islands: {split.count} ({parts}); links inside at least "
        f"{_gbps(split.inside_bytes_per_s)}, between at most {_gbps(split.between_bytes_per_s)}"
        f"{why}",
        f"outer step: {islands.sync.value} every H={islands.inner_steps} steps{stale}, "
        f"{exchange.bytes_per_outer_step / 1e9:.3g} GB per island ({islands.compression.value}, "
        f"{islands.fragments} fragment(s)), {exchange.exchange_s:.3g} s over the slowest link "
        f"between islands, {exchange.exposed_per_step_s * 1e3:.3g} ms exposed per step",
        f"convergence: loss +{choice.penalty.loss_gap:.2%} at equal tokens, so "
        f"{choice.penalty.token_factor:.2f}x tokens to the same loss "
        "(potluck/planner/islands/convergence.py: sources and assumptions)",
        f"time to target ({choice.target_tokens:.3g} tokens): "
        f"{_hours(choice.time_to_target_s)}{against}",
        *choice.penalty.notes,
    )
