"""Presenting schedules: the tables of ``potluck schedule`` and its ``--json`` objects.

Per job a report shows the allocation it trained most tokens on (its main segment:
machines, GPUs, the plan's layout and predicted tokens/s), when it started and ended and
its completion time (end minus arrival); ``segments`` in the JSON hold every allocation
the job held, in time order. Times are hours from the trace's clock (jobs' ``arrival_h``).
"""

from __future__ import annotations

from typing import Any

from rich.console import Console

from potluck.cluster.spec import ClusterSpec
from potluck.cluster.topology import device_id
from potluck.multijob.machines import Machine, machine_name
from potluck.multijob.simulation import HOUR_S, JobOutcome, ScheduleResult, Segment
from potluck.multijob.trace import PolicyComparison
from potluck.tables import compact_table, fitting_columns


def schedule_json(result: ScheduleResult) -> dict[str, Any]:
    """``potluck schedule --json``: the policy, its averages and every job."""
    return {
        "policy": result.policy.value,
        "cluster": result.cluster.name,
        "gpus": result.cluster.num_gpus,
        "avg_completion_h": result.avg_completion_h,
        "makespan_h": result.makespan_h,
        "restart_s": result.restart_s,
        "jobs": [_job_json(outcome, result.cluster) for outcome in result.outcomes],
        "notes": list(result.notes),
    }


def _job_json(outcome: JobOutcome, spec: ClusterSpec) -> dict[str, Any]:
    job, main = outcome.job, outcome.main
    return {
        "name": job.name, "model": job.model_name or job.shape.model.name,
        "tokens": job.tokens, "arrival_h": job.arrival_h, "priority": job.priority,
        "deadline_h": job.deadline_h, "deadline_met": outcome.deadline_met,
        **_segment_json(main, spec),
        "start_h": outcome.start_h, "end_h": outcome.end_h,
        "completion_h": outcome.completion_h,
        "segments": [{**_segment_json(s, spec), "start_h": s.start_s / HOUR_S,
                      "end_h": s.end_s / HOUR_S} for s in outcome.segments],
    }


def _segment_json(segment: Segment, spec: ClusterSpec) -> dict[str, Any]:
    return {
        "devices": list(devices(segment.machines, spec)),
        "gpus": segment.allocation.num_gpus(spec),
        "gpus_used": segment.plan.num_gpus,
        "machines": [machine_name(m) for m in segment.machines],
        "layout": segment.plan.layout(),
        "tokens_per_s": segment.tokens_per_s,
    }


def devices(machines: tuple[Machine, ...], spec: ClusterSpec) -> tuple[str, ...]:
    """The cluster's device ids of every GPU of ``machines``."""
    per_node = {group.name: group.gpus_per_node for group in spec.nodes}
    return tuple(device_id(group, index, local)
                 for group, index in machines for local in range(per_node[group]))


SCHEDULE_COLUMNS = ("job", "machines", "GPUs", "layout", "tokens/s", "arrive h", "start h",
                    "end h", "JCT h", "moves")
# What a narrow console leaves out first: the job's name, its completion time and where and
# how it ran stay longest.
SCHEDULE_DROPS = ("moves", "arrive h", "start h", "GPUs", "tokens/s", "end h", "layout",
                  "machines")


def render_schedule(console: Console, result: ScheduleResult) -> None:
    """The per-job table (the columns that fit the console; a line names the others) and
    the averages."""
    spec = result.cluster
    rows = [_schedule_row(outcome, spec) for outcome in result.outcomes]
    kept = fitting_columns(SCHEDULE_COLUMNS, rows, console.width, SCHEDULE_DROPS)
    table = compact_table(f"Schedule ({result.policy.value}) on {spec.name}: {spec.num_gpus} GPUs",
                          kept, left=("job", "machines", "layout"))
    for row in rows:
        table.add_row(*(cell for name, cell in zip(SCHEDULE_COLUMNS, row, strict=True)
                        if name in kept))
    console.print(table)
    left_out = [name for name in SCHEDULE_COLUMNS if name not in kept]
    if left_out:
        console.print(f"left out at {console.width} columns: {', '.join(left_out)} (a wider "
                      "terminal or --json shows them)", highlight=False, markup=False,
                      soft_wrap=True)
    console.print(f"average job completion time {result.avg_completion_h:.2f} h, makespan "
                  f"{result.makespan_h:.2f} h ({result.policy.value}; each start or move "
                  f"costs {result.restart_s:.0f} s)", highlight=False)
    missed = [o.job.name for o in result.outcomes if o.deadline_met is False]
    if missed:
        console.print(f"missed deadlines: {', '.join(missed)}", highlight=False)
    for note in result.notes:
        console.print(f"note: {note}", highlight=False, markup=False, soft_wrap=True)


def _schedule_row(outcome: JobOutcome, spec: ClusterSpec) -> tuple[str, ...]:
    """One job's cells, in :data:`SCHEDULE_COLUMNS` order."""
    main = outcome.main
    return (outcome.job.name, main.allocation.label(), str(main.allocation.num_gpus(spec)),
            main.plan.layout(), f"{main.tokens_per_s:,.0f}", f"{outcome.job.arrival_h:.2f}",
            f"{outcome.start_h:.2f}", f"{outcome.end_h:.2f}",
            f"{outcome.completion_h:.2f}" + _deadline_mark(outcome),
            str(len(outcome.segments) - 1))


def _deadline_mark(outcome: JobOutcome) -> str:
    return {None: "", True: "", False: " (late)"}[outcome.deadline_met]


def comparison_json(comparison: PolicyComparison, spec: ClusterSpec) -> dict[str, Any]:
    """``potluck schedule --trace N --json``: every policy's averages on the trace."""
    return {
        "trace": len(comparison.jobs), "seed": comparison.seed, "cluster": spec.name,
        "gpus": spec.num_gpus, "wall_s": comparison.wall_s,
        "planner_calls": comparison.planner_calls,
        "policies": [{"policy": run.result.policy.value,
                      "avg_completion_h": run.result.avg_completion_h,
                      "makespan_h": run.result.makespan_h, "wall_s": run.wall_s}
                     for run in comparison.runs],
    }


def render_comparison(console: Console, comparison: PolicyComparison, spec: ClusterSpec) -> None:
    """One row per policy: average JCT and makespan, against the best average JCT."""
    best = min(run.result.avg_completion_h for run in comparison.runs)
    table = compact_table(
        f"{len(comparison.jobs)} jobs (seed {comparison.seed}) on {spec.name}: "
        f"{spec.num_gpus} GPUs", ("policy", "avg JCT h", "vs best", "makespan h"),
        left=("policy",))
    for run in comparison.runs:
        table.add_row(run.result.policy.value, f"{run.result.avg_completion_h:.2f}",
                      f"{run.result.avg_completion_h / best:.2f}x",
                      f"{run.result.makespan_h:.2f}")
    console.print(table)
    console.print(f"policies run in {comparison.wall_s:.1f} s; {comparison.planner_calls} "
                  f"plans made in {comparison.planner_time_s:.1f} s (the trace's included)",
                  highlight=False)
