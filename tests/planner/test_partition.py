"""The uneven splits are exact: compared with brute force on random small instances."""

import itertools
import random

import pytest

from potluck.planner.partition import PipelineSlot, StageSlot, split_layers, split_micro_batches


def _compositions(total, parts, low=1):
    for cuts in itertools.combinations(range(1, total), parts - 1):
        sizes = [b - a for a, b in zip((0, *cuts), (*cuts, total), strict=True)]
        if min(sizes) >= low:
            yield sizes


def _period(slots, layers):
    return max(s.time_s(n) for s, n in zip(slots, layers, strict=True))


def _recomputing_slot(rng, layers):
    """A stage that keeps activations while they fit and recomputes the fewest blocks else."""
    kept, freed = rng.uniform(1, 3), rng.uniform(0.2, 0.9)
    spare = rng.uniform(0, layers * kept)
    return StageSlot(rng.uniform(0.5, 3.0), rng.uniform(0, 2), int(spare // (kept - freed)),
                     recompute_s=rng.uniform(0.1, 1.5), spare_bytes=spare, kept_bytes=kept,
                     freed_bytes=freed)


@pytest.mark.parametrize("seed", range(40))
def test_layer_split_minimizes_the_slowest_stage(seed):
    rng = random.Random(seed)
    stages, layers = rng.randint(1, 4), rng.randint(4, 12)
    slots = [StageSlot(rng.uniform(0.5, 3.0), rng.choice([0.0, rng.uniform(0, 4)]),
                       rng.randint(1, layers)) for _ in range(stages)]
    feasible = [c for c in _compositions(layers, stages)
                if all(n <= s.max_layers for n, s in zip(c, slots, strict=True))]
    result = split_layers(slots, layers)
    if not feasible:
        assert result is None
        return
    best = min(_period(slots, c) for c in feasible)
    assert sum(result) == layers and all(n >= 1 for n in result)
    assert all(n <= s.max_layers for n, s in zip(result, slots, strict=True))
    assert _period(slots, result) == pytest.approx(best)


@pytest.mark.parametrize("seed", range(40))
def test_layer_split_with_stages_that_recompute_what_must_is_exact(seed):
    rng = random.Random(seed)
    stages, layers = rng.randint(1, 4), rng.randint(4, 12)
    slots = [_recomputing_slot(rng, layers) if rng.random() < 0.7 else
             StageSlot(rng.uniform(0.5, 3.0), 0.0, rng.randint(1, layers)) for _ in range(stages)]
    feasible = [c for c in _compositions(layers, stages)
                if all(n <= s.max_layers for n, s in zip(c, slots, strict=True))]
    result = split_layers(slots, layers)
    if not feasible:
        assert result is None
        return
    assert sum(result) == layers
    assert _period(slots, result) == pytest.approx(min(_period(slots, c) for c in feasible))


def test_a_stage_recomputes_only_the_blocks_that_do_not_fit():
    # 10 bytes spare, 3 a block kept, 2 freed by recomputing one: 3 blocks fit as they are,
    # a 4th needs one recomputed (12 - 2 <= 10), a 5th two (15 - 4 > 10: three)
    slot = StageSlot(1.0, 0.5, 10, recompute_s=0.25, spare_bytes=10, kept_bytes=3, freed_bytes=2)
    assert [slot.recomputed(n) for n in range(7)] == [0, 0, 0, 0, 1, 3, 4]
    assert slot.time_s(5) == pytest.approx(0.5 + 5 * 1.0 + 3 * 0.25)


def test_layers_go_in_proportion_to_speed():
    assert split_layers([StageSlot(1.0, 0, 99), StageSlot(2.0, 0, 99)], 12) == [8, 4]


def test_memory_caps_move_layers_to_slower_stages():
    assert split_layers([StageSlot(1.0, 0, 5), StageSlot(2.0, 0, 99)], 12) == [5, 7]


def test_uniform_split_is_even_and_respects_memory():
    assert split_layers([StageSlot(1.0, 0, 99), StageSlot(5.0, 0, 99)], 9, uniform=True) == [5, 4]
    assert split_layers([StageSlot(1.0, 0, 3), StageSlot(5.0, 0, 99)], 9, uniform=True) is None


def _slowest(slots, shares):
    return max(s.fill_s + m * s.period_s for s, m in zip(slots, shares, strict=True) if m)


@pytest.mark.parametrize("seed", range(40))
def test_micro_batch_split_minimizes_the_slowest_pipeline(seed):
    rng = random.Random(seed)
    count, total = rng.randint(1, 4), rng.randint(1, 12)
    slots = [PipelineSlot(rng.uniform(0, 3), rng.uniform(0.5, 3)) for _ in range(count)]
    best = min(_slowest(slots, c) for c in itertools.product(range(total + 1), repeat=count)
               if sum(c) == total)
    result = [share[0] for share in split_micro_batches(slots, total)]
    assert sum(result) == total
    assert _slowest(slots, result) == pytest.approx(best)


def test_replicas_of_a_slot_differ_by_at_most_one():
    shares = split_micro_batches([PipelineSlot(0.0, 1.0, replicas=3), PipelineSlot(0.0, 2.0)], 10)
    assert sum(map(sum, shares)) == 10
    assert max(shares[0]) - min(shares[0]) <= 1


def test_a_pipeline_that_only_slows_the_batch_gets_nothing():
    shares = split_micro_batches([PipelineSlot(100.0, 1.0), PipelineSlot(0.0, 1.0)], 12)
    assert shares == [[0], [12]]


def test_uniform_batch_split_needs_divisibility():
    assert split_micro_batches([PipelineSlot(0, 1), PipelineSlot(0, 3)], 8, uniform=True) == [[4], [4]]
    assert split_micro_batches([PipelineSlot(0, 1), PipelineSlot(0, 3)], 7, uniform=True) is None


@pytest.mark.parametrize("seed", range(20))
def test_a_minimum_per_pipeline_still_minimizes_the_slowest_one(seed):
    rng = random.Random(seed)
    count, minimum = rng.randint(1, 4), rng.randint(1, 3)
    total = rng.randint(count * minimum, 14)
    slots = [PipelineSlot(rng.uniform(0, 3), rng.uniform(0.5, 3)) for _ in range(count)]
    best = min(_slowest(slots, c) for c in itertools.product(range(minimum, total + 1), repeat=count)
               if sum(c) == total)
    result = [share[0] for share in split_micro_batches(slots, total, minimum=minimum)]
    assert sum(result) == total and min(result) >= minimum
    assert _slowest(slots, result) == pytest.approx(best)


def test_a_minimum_the_total_cannot_give_every_pipeline_is_refused():
    assert split_micro_batches([PipelineSlot(0, 1, replicas=3)], 5, minimum=2) is None
    assert split_micro_batches([PipelineSlot(9, 1), PipelineSlot(0, 1)], 4, minimum=2) == [[2], [2]]


def test_no_pipeline_gets_more_than_its_slot_holds():
    """The fast pipeline would take 9 of 12; its memory holds 6."""
    slots = [PipelineSlot(0.0, 1.0, most=6), PipelineSlot(0.0, 3.0)]
    assert split_micro_batches(slots, 12) == [[6], [6]]
    assert split_micro_batches(slots, 12, minimum=2) == [[6], [6]]
    assert split_micro_batches([PipelineSlot(0.0, 1.0, replicas=2, most=3)], 7) is None


def _bisected_counts(slots, total):
    """The micro-batch counts of a bisection run to the end (1e-12), without stopping early."""
    from potluck.planner.partition import _count_within

    low = min(s.fill_s + s.period_s for s in slots)
    high = max(s.fill_s + -(-total // s.replicas) * s.period_s for s in slots)
    for _ in range(200):
        if high - low <= 1e-12 * max(1.0, high):
            break
        mid = 0.5 * (low + high)
        if sum(_count_within(s, mid) for s in slots) >= total:
            high = mid
        else:
            low = mid
    return [_count_within(s, high) for s in slots]


@pytest.mark.parametrize("seed", range(60))
def test_the_bisection_stops_early_only_where_its_counts_are_decided(seed):
    """Replicas, caps and equal slots (steps at the same moment) included."""
    from potluck.planner.partition import _spread, _trim_totals

    rng = random.Random(seed)
    slots = [PipelineSlot(rng.choice([0.0, rng.uniform(0, 3)]), rng.choice([1.0, rng.uniform(0.5, 3)]),
                          rng.randint(1, 3), rng.choice([None, rng.randint(2, 40)]))
             for _ in range(rng.randint(1, 4))]
    slots += slots[:rng.randint(0, 1)]
    total = rng.randint(1, min(64, sum(s.replicas * (s.most or 64) for s in slots)))
    counts = _trim_totals(slots, _bisected_counts(slots, total), total)
    expected = [_spread(count, slot.replicas) for count, slot in zip(counts, slots, strict=True)]
    assert split_micro_batches(slots, total) == expected
