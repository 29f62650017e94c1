"""Which node groups train together: every grouping on small labs, a local search that
finds the best on toy scores with a known optimum, and moves that stay within the rules."""

from __future__ import annotations

import itertools
import math

import pytest

from potluck.planner.grouping import (
    all_groupings,
    canonical,
    greedy_seed,
    grouping_count,
    local_search,
    memoized,
    neighbours,
)

NAMES = ("a", "b", "c", "d", "e")


@pytest.mark.parametrize("n, bell", [(1, 1), (2, 2), (3, 5), (4, 15), (5, 52)])
def test_every_grouping_once(n, bell):
    names = NAMES[:n]
    found = list(all_groupings(names))
    assert len(found) == len(set(found)) == grouping_count(n)
    complete = list(all_groupings(names, complete=True))
    assert len(complete) == bell  # every name used: the set partitions
    assert all(sorted(itertools.chain(*g)) == list(names) for g in complete)


def _without(grouping, name):
    return canonical([[n for n in family if n != name] for family in grouping])


def _one_move(before, after) -> bool:
    """One group placed elsewhere (the rest alike without it), or two families merged."""
    if any(_without(before, n) == _without(after, n) for n in NAMES):
        return True
    return len(after) == len(before) - 1 and any(
        canonical([*(f for f in before if f not in pair), (*pair[0], *pair[1])]) == after
        for pair in itertools.combinations(before, 2))


def test_a_move_places_one_group_elsewhere_or_merges_two_families():
    grouping = canonical([("a", "b"), ("c",)])
    found = set(neighbours(grouping, NAMES))
    assert grouping not in found and all(_one_move(grouping, other) for other in found)
    assert canonical([("a", "b", "c")]) in found  # merge
    assert canonical([("a",), ("b",), ("c",)]) in found  # split off
    assert canonical([("a", "b")]) in found  # c left out
    assert canonical([("a", "b"), ("c",), ("d",)]) in found  # d in, alone
    assert canonical([("a", "b", "d"), ("c",)]) in found  # d in, joining


def test_complete_groupings_never_leave_a_group_out():
    grouping = canonical([("a", "b"), ("c",)])
    assert all(set(itertools.chain(*g)) == {"a", "b", "c"}
               for g in neighbours(grouping, ("a", "b", "c"), complete=True))


def _planted(best: tuple[tuple[str, ...], ...]):
    """A score whose optimum is ``best``: each family costs 1 plus 3 per pair of its groups
    not together in ``best``, each group left out 2, each family apart from ``best`` 1."""
    together = {frozenset(p) for family in best for p in itertools.combinations(family, 2)}
    calls: list = []

    def score(grouping):
        calls.append(grouping)
        used = set(itertools.chain(*grouping))
        cost = sum(1 + 3 * sum(frozenset(p) not in together
                               for p in itertools.combinations(f, 2)) for f in grouping)
        cost += 2 * (len(NAMES) - len(used))
        cost += sum(1 for f in grouping if f not in best)
        return float(cost)
    return score, calls


@pytest.mark.parametrize("best", [
    (("a", "b", "c", "d", "e"),),
    (("a", "b"), ("c", "d", "e")),
    (("a",), ("b",), ("c", "d"), ("e",)),
])
def test_local_search_reaches_the_optimum_and_scores_each_grouping_once(best):
    best = canonical(best)
    score, calls = _planted(best)
    exhaustive = min(all_groupings(NAMES), key=score)
    assert exhaustive == best
    scored = memoized(score)
    calls.clear()
    seeds = [canonical([NAMES]), canonical([(n,) for n in NAMES])]
    found = local_search(NAMES, scored, seeds)
    assert found[0][1] == best
    assert len(calls) == len(set(calls))  # memoized: no grouping scored twice
    assert len(calls) < grouping_count(len(NAMES))  # fewer than every grouping


def test_greedy_seed_leaves_out_a_group_that_slows_the_plan():
    def score(grouping):  # 'slow' in any family adds time; others divide the work
        used = list(itertools.chain(*grouping))
        return 12.0 / max(1, len([n for n in used if n != "slow"])) + 5.0 * ("slow" in used)

    seed = greedy_seed(("a", "b", "slow"), memoized(score))
    assert "slow" not in set(itertools.chain(*seed)) and {"a", "b"} <= set(itertools.chain(*seed))


def test_nothing_feasible_is_an_empty_result():
    assert local_search(NAMES, memoized(lambda g: math.inf), [canonical([NAMES])]) == []
