"""Synthetic job traces, and every policy run on one trace.

:func:`synthetic_trace` draws ``n`` jobs from a size mix of preset models (:data:`MIX`:
GPT-3 350M to LLaMA-2 13B, each with its batch, sequence length and a few token counts)
arriving as a Poisson process, one every ``ARRIVAL_GAP_MACHINE_H / machines`` hours on
average, about the pace at which the mix's work fills a cluster of that many machines
(arrivals faster than the cluster drains make every policy queue; slower, and none has
to choose). Only the mix's entries that fit somewhere on the cluster are drawn. The same
seed gives the same trace.

:func:`compare_policies` runs every policy on the same trace with one shared
:class:`~potluck.multijob.throughput.ThroughputTable`, so each (job shape, allocation) is
planned once for all of them.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from potluck.cluster.execution import Execution
from potluck.errors import ConfigError, InfeasibleError
from potluck.model.loading import load_model
from potluck.multijob.jobs import Job, JobShape
from potluck.multijob.policies import Policy
from potluck.multijob.simulation import DEFAULT_RESTART_S, ScheduleResult, simulate
from potluck.multijob.throughput import ThroughputTable
from potluck.plans import TrainingShape


@dataclass(frozen=True)
class MixEntry:
    """One kind of job of the trace's size mix."""

    model: str
    global_batch: int
    seq_len: int
    tokens: tuple[int, ...]  # one is drawn per job
    weight: float


MIX = (
    MixEntry("gpt3-350m", 64, 2048, (500_000_000, 1_000_000_000, 2_000_000_000), 0.30),
    MixEntry("gpt3-1.3b", 128, 2048, (1_000_000_000, 2_000_000_000, 5_000_000_000), 0.30),
    MixEntry("gpt3-2.7b", 128, 2048, (1_000_000_000, 2_000_000_000, 4_000_000_000), 0.20),
    MixEntry("llama2-7b", 64, 4096, (1_000_000_000, 2_000_000_000), 0.15),
    MixEntry("llama2-13b", 128, 4096, (500_000_000, 1_000_000_000), 0.05),
)
# Every policy replays the trace; 2,000 jobs on the 14-GPU example lab take 233 s of policy
# runs on 2 cores (`potluck schedule -c examples/mixed.yaml --trace 2000`), more than linearly.
MAX_TRACE_JOBS = 2000
ARRIVAL_GAP_MACHINE_H = 16.0  # mean hours between arrivals, times the cluster's machines


def synthetic_trace(table: ThroughputTable, n: int, seed: int = 0,
                    execution: Execution | None = None,
                    mix: tuple[MixEntry, ...] = MIX) -> tuple[Job, ...]:
    """``n`` jobs drawn from ``mix`` with Poisson arrivals (see the module docstring)."""
    check_trace_size(n)
    shapes = _fitting_shapes(table, execution or Execution(), mix)
    rng = random.Random(seed)
    machines = sum(group.count for group in table.spec.nodes)
    gap_h = ARRIVAL_GAP_MACHINE_H / machines
    entries, shapes_in_order = list(shapes), list(shapes.values())
    weights = [entry.weight for entry in entries]
    jobs, now_h = [], 0.0
    for index in range(n):
        pick = rng.choices(range(len(entries)), weights)[0]
        entry = entries[pick]
        jobs.append(Job(f"j{index:03d}-{entry.model}", shapes_in_order[pick],
                        rng.choice(entry.tokens), round(now_h, 4), model_name=entry.model))
        now_h += rng.expovariate(1.0 / gap_h)
    return tuple(jobs)


def check_trace_size(n: int) -> None:
    """A trace has at least one job and at most :data:`MAX_TRACE_JOBS`."""
    if n < 1:
        raise ConfigError(f"--trace needs at least one job, not {n}")
    if n > MAX_TRACE_JOBS:
        raise ConfigError(f"--trace {n} is more jobs than potluck compares the policies on "
                              f"({MAX_TRACE_JOBS:,}: about 4 minutes on 2 cores); give at most "
                              f"{MAX_TRACE_JOBS}")


def mix_shapes(mix: tuple[MixEntry, ...], execution: Execution) -> dict[MixEntry, JobShape]:
    """What each kind of job of ``mix`` trains."""
    return {entry: JobShape(load_model(entry.model),
                            TrainingShape(entry.global_batch, entry.seq_len, execution=execution))
            for entry in mix}


def _fitting_shapes(table: ThroughputTable, execution: Execution,
                    mix: tuple[MixEntry, ...]) -> dict[MixEntry, JobShape]:
    shapes = {entry: shape for entry, shape in mix_shapes(mix, execution).items()
              if table.refusal(shape) is None}
    if not shapes:
        names = ", ".join(entry.model for entry in mix)
        raise InfeasibleError(f"no model of the trace's mix ({names}) fits on the cluster; "
                              "give a larger cluster")
    return shapes


@dataclass(frozen=True)
class PolicyRun:
    """One policy's schedule of a trace, and the wall time it took (planning included)."""

    result: ScheduleResult
    wall_s: float


@dataclass(frozen=True)
class PolicyComparison:
    """Every policy on the same jobs."""

    runs: tuple[PolicyRun, ...]
    jobs: tuple[Job, ...]
    seed: int | None
    wall_s: float
    planner_calls: int
    planner_time_s: float


def compare_policies(jobs: tuple[Job, ...], table: ThroughputTable, seed: int | None = None,
                     policies: tuple[Policy, ...] = tuple(Policy),
                     restart_s: float = DEFAULT_RESTART_S) -> PolicyComparison:
    """Run each of ``policies`` on ``jobs``; throughputs planned once for all of them."""
    started = time.perf_counter()
    runs = []
    for policy in policies:
        began = time.perf_counter()
        result = simulate(jobs, table, policy, restart_s)
        runs.append(PolicyRun(result, time.perf_counter() - began))
    return PolicyComparison(tuple(runs), jobs, seed, time.perf_counter() - started,
                            table.planner_calls, table.planner_time_s)
