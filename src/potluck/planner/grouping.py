"""Which node groups train together: the groupings of a candidate plan.

A candidate plan puts each node group it uses into one *family* (groups whose units form
identical pipelines, :mod:`potluck.planner.families`; families run side by side as
data-parallel replicas) and leaves the other groups out. A *grouping* says which: a
tuple of families, each a sorted tuple of group names, in a canonical order.

On a lab of a few node groups every grouping is scored (:func:`all_groupings`: for ``n``
groups Bell(n+1) - 1 of them, 202 for five). The count explodes beyond that (21,146 for
eight groups, about 10^10 for sixteen), which is what real labs of distinct machines have,
so :func:`local_search` walks them instead: from seeds (every group in one family, every
group alone, and a greedy insertion of the groups fastest first), it moves one group at a
time to another family, to a family of its own or out of the plan, and merges two
families, keeping a beam of the best groupings, until no move improves on them. Scores
are memoized (:func:`memoized`), so a grouping reached twice is scored once; the families'
own evaluations are memoized by the caller (a family recurs in many groupings).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence

Grouping = tuple[tuple[str, ...], ...]
Score = Callable[[Grouping], float]

EXHAUSTIVE_GROUPINGS = 250  # up to five node groups (202 groupings): score every grouping
LOCAL_BEAM = 6  # groupings carried from one round of moves to the next


def canonical(families: Sequence[Sequence[str]]) -> Grouping:
    """``families`` as a grouping: empty families dropped, names and families sorted."""
    return tuple(sorted(tuple(sorted(family)) for family in families if family))


def grouping_count(groups: int) -> int:
    """How many groupings ``groups`` node groups have: Bell(groups + 1) - 1 (every non-empty
    subset used, split into families every way)."""
    row = [1]
    for _ in range(groups + 1):  # Bell triangle
        nxt = [row[-1]]
        for value in row:
            nxt.append(nxt[-1] + value)
        row = nxt
    return row[0] - 1


def all_groupings(names: tuple[str, ...], complete: bool = False) -> Iterator[Grouping]:
    """Every grouping of ``names``: each non-empty subset (``complete``: all of them), split
    into families every way."""
    for size in ([len(names)] if complete else range(1, len(names) + 1)):
        for used in itertools.combinations(names, size):
            for families in _set_partitions(used):
                yield canonical(families)


def _set_partitions(items: tuple[str, ...]) -> Iterator[list[tuple[str, ...]]]:
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in _set_partitions(rest):
        yield [(first,), *partition]
        for index in range(len(partition)):
            merged = list(partition)
            merged[index] = (first, *partition[index])
            yield merged


def neighbours(grouping: Grouping, names: tuple[str, ...], complete: bool = False
               ) -> Iterator[Grouping]:
    """Groupings one move away: a group moved to another family, to a family of its own or
    (unless ``complete``: every group used) out of the plan; an unused group put into a
    family or alone; two families merged."""
    families = [list(f) for f in grouping]
    used = {name for family in grouping for name in family}
    for name in names:
        source = next((i for i, f in enumerate(families) if name in f), None)
        rest = [[n for n in f if n != name] for f in families]
        targets = [i for i in range(len(families)) if i != source]
        for target in targets:
            moved = [list(f) for f in rest]
            moved[target].append(name)
            yield canonical(moved)
        if source is not None:
            if len(families[source]) > 1:
                yield canonical([*rest, [name]])
            if not complete:
                yield canonical(rest)
        elif name not in used:
            yield canonical([*families, [name]])
    for i, j in itertools.combinations(range(len(families)), 2):
        merged = [f for k, f in enumerate(families) if k not in (i, j)]
        yield canonical([*merged, families[i] + families[j]])


def greedy_seed(names_by_speed: tuple[str, ...], score: Score) -> Grouping:
    """Groups inserted fastest first, each where the grouping scores best: into a family,
    alone, or (once some grouping scores) out of the plan."""
    grouping: Grouping = ()
    for name in names_by_speed:
        options = [canonical([*grouping, (name,)])]
        options += [canonical([*grouping[:i], (*family, name), *grouping[i + 1:]])
                    for i, family in enumerate(grouping)]
        scored = [(score(option), index, option) for index, option in enumerate(options)]
        best_s, _, best = min(scored)
        if grouping and score(grouping) <= best_s and math.isfinite(score(grouping)):
            continue  # faster without it
        grouping = best
    return grouping


def memoized(score: Score) -> Score:
    """``score`` called once per grouping (the empty grouping scores infinite)."""
    scores: dict[Grouping, float] = {}

    def scored(grouping: Grouping) -> float:
        if grouping not in scores:
            scores[grouping] = score(grouping) if grouping else math.inf
        return scores[grouping]

    scored.scores = scores  # type: ignore[attr-defined]
    return scored


def local_search(names: tuple[str, ...], score: Score, seeds: Sequence[Grouping], *,
                 complete: bool = False, beam: int = LOCAL_BEAM, rounds: int | None = None,
                 progress: Callable[[float], None] | None = None
                 ) -> list[tuple[float, Grouping]]:
    """The best groupings (score, grouping), best first, reached by moves from ``seeds``:
    each round scores every neighbour of the beam's groupings and keeps the ``beam`` best
    seen; it stops when a round improves none of them (or after ``rounds``). Infinite
    scores are infeasible groupings; give a :func:`memoized` score, as a grouping is
    reached many times."""
    current = _best(((score(s), s) for s in dict.fromkeys(seeds)), beam)
    done = 0
    while current and (rounds is None or done < rounds):
        done += 1
        if progress:
            progress(1.0 - 0.5 ** done)
        frontier = [(score(n), n) for _, g in current for n in neighbours(g, names, complete)]
        improved = _best([*current, *frontier], beam)
        if improved == current:
            break
        current = improved
    return current


def _best(items: Iterable[tuple[float, Grouping]], beam: int) -> list[tuple[float, Grouping]]:
    """The ``beam`` best finite (score, grouping) pairs, each grouping once."""
    finite = {grouping: s for s, grouping in items if math.isfinite(s)}
    return heapq.nsmallest(beam, ((s, grouping) for grouping, s in finite.items()))
