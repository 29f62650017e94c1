"""Scheduling policies as specifications: where jobs go, when they run, what they finish."""

import itertools

import pytest

from potluck.cluster import parse_cluster
from potluck.model import load_model
from potluck.multijob import Job, JobShape, Policy, ThroughputTable, simulate
from potluck.multijob.allocations import candidate_allocations, subcluster
from potluck.multijob.simulation import HOUR_S
from potluck.plans import TrainingShape

# One fast machine (2 A100) and two slow ones (2 RTX 3090 each). The cost model predicts
# gpt3-350m 3.2x faster on the A100s, tiny-llama (overhead-bound) about as fast anywhere.
CLUSTER = parse_cluster("""
name: tiny-lab
nodes:
  - {name: fast, gpu: a100-80g-sxm, gpus_per_node: 2, count: 1}
  - {name: slow, gpu: rtx3090, gpus_per_node: 2, count: 2}
""")


def job(name, model, tokens, arrival_h=0.0, batch=16, seq=2048, priority=1.0):
    shape = JobShape(load_model(model), TrainingShape(batch, seq))
    return Job(name, shape, tokens, arrival_h, priority, model_name=model)


@pytest.fixture(scope="module")
def table():
    return ThroughputTable(CLUSTER)


def mixed_jobs():
    return (job("big", "gpt3-350m", 600_000_000), job("tiny", "tiny-llama", 3_000_000_000, seq=256),
            job("late", "gpt3-125m", 400_000_000, arrival_h=0.2),
            job("last", "tiny-llama", 1_000_000_000, arrival_h=0.5, seq=256))


def test_speedups_of_the_test_jobs_differ_on_the_fast_machine(table):
    """The premise of the placement test: the cost model's speedups on the A100s differ."""
    fast, slow = candidate_allocations(CLUSTER)[:2]
    assert (fast.groups, slow.groups) == (("fast",), ("slow",))
    big, tiny = mixed_jobs()[:2]
    speedup = {j.name: table.tokens_per_s(j.shape, fast) / table.tokens_per_s(j.shape, slow)
               for j in (big, tiny)}
    assert speedup["big"] > 2.5 and speedup["tiny"] < 1.2


@pytest.mark.parametrize("policy", [Policy.THROUGHPUT, Policy.FAIR])
def test_heterogeneity_aware_policies_give_the_fast_gpus_to_the_job_that_gains_most(table, policy):
    result = simulate(mixed_jobs()[:2], table, policy)
    first = {o.job.name: o.segments[0] for o in result.outcomes}
    assert "fast" in first["big"].allocation.groups
    assert "fast" not in first["tiny"].allocation.groups


@pytest.mark.parametrize("policy", list(Policy))
def test_no_machine_is_held_by_two_jobs_at_once(table, policy):
    result = simulate(mixed_jobs(), table, policy)
    held = [(m, s.start_s, s.end_s, o.job.name) for o in result.outcomes for s in o.segments
            for m in s.machines]
    for (m1, start1, end1, j1), (m2, start2, end2, j2) in itertools.combinations(held, 2):
        if m1 == m2 and j1 != j2:
            assert end1 <= start2 + 1e-6 or end2 <= start1 + 1e-6, (m1, j1, j2)


@pytest.mark.parametrize("policy", list(Policy))
def test_every_job_trains_its_tokens_by_its_end_and_no_earlier(table, policy):
    result = simulate(mixed_jobs(), table, policy, restart_s=60.0)
    for outcome in result.outcomes:
        assert sum(s.tokens for s in outcome.segments) == pytest.approx(outcome.job.tokens, rel=1e-6)
        assert outcome.segments[0].start_s >= outcome.job.arrival_h * HOUR_S - 1e-6
        for before, after in itertools.pairwise(outcome.segments):
            assert before.end_s <= after.start_s + 1e-6
        for segment in outcome.segments:  # the restart is paid on every start
            assert segment.training_from_s == pytest.approx(segment.start_s + 60.0)
            assert segment.tokens_per_s == pytest.approx(
                outcome.job.shape.tokens_per_iteration / segment.plan.prediction.iteration_time_s)
    assert result.avg_completion_h == pytest.approx(
        sum(o.end_h - o.job.arrival_h for o in result.outcomes) / len(result.outcomes))
    assert result.makespan_h == pytest.approx(max(o.end_h for o in result.outcomes))


def test_fifo_serves_in_arrival_order_without_moving_anyone(table):
    jobs = (job("first", "gpt3-350m", 400_000_000), job("second", "gpt3-125m", 400_000_000, 0.1),
            job("third", "tiny-llama", 500_000_000, 0.2, seq=256))
    result = simulate(jobs, table, Policy.FIFO)
    starts = [o.start_h for o in result.outcomes]
    assert starts == sorted(starts)
    assert all(len(o.segments) == 1 for o in result.outcomes)
    # alone on an empty cluster, the first job takes the fastest allocation of all
    best = max(table.tokens_per_s(jobs[0].shape, a) for a in table.candidates)
    assert result.outcomes[0].segments[0].tokens_per_s == pytest.approx(best, rel=0.011)


def test_fair_runs_every_job_while_there_are_machines_for_all(table):
    """Three jobs, three machines: max-min fairness gives each one at once, even the job
    whose throughput per machine is the lowest (fifo lets the first take everything)."""
    jobs = (job("a", "gpt3-350m", 2_000_000_000), job("b", "gpt3-350m", 2_000_000_000),
            job("c", "gpt3-125m", 300_000_000))
    fair = simulate(jobs, table, Policy.FAIR)
    assert all(o.start_h == 0.0 for o in fair.outcomes)
    fifo = simulate(jobs, table, Policy.FIFO)
    assert any(o.start_h > 0.0 for o in fifo.outcomes)


def test_priority_weighs_the_fair_share(table):
    """Two alike jobs on the three machines: the one with priority 3 gets the larger share."""
    jobs = (job("low", "gpt3-350m", 2_000_000_000),
            job("high", "gpt3-350m", 2_000_000_000, priority=3.0))
    result = simulate(jobs, table, Policy.FAIR)
    first = {o.job.name: o.segments[0] for o in result.outcomes}
    assert first["high"].tokens_per_s > first["low"].tokens_per_s


def test_equal_shares_ignore_gpu_types(table):
    """Two jobs on three machines: one machine each, taken in the cluster file's order,
    so the first job gets the A100s whatever it gains from them."""
    jobs = (job("tiny", "tiny-llama", 3_000_000_000, seq=256), job("big", "gpt3-350m", 600_000_000))
    result = simulate(jobs, table, Policy.EQUAL)
    first = {o.job.name: o.segments[0] for o in result.outcomes}
    assert first["tiny"].allocation.machines == (("fast", 1),)
    assert first["big"].allocation.machines == (("slow", 1),)


def test_a_subcluster_holds_only_the_allocated_machines():
    allocation = candidate_allocations(CLUSTER)[-1]  # everything
    part = subcluster(CLUSTER, type(allocation)((("slow", 1),)))
    assert [(g.name, g.count) for g in part.nodes] == [("slow", 1)]
    assert [t.name for t in part.device_types] == ["rtx3090"]
    assert allocation.num_gpus(CLUSTER) == CLUSTER.num_gpus


def test_jct_lets_a_short_job_that_arrives_later_pass_a_long_one(table):
    """Shortest remaining time first: two alike jobs want the A100s; the short one arriving
    later takes them from the long one and finishes first, and the average completion time
    is below fifo's, which makes it wait or run slower."""
    jobs = (job("long", "gpt3-350m", 3_000_000_000), job("short", "gpt3-350m", 200_000_000, 0.1))
    jct = simulate(jobs, table, Policy.JCT)
    by_name = {o.job.name: o for o in jct.outcomes}
    assert "fast" in by_name["short"].segments[0].allocation.groups
    assert by_name["short"].end_h < by_name["long"].end_h
    assert len(by_name["long"].segments) > 1  # it was moved off the A100s, then back
    assert jct.avg_completion_h < simulate(jobs, table, Policy.FIFO).avg_completion_h


def test_jct_waits_for_the_fast_machine_when_that_finishes_a_job_sooner(table):
    """A job 3x faster on the A100s, arriving while a nearly done job holds them, waits for
    them rather than start on the 3090s; a job as fast anywhere does not wait."""
    nearly_done = job("nearly-done", "gpt3-350m", 50_000_000)
    waits = simulate((nearly_done, job("gains", "gpt3-350m", 2_000_000_000, 0.01)), table,
                     Policy.JCT)
    first = {o.job.name: o for o in waits.outcomes}
    assert first["gains"].segments[0].allocation.groups == ("fast",)
    assert first["gains"].start_h == pytest.approx(first["nearly-done"].end_h)
    starts = simulate((nearly_done, job("indifferent", "tiny-llama", 2_000_000_000, 0.01, seq=256)),
                      table, Policy.JCT)
    other = {o.job.name: o for o in starts.outcomes}["indifferent"]
    assert other.start_h == pytest.approx(0.01) and "fast" not in other.segments[0].allocation.groups


def test_jct_charges_the_restart_so_a_small_gain_moves_nobody(table):
    """With restarts dear (10 h), the running job is never moved for the later, shorter one."""
    jobs = (job("long", "gpt3-350m", 3_000_000_000), job("short", "gpt3-350m", 200_000_000, 0.1))
    result = simulate(jobs, table, Policy.JCT, restart_s=36_000.0)
    assert all(len(o.segments) == 1 for o in result.outcomes)
