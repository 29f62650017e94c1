"""``potluck plan --sync``: a plan with islands, a synchronous one, or the faster to target.

- ``sync``: today's search, no islands.
- ``diloco`` / ``bounded``: the best plan with islands (:mod:`.choose`) over the cluster's
  candidate splits (:func:`.split.candidate_splits`, even splits allowed on any network); a
  cluster of one machine has nothing to split (one-line error).
- ``auto`` (the default): with ``--zero 3`` (it does not run across islands) or ``--dp``
  (a count of every pipeline) pinned, or on a cluster without slow links (:func:`.split.has_slow_links`),
  today's search alone, at no extra cost; else both, and the faster to the target loss
  (synchronous training's loss after ``target_tokens``, by default Chinchilla's 20 tokens
  per parameter) first, the other's time said in a note.
- a cluster of several vendors (NVIDIA, AMD, CPUs): ``auto`` takes islands of one vendor
  each, meeting through host memory (:func:`.split.candidate_splits`), without comparing a
  synchronous plan, which no backend runs (``--sync sync`` is a one-line error); where no
  such island holds the model (or a pin rules islands out), today's search, its plan noted
  as one that runs only emulated where it sums across vendors every step (a pipeline whose
  stages span vendors runs, host-staged, and its sends are priced so).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from potluck.cluster.spec import ClusterSpec
from potluck.cluster.topology import Cluster
from potluck.errors import ConfigError, InfeasibleError
from potluck.model import counts
from potluck.model.spec import ModelSpec
from potluck.planner.islands.choose import (
    IslandChoice,
    best_islands,
    choice_notes,
    sync_time_to_target_s,
)
from potluck.planner.islands.convergence import default_tokens
from potluck.planner.islands.split import candidate_splits, machines, mixes_vendors
from potluck.planner.options import SearchOptions
from potluck.planner.search import SearchResult, search
from potluck.plans import Plan, TrainingShape
from potluck.plans.islands import SyncMethod
from potluck.plans.vendors import vendors_problem

SyncSearch = Callable[[], SearchResult]


def target_tokens(model: ModelSpec, options: SearchOptions) -> float:
    """The tokens whose synchronous loss is the target: the pinned count, else Chinchilla's."""
    return options.target_tokens or default_tokens(counts.total_params(model))


def island_search(spec: ClusterSpec, model: ModelSpec, training: TrainingShape,
                  options: SearchOptions) -> Plan:
    """Today's search's best plan: the layout of one island (``spec`` its devices only)."""
    return search(spec, model, training, replace(options, top_k=1)).best


def plan_islands(spec: ClusterSpec, model: ModelSpec, training: TrainingShape,
                 options: SearchOptions, sync_search: SyncSearch) -> SearchResult:
    """The plans ``options.sync`` asks for (see the module docstring); ``sync_search`` runs
    today's search."""
    sync = options.sync
    cluster = Cluster(spec)
    mixed = mixes_vendors(cluster)
    if sync is SyncMethod.SYNC:
        if mixed:
            raise ConfigError(f"--sync sync joins every machine of {spec.name!r} every step, "
                              "but its vendors share no backend; use --sync auto, diloco or "
                              "bounded (islands of one vendor each, through host memory)")
        return sync_search()
    refusal = _pin_refusal(options)
    if refusal:
        if sync is None:
            return _one_job(sync_search(), mixed)
        raise ConfigError(f"--sync {sync.value} {refusal}")
    if sync is not None and len(machines(cluster)) < 2:
        raise ConfigError(f"--sync {sync.value} splits the cluster into islands of machines, "
                          f"but {spec.name!r} has one machine; use --sync sync or auto")
    splits = candidate_splits(cluster, forced=sync is not None)
    if not splits:
        return sync_search()
    target = target_tokens(model, options)
    choice = best_islands(spec, model, training, options, splits, target, island_search,
                          sync or SyncMethod.DILOCO)
    if sync is not None:
        if choice is None:
            raise InfeasibleError(f"no split of {spec.name!r} into islands holds the model in "
                                  "every island; use --sync sync or auto")
        return _islands_result(choice, None, None)
    if mixed:
        return _islands_result(choice, None, None) if choice is not None else \
            _one_job(sync_search(), mixed)
    return _auto(choice, sync_search, target)


def _one_job(result: SearchResult, mixed: bool) -> SearchResult:
    """``result``, with a note where its best plan joins two vendors every step (a plan
    that runs only emulated: no island of one vendor holds the model, or a pin rules
    islands out)."""
    problem = vendors_problem(result.best) if mixed else None
    if problem is None:
        return result
    note = ("no island of one vendor could train the model, so this plan joins vendors "
            "every step and runs only emulated (--emulate): " + problem)
    return replace(result, notes=(*result.notes, note))


def _pin_refusal(options: SearchOptions) -> str | None:
    """Why a pin rules islands out (``auto`` then plans synchronously), if one does."""
    if options.zero == 3:
        return ("and --zero 3 do not go together (FSDP2 gathers every step, across islands "
                "too); use --zero 2 or fewer")
    if options.dp is not None:
        return ("and --dp do not go together (--dp counts every pipeline; each island's is "
                "the search's); leave --dp out")
    return None


def _auto(choice: IslandChoice | None, sync_search: SyncSearch, target: float) -> SearchResult:
    """The faster to ``target`` of ``choice`` and today's best plan."""
    try:
        synchronous = sync_search()
    except (ConfigError, InfeasibleError):
        if choice is None:
            raise
        return _islands_result(choice, None, None)
    if choice is None:
        return synchronous
    sync_s = sync_time_to_target_s(synchronous.best, target)
    if choice.time_to_target_s < sync_s:
        return _islands_result(choice, synchronous, sync_s)
    note = (f"islands considered ({choice.plan.islands.count}, {choice.plan.islands.sync.value} "
            f"H={choice.plan.islands.inner_steps}): {choice.time_to_target_s / 3600:,.1f} h "
            f"to target against {sync_s / 3600:,.1f} h synchronous; synchronous kept")
    return replace(synchronous, notes=(*synchronous.notes, note))


def _islands_result(choice: IslandChoice, synchronous: SearchResult | None,
                    sync_s: float | None) -> SearchResult:
    best = replace(choice.plan, notes=(*choice.plan.notes, *choice_notes(choice, sync_s)))
    others = synchronous.plans[:-1] if synchronous is not None else ()
    candidates = synchronous.candidates if synchronous is not None else 0
    time_s = synchronous.search_time_s if synchronous is not None else 0.0
    return SearchResult((best, *others), candidates, time_s)
