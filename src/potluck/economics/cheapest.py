"""``potluck plan --objective cost``: the plan, and the share of the user's devices, cheapest per token.

An outer loop around the search. It plans every sub-cluster of the user's
cluster: each subset of node groups and, where a group has several machines,
fewer of them (1, 2, 4, ... and all; whole groups only when that would make
more than ``MAX_SUB_CLUSTERS`` searches). Every plan found is priced with the
GPUs it uses (:mod:`potluck.economics.prices`); the cheapest per token that
trains the tokens by the deadline wins. A device that is slow for its price
does not pay for itself and is left out, and the plan's notes say so with the
figures: the cheapest plan that does use it and what it would cost.

The chosen plan is re-homed onto the whole cluster (same device ids, the rest
listed as unused), so it runs with the user's cluster file.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from potluck.cluster.spec import ClusterSpec
from potluck.cluster.topology import Cluster
from potluck.economics.figures import CostFigures, cheapest, plan_figures
from potluck.economics.prices import Pricing
from potluck.errors import ConfigError, InfeasibleError
from potluck.model.spec import ModelSpec
from potluck.planner.cost import CostModel
from potluck.planner.evaluate import predict
from potluck.planner.options import SearchOptions
from potluck.planner.requests.host_limit import search_explained
from potluck.planner.search import SearchResult, search
from potluck.plans import Plan, TrainingShape
from potluck.units import positive_number

log = logging.getLogger(__name__)

MAX_SUB_CLUSTERS = 64
PER_TOKEN_ONLY_TOKENS = 10**9  # figures need a run length; without --tokens only per-token ones are used

Counts = tuple[tuple[str, int], ...]  # (group name, machines kept), groups left out absent


@dataclass(frozen=True)
class _Option:
    counts: Counts
    plan: Plan  # on the sub-cluster
    figures: CostFigures


def plan_cheapest(spec: ClusterSpec, model: ModelSpec, training: TrainingShape,
                  options: SearchOptions | None = None, pricing: Pricing | None = None,
                  tokens: int | None = None, deadline_hours: float | None = None,
                  progress: Callable[[float], None] | None = None) -> SearchResult:
    """The cheapest plans per token over all sub-clusters of ``spec``, cheapest first."""
    options, pricing = options or SearchOptions(), pricing or Pricing()
    if deadline_hours is not None and tokens is None:
        raise ConfigError("--deadline-hours needs --tokens: how many tokens to train by then")
    started = time.perf_counter()
    subs = _sub_clusters(spec, options.groups)
    found, searched = _search_all(spec, subs, model, training, options, pricing,
                                  tokens or PER_TOKEN_ONLY_TOKENS, progress)
    if not found:
        search_explained(spec, model, training, options)  # raises the search's explanation
        raise InfeasibleError(f"no plan of {model.name} fits any part of cluster {spec.name!r}")
    best = cheapest([(o, o.figures) for o in found], deadline_hours)
    if best is None:
        fastest = min(found, key=lambda o: o.figures.hours_to_train).plan
        raise InfeasibleError(deadline_message(fastest, tokens or 0, deadline_hours or 0.0))
    ranked = _ranked(found, deadline_hours, options.top_k)
    cost = CostModel.for_training(Cluster(spec), model, training)
    plans = tuple(_rehome(o.plan, spec, cost, _notes(o, found, spec, deadline_hours)) for o in ranked)
    notes = (f"objective cost: searched {len(subs)} sub-clusters "
             f"for the lowest USD per token ({pricing.describe()})",)
    return SearchResult(plans, searched, time.perf_counter() - started, notes)


def _search_all(spec: ClusterSpec, subs: list[Counts], model: ModelSpec, training: TrainingShape,
                options: SearchOptions, pricing: Pricing, tokens: int,
                progress: Callable[[float], None] | None) -> tuple[list[_Option], int]:
    found: list[_Option] = []
    searched = 0
    for index, counts in enumerate(subs):
        try:
            result = search(restrict(spec, counts), model, training, replace(options, groups=None))
        except InfeasibleError:
            log.debug("sub-cluster %s cannot train %s", counts, model.name)
        else:
            searched += result.candidates
            found.extend(_Option(counts, p, plan_figures(p, pricing, tokens)) for p in result.plans)
        if progress is not None:
            progress((index + 1) / len(subs))
    return found, searched


def _sub_clusters(spec: ClusterSpec, groups: tuple[str, ...] | None) -> list[Counts]:
    """Every non-empty choice of groups and machines per group, whole groups only if too many."""
    names = [g for g in spec.nodes if groups is None or g.name in groups]
    partial = [[0, *machine_counts(g.count)] for g in names]
    whole = [[0, g.count] for g in names]
    choices = partial if _product(partial) - 1 <= MAX_SUB_CLUSTERS else whole
    if _product(choices) - 1 > MAX_SUB_CLUSTERS:
        log.warning("planning %d sub-clusters; this may take a while", _product(choices) - 1)
    subs = []
    for kept in itertools.product(*choices):
        counts = tuple((g.name, k) for g, k in zip(names, kept, strict=True) if k)
        if counts:
            subs.append(counts)
    return subs


def machine_counts(count: int) -> list[int]:
    """Machines of a group to try: 1, 2, 4, ... and all of them."""
    return sorted({2**k for k in range(count.bit_length()) if 2**k <= count} | {count})


def _product(lists: list[list[int]]) -> int:
    total = 1
    for values in lists:
        total *= len(values)
    return total


def restrict(spec: ClusterSpec, counts: Counts) -> ClusterSpec:
    """``spec`` with only the groups in ``counts``, each with its first ``k`` machines."""
    kept = dict(counts)
    nodes = tuple(replace(g, count=kept[g.name]) for g in spec.nodes if g.name in kept)
    used_types = {g.gpu for g in nodes}
    return replace(
        spec, nodes=nodes,
        device_types=tuple(t for t in spec.device_types if t.name in used_types),
        links=tuple(link for link in spec.links if set(link.between) <= set(kept)),
    )


def _ranked(found: list[_Option], deadline_hours: float | None, top_k: int) -> list[_Option]:
    eligible = [o for o in found if o.figures.meets(deadline_hours)]
    eligible.sort(key=lambda o: (o.figures.usd_per_million_tokens, o.figures.hours_to_train))
    seen, ranked = set(), []
    for option in eligible:
        key = (option.plan.layout(), option.plan.devices, option.plan.pipelines[0].micro_batch_size,
               option.plan.recompute)
        if key not in seen:
            seen.add(key)
            ranked.append(option)
    return ranked[:top_k]


def _rehome(plan: Plan, spec: ClusterSpec, cost: CostModel, notes: tuple[str, ...]) -> Plan:
    """The plan on the whole cluster: the devices it does not use listed as unused."""
    used = set(plan.devices)
    unused = tuple(d.id for d in Cluster(spec).devices if d.id not in used)
    moved = replace(plan, cluster=spec, unused_devices=unused, notes=notes, prediction=None)
    return replace(moved, prediction=predict(moved, cost))


def _used_per_group(plan: Plan) -> dict[str, int]:
    cluster = Cluster(plan.cluster)
    used: dict[str, int] = {}
    for device_id in plan.devices:
        group = cluster.device(device_id).group
        used[group] = used.get(group, 0) + 1
    return used


def _notes(chosen: _Option, found: list[_Option], spec: ClusterSpec,
           deadline_hours: float | None) -> tuple[str, ...]:
    """Why each group's left-out devices are left out."""
    used = _used_per_group(chosen.plan)
    notes = []
    for group in spec.nodes:
        left_out = group.num_gpus - used.get(group.name, 0)
        if left_out == 0:
            continue
        with_more = [o for o in found if _used_per_group(o.plan).get(group.name, 0) > used.get(group.name, 0)]
        what = f"{left_out} of {group.num_gpus} {group.gpu} GPUs of {group.name} left out: "
        notes.append(what + _reason(chosen, with_more, deadline_hours))
    return tuple(notes)


def _reason(chosen: _Option, with_more: list[_Option], deadline_hours: float | None) -> str:
    if not with_more:
        return "no plan that uses them fits in memory or runs faster"
    alternative = cheapest([(o, o.figures) for o in with_more], deadline_hours)
    if alternative is None:
        return "every plan that uses them misses the deadline"
    theirs, ours = alternative[1], chosen.figures
    return (
        f"they do not pay for themselves: the cheapest plan with them costs "
        f"${theirs.usd_per_million_tokens:.4g} per million tokens (${theirs.usd_per_hour:.2f}/h), "
        f"this one ${ours.usd_per_million_tokens:.4g} (${ours.usd_per_hour:.2f}/h)"
    )


def deadline_message(fastest: Plan, tokens: int, deadline_hours: float) -> str:
    """One line: no plan trains the tokens in time, and how long the fastest takes."""
    assert fastest.prediction is not None
    hours = tokens / fastest.prediction.tokens_per_s / 3600.0
    return (
        f"no plan trains {tokens:,} tokens within {deadline_hours:g} h: the fastest "
        f"({fastest.layout()} on {fastest.num_gpus} GPUs, {fastest.prediction.tokens_per_s:,.0f} "
        f"tokens/s) takes {hours:.1f} h; allow more time, train fewer tokens or add GPUs"
    )


def check_deadline(result: SearchResult, tokens: int | None, deadline_hours: float | None) -> None:
    """For the time objective: raise InfeasibleError when even the fastest plan is too slow."""
    if deadline_hours is None:
        return
    positive_number(deadline_hours, "--deadline-hours")
    if tokens is None:
        raise ConfigError("--deadline-hours needs --tokens: how many tokens to train by then")
    prediction = result.best.prediction
    assert prediction is not None
    if tokens / prediction.tokens_per_s / 3600.0 > deadline_hours:
        raise InfeasibleError(deadline_message(result.best, tokens, deadline_hours))
