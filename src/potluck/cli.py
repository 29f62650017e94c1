"""The ``potluck`` command line: a thin shell over :mod:`potluck.api`.

Every command parses its flags, calls the API and renders the result. A
``PotluckError`` becomes one line on stderr and a non-zero exit code.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterable
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer
from rich.console import Console

from potluck import api
from potluck.calibrate.measured.runs import MAX_RUNS
from potluck.cluster.execution import PRESET_SUMMARIES, PRESETS
from potluck.console.progress import Steps, fraction_progress, step_progress
from potluck.economics import prices
from potluck.errors import ConfigError, PotluckError
from potluck.model.counts import Recompute
from potluck.planner.options import Partition
from potluck.plans import DType
from potluck.plans.islands import SyncMethod
from potluck.plans.memory import Offload, Swap
from potluck.schedules import Schedule
from potluck.units import port_number, whole_number
from potluck.version import __version__

if TYPE_CHECKING:
    from potluck.multijob import JobsFileError


def _names(choices: Iterable[Enum]) -> tuple[str, ...]:
    return tuple(choice.value for choice in choices)


def _or(choices: Iterable[Enum]) -> str:
    """``a, b, c or d``: the values a flag accepts, for its help."""
    return _or_text(_names(choices))


def _or_text(names: Iterable[str]) -> str:
    *rest, last = names
    return f"{', '.join(rest)} or {last}" if rest else last

# Plain click help (option names whole at any width) and usage errors handed to main().
app = typer.Typer(
    add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
    rich_markup_mode=None,
    help="Plan, predict and run hybrid-parallel training on the GPUs you actually have.",
)
console = Console()
err_console = Console(stderr=True)


def _print_version(asked: bool) -> None:
    if asked:
        console.print(f"potluck {__version__}", highlight=False)
        raise typer.Exit()


@app.callback()
def _options(version: Annotated[bool, typer.Option(
        "--version", help="Print potluck's version and exit.", is_eager=True,
        callback=_print_version)] = False) -> None:
    pass

OFFERS = Steps("offer", "offers", "a search each; offers of the same hardware share one")
SEARCHES = Steps("search", "searches", "a job shape on an allocation each; as many as the "
                 "policy asks for", bounded=True)
ClusterOpt = Annotated[Path, typer.Option("--cluster", "-c", help="Cluster YAML file.")]
ModelOpt = Annotated[str, typer.Option("--model", "-m", help="Preset name, config.json or HF model dir.")]
TokensOpt = Annotated[str | None, typer.Option(help="Tokens to train: 2B, 300M or 1e9.")]
DeadlineOpt = Annotated[float | None, typer.Option(help="Train --tokens within this many hours.")]
ModeOpt = Annotated[str, typer.Option(help="Prices: rent (per GPU-hour) or buy (amortized + power).")]
SpotOpt = Annotated[bool, typer.Option("--spot", help="Rent at spot prices, not on-demand.")]
LifetimeOpt = Annotated[float, typer.Option(help="Buy: years the GPUs serve.")]
UtilizationOpt = Annotated[float, typer.Option(help="Buy: share of their life the GPUs train.")]
ElectricityOpt = Annotated[float, typer.Option(help="Buy: electricity price, USD per kWh.")]
DtypeOpt = Annotated[str, typer.Option(
    help="bf16, fp16, fp32 or tf32 (FP32 with TF32 matmuls); devices without bf16 use fp16, "
    "without TF32 fp32; CPUs fp32.")]
PueOpt = Annotated[float, typer.Option(help="Buy: power overhead on the boards (host, cooling).")]
ExecutionOpt = Annotated[str | None, typer.Option(
    "--execution", metavar="NAME|FILE",
    help=f"The framework that will train: {_or_text(PRESETS)} (default: the cluster file's "
    "execution: section, else potluck), or a YAML file of traits (docs/execution.md).")]


@app.command(short_help="Find the fastest (or cheapest) parallel plan for a model.",
             epilog="--execution presets: " + "; ".join(
    f"{name} ({summary})" for name, summary in PRESET_SUMMARIES.items()) + ".")
def plan(
    cluster: ClusterOpt,
    model: ModelOpt,
    global_batch: Annotated[int | None, typer.Option(help="Sequences per iteration (default 64).")] = None,
    seq_len: Annotated[int | None, typer.Option(
        help="Tokens per sequence (default min(2048, model max)).")] = None,
    dtype: DtypeOpt = "bf16",
    tp: Annotated[int | None, typer.Option(help="Pin the tensor-parallel degree.")] = None,
    pp: Annotated[int | None, typer.Option(help="Pin the number of pipeline stages.")] = None,
    dp: Annotated[int | None, typer.Option(help="Pin the number of data-parallel replicas.")] = None,
    micro_batch_size: Annotated[int | None, typer.Option(help="Pin the micro-batch size.")] = None,
    ep: Annotated[int | None, typer.Option(
        help="Pin the expert-parallel degree of a mixture of experts: each group of this many "
             "replicas splits every block's routed experts (default: chosen by the "
             "search; 1 turns it off).")] = None,
    recompute: Annotated[str, typer.Option(
        help=f"Recomputation: {'|'.join(_names(Recompute))}|auto (auto: chosen per stage).")] = "auto",
    swap: Annotated[str, typer.Option(
        help=f"Activation swapping: {'|'.join(_names(Swap))}|auto (auto: only where it pays "
             "or is needed to fit).")] = "auto",
    zero: Annotated[int | None, typer.Option(
        help="ZeRO stage over each stage's replicas: 0, 1 (optimizer states), 2 (and "
             "gradients) or 3 (and parameters, FSDP2); default: chosen by the search.")] = None,
    zero1: Annotated[bool | None, typer.Option(
        "--zero1/--no-zero1", help="Alias of --zero 1 / --zero 0.")] = None,
    offload: Annotated[str, typer.Option(
        help=f"Host offload: {'|'.join(_names(Offload))}|auto.")] = "auto",
    partition: Annotated[str, typer.Option(help="balanced, or uniform (even-split baseline).")] = "balanced",
    schedule: Annotated[str, typer.Option(
        help=f"Pipeline schedule: {_or(Schedule)} or auto (auto: 1f1b, run as fill and "
             "drain where a pipeline has fewer micro-batches than stages).")] = "auto",
    top: Annotated[int, typer.Option("--top", help="How many plans to show.")] = 5,
    sync: Annotated[str, typer.Option(
        help="How islands of machines synchronize: sync (every step), diloco (every H steps, "
             "outer optimizer), bounded (bounded staleness), or auto (islands where links "
             "are slow, when faster to the target loss).")] = "auto",
    target_tokens: Annotated[str | None, typer.Option(
        help="Target loss: synchronous training's after this many tokens (default 20 per "
             "parameter, Chinchilla).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")] = False,
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", help="Write the best plan to this file.")] = None,
    objective: Annotated[str, typer.Option(
        help="time (fastest plan) or cost (lowest USD per token, may leave devices out).")] = "time",
    tokens: TokensOpt = None,
    deadline_hours: DeadlineOpt = None,
    mode: ModeOpt = "rent",
    spot: SpotOpt = False,
    lifetime_years: LifetimeOpt = prices.DEFAULT_LIFETIME_YEARS,
    utilization: UtilizationOpt = prices.DEFAULT_UTILIZATION,
    electricity_usd_per_kwh: ElectricityOpt = prices.DEFAULT_ELECTRICITY_USD_PER_KWH,
    pue: PueOpt = prices.DEFAULT_PUE,
    execution: ExecutionOpt = None,
) -> None:
    """Find the fastest (or cheapest per token) data/tensor/pipeline-parallel plan for a model."""
    from potluck.economics.report import plan_cost_json, plan_cost_line
    from potluck.plans import save_plan
    from potluck.report import render_result, result_json
    from potluck.units import parse_count

    _check_choice("--dtype", dtype, DType)
    _check_choice("--partition", partition, Partition)
    _check_choice("--schedule", schedule, Schedule, "auto")
    _check_choice("--recompute", recompute, Recompute, "auto")
    _check_choice("--swap", swap, Swap, "auto")
    _check_choice("--offload", offload, Offload, "auto")
    _check_choice("--sync", sync, SyncMethod, "auto")
    zero = _zero_stage(zero, zero1)
    _check_choice("--objective", objective, api.Objective)
    pricing = _pricing(mode, spot=spot, lifetime_years=lifetime_years, utilization=utilization,
                       electricity_usd_per_kwh=electricity_usd_per_kwh, pue=pue)
    options = api.search_options(
        tp=tp, pp=pp, dp=dp, micro_batch_size=micro_batch_size, ep=ep, recompute=recompute,
        partition=partition, schedule=schedule, zero=zero, swap=swap, offload=offload, top_k=top,
        sync=sync, target_tokens=target_tokens,
    )
    with fraction_progress(err_console, "planning", enabled=not as_json) as report:
        result = api.plan(
            cluster, model, options=options, global_batch=global_batch, seq_len=seq_len,
            dtype=dtype, objective=objective, tokens=tokens, deadline_hours=deadline_hours,
            pricing=pricing, execution=execution, progress=report,
        )
    if output is not None:
        save_plan(result.best, output)
    priced = api.Objective(objective) is api.Objective.COST or tokens is not None
    count = parse_count(tokens, "--tokens") if tokens is not None else None
    if as_json:
        summary = result_json(result)
        if priced:
            summary["cost"] = plan_cost_json(result.best, pricing, count)
        sys.stdout.write(json.dumps(summary) + "\n")
        return
    render_result(console, result)
    for note in result.notes:
        console.print(f"[yellow]note:[/yellow] {note}")
    if priced:
        console.print(plan_cost_line(result.best, pricing, count))
    if output is not None:
        console.print(f"plan written to {output}")


@app.command(short_help="Which GPUs to rent or buy, by USD per million tokens.")
def cost(
    model: ModelOpt,
    tokens: Annotated[str, typer.Option(help="Tokens to train: 2B, 300M or 1e9.")],
    offers: Annotated[Path | None, typer.Option(help="Offers YAML file (default: catalog GPUs).")] = None,
    max_gpus: Annotated[int | None, typer.Option(help="Most GPUs per candidate (catalog: 8).")] = None,
    max_usd_per_hour: Annotated[float | None, typer.Option(help="Skip offers dearer than this.")] = None,
    deadline_hours: DeadlineOpt = None,
    mode: ModeOpt = "rent",
    spot: SpotOpt = False,
    lifetime_years: LifetimeOpt = prices.DEFAULT_LIFETIME_YEARS,
    utilization: UtilizationOpt = prices.DEFAULT_UTILIZATION,
    electricity_usd_per_kwh: ElectricityOpt = prices.DEFAULT_ELECTRICITY_USD_PER_KWH,
    pue: PueOpt = prices.DEFAULT_PUE,
    global_batch: Annotated[int | None, typer.Option(help="Sequences per iteration (default 64).")] = None,
    seq_len: Annotated[int | None, typer.Option(
        help="Tokens per sequence (default min(2048, model max)).")] = None,
    dtype: DtypeOpt = "bf16",
    top: Annotated[int, typer.Option("--top", help="How many candidates to show.")] = 15,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")] = False,
    plot: Annotated[Path | None, typer.Option(help="Write the time-against-cost plot here.")] = None,
    execution: ExecutionOpt = None,
) -> None:
    """Which GPUs to rent or buy: rank offers by USD per million tokens, with plans and RCC."""
    from potluck.economics.report import render_study, study_json

    _check_choice("--dtype", dtype, DType)
    whole_number(top, "--top")
    pricing = _pricing(mode, spot=spot, lifetime_years=lifetime_years, utilization=utilization,
                       electricity_usd_per_kwh=electricity_usd_per_kwh, pue=pue)
    with step_progress(err_console, OFFERS) as report:
        study = api.cost(
            model, tokens, offers=offers, max_gpus=max_gpus, max_usd_per_hour=max_usd_per_hour,
            deadline_hours=deadline_hours, pricing=pricing, global_batch=global_batch,
            seq_len=seq_len, dtype=dtype, execution=execution, progress=report,
        )
    if plot is not None:
        from potluck.economics.plot import plot_study

        plot_study(study, plot)
    if as_json:
        sys.stdout.write(json.dumps(study_json(study)) + "\n")
        return
    render_study(console, study, rows=top)
    if plot is not None:
        console.print(f"plot written to {plot}")


@app.command(short_help="Share one cluster among several jobs: allocations, times, Gantt.")
def schedule(
    cluster: ClusterOpt,
    jobs: Annotated[Path | None, typer.Option(
        help="Jobs YAML file: per job name, model, global_batch, seq_len, tokens (2B), and "
             "optionally priority, deadline_h, arrival_h.")] = None,
    policy: Annotated[str, typer.Option(
        help="fifo (first come, first served), equal (equal shares, blind to GPU types), "
             "throughput or fair (Gavel's heterogeneity-aware sum and max-min), jct (shortest "
             "remaining time first on the fastest GPUs, for average completion time).")] = "fair",
    trace: Annotated[int | None, typer.Option(
        help="Instead of --jobs: N synthetic jobs (Poisson arrivals, a size mix of presets), "
             "every policy compared.")] = None,
    seed: Annotated[int, typer.Option(help="Seed of --trace.")] = 0,
    restart_s: Annotated[float, typer.Option(
        help="Seconds every start or move of a job costs (checkpoint, rendezvous).")] = 120.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")] = False,
    gantt: Annotated[Path | None, typer.Option(help="Write the Gantt chart here (png, svg, pdf).")] = None,
    slurm: Annotated[Path | None, typer.Option(
        metavar="DIR", help="Write one sbatch script per job here, pinned to its machines.")] = None,
    execution: ExecutionOpt = None,
    run: Annotated[bool, typer.Option(
        "--run", help="Launch the jobs: each a potluck train --elastic run in --out DIR/<job> "
                      "(emulated on CPU ranks), re-allocated through potluck join/leave.")] = False,
    out: Annotated[Path | None, typer.Option(
        "--out", "-o", metavar="DIR", help="--run: the jobs' run directories and "
                                           "schedule.jsonl.")] = None,
    steps: Annotated[int, typer.Option(
        help="--run: steps of the job with the most tokens (the others in proportion).")] = 20,
    checkpoint_every: Annotated[int, typer.Option(
        help="--run: each run checkpoints every N steps (where it takes or gives machines).")] = 5,
    dilation: Annotated[float, typer.Option(help="--run: emulation time stretch.")] = 1.0,
    seconds_per_hour: Annotated[float, typer.Option(
        help="--run: wall seconds per hour of arrival_h (0: every job arrives at the start).")] = 0.0,
    job_timeout: Annotated[float, typer.Option(
        help="--run: seconds a job's run may take before it is stopped.")] = 3600.0,
) -> None:
    """Share one mixed cluster among several training jobs: each job planned on the machines
    a policy gives it, re-allocated at every arrival and completion; allocations, plans,
    predicted tokens/s, start and end times, average job completion time and makespan.
    With --run, launch them."""
    from potluck.multijob import JobsFileError, Policy
    from potluck.multijob.report import (
        comparison_json,
        render_comparison,
        render_schedule,
        schedule_json,
    )

    _check_choice("--policy", policy, Policy)
    if (jobs is None) == (trace is None):
        raise PotluckError("give --jobs FILE or --trace N (one of them)")
    if run or out is not None:
        _schedule_run(cluster, jobs, policy, out, run=run, trace=trace, as_json=as_json,
                      files=(gantt, slurm), execution=execution, steps=steps,
                      checkpoint_every=checkpoint_every, dilation=dilation,
                      seconds_per_hour=seconds_per_hour, job_timeout_s=job_timeout)
        return
    if trace is not None:
        if gantt is not None or slurm is not None:
            raise PotluckError("--gantt and --slurm draw and launch a jobs file; give --jobs")
        with step_progress(err_console, SEARCHES) as report:
            comparison = api.schedule_trace(cluster, trace, seed=seed, restart_s=restart_s,
                                            execution=execution, progress=report)
        spec = comparison.runs[0].result.cluster
        if as_json:
            sys.stdout.write(json.dumps(comparison_json(comparison, spec)) + "\n")
        else:
            render_comparison(console, comparison, spec)
        return
    try:
        with step_progress(err_console, SEARCHES) as report:
            result = api.schedule(cluster, jobs, policy=policy, restart_s=restart_s,
                                  execution=execution, progress=report)
    except JobsFileError as err:
        _jobs_file_problems(err)
    _write_schedule_files(result, gantt, slurm, quiet=as_json)
    if as_json:
        sys.stdout.write(json.dumps(schedule_json(result)) + "\n")
    else:
        render_schedule(console, result)


def _schedule_run(cluster: Path, jobs: Path | None, policy: str, out: Path | None, *,
                  run: bool, trace: int | None, as_json: bool,
                  files: tuple[Path | None, Path | None], execution: str | None,
                  **settings: float) -> None:
    """``potluck schedule --run``: one progress line per event, one line per failed job."""
    from potluck.multijob import JobsFileError
    from potluck.multijob.executor import SCHEDULE_FILE

    if not run:
        raise PotluckError("--out DIR goes with --run (where the jobs' runs go)")
    if out is None:
        raise PotluckError("--run needs --out DIR (the jobs' run directories and schedule.jsonl)")
    if trace is not None or as_json or any(f is not None for f in files):
        raise PotluckError("--run launches a jobs file; --trace, --json, --gantt and --slurm "
                           "go without it")

    def say(line: str) -> None:
        console.print(line, highlight=False, markup=False, soft_wrap=True)

    try:
        outcome = api.schedule_run(cluster, jobs, out=out, policy=policy, execution=execution,
                                   progress=say, **settings)
    except JobsFileError as err:
        _jobs_file_problems(err)
    say(f"{len(outcome.finished)} of {len(outcome.steps)} jobs finished; events in "
        f"{out / SCHEDULE_FILE}, runs in {out}/<job>")
    for name, error in outcome.failed.items():
        err_console.print(f"potluck: error: job {name}: {error}", highlight=False,
                          markup=False, soft_wrap=True)
    if outcome.failed:
        raise typer.Exit(1)


def _jobs_file_problems(err: JobsFileError) -> NoReturn:
    """A jobs file's problems, one line each (all of them), and the exit."""
    for problem in err.problems:
        err_console.print(f"potluck: error: {' '.join(problem.split())}", highlight=False,
                          markup=False, soft_wrap=True)
    raise typer.Exit(err.exit_code) from None


def _write_schedule_files(result, gantt: Path | None, slurm: Path | None, *, quiet: bool) -> None:
    """The Gantt chart and the sbatch scripts of ``potluck schedule``, said where (on stderr
    under --json)."""
    from potluck.multijob.gantt import write_gantt
    from potluck.multijob.slurm import write_slurm

    say = err_console if quiet else console
    if gantt is not None:
        say.print(f"Gantt chart written to {write_gantt(result, gantt)}", highlight=False)
    if slurm is not None:
        scripts = write_slurm(result, slurm, result.hosts)
        say.print(f"{len(scripts)} sbatch scripts (with plans and launch scripts) written to "
                  f"{slurm}: sbatch {slurm}/<job>.sbatch", highlight=False)


@app.command(short_help="Simulate one iteration of a plan: timeline, memory, trace.")
def simulate(
    plan_file: Annotated[Path, typer.Argument(help="A plan file from `potluck plan -o`.")],
    schedule: Annotated[str | None, typer.Option(
        help=f"{_or(Schedule)} (default: the plan's).")] = None,
    out: Annotated[Path | None, typer.Option(
        "--out", help="Folder for timeline.png, memory.png, trace.json (default: <plan>-sim).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")] = False,
) -> None:
    """Simulate one training iteration of a plan: timeline, memory, Chrome trace, summary."""
    from potluck.sim.outputs import render_summary, write_outputs

    if schedule is not None:
        _check_choice("--schedule", schedule, Schedule)
    result = api.simulate(plan_file, schedule=schedule)
    files = write_outputs(result, out or Path(f"{plan_file.stem}-sim"))
    if as_json:
        sys.stdout.write(json.dumps(result.summary()) + "\n")
        return
    render_summary(console, result, files)


@app.command(short_help="Predicted against measured step times and memory; or two runs.")
def compare(
    target: Annotated[Path, typer.Argument(help="Run directory of potluck train --trace, a plan "
                                           "file, or a predicted trace.json.")],
    measured: Annotated[Path | None, typer.Argument(
        help="trace.json from potluck train --trace (default: RUN_DIR/trace.json), or a "
        "second run directory to compare step times with.")] = None,
    out: Annotated[Path | None, typer.Option(
        "--out", help="Folder for predicted.json and side_by_side.json (default: the run's).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")] = False,
) -> None:
    """Predicted against measured step time and op durations, per stage and op kind, and
    peak memory per rank (device and host; a run directory without a trace: memory only);
    or two run directories by their step time on their devices (emulated: measured over
    dilation)."""
    from potluck.calibrate.compare_run import compare_runs
    from potluck.sim.compare import render_comparison

    if target.is_dir() and measured is not None and measured.is_dir():
        runs = compare_runs(target, measured)
        if as_json:
            sys.stdout.write(json.dumps(runs.as_dict()) + "\n")
            return
        console.print(f"{runs.first.describe()}\n{runs.second.describe()}\n"
                      f"the first is {runs.speedup:.2f}x as fast", highlight=False)
        return
    from potluck.calibrate.compare_memory import compare_run_memory, memory_rows, render_memory

    memory = compare_run_memory(target) if target.is_dir() and memory_rows(target) else ()
    if target.is_dir() and measured is None and memory and not (target / "trace.json").is_file():
        if as_json:
            sys.stdout.write(json.dumps({"memory": [r.as_dict() for r in memory]}) + "\n")
            return
        render_memory(console, memory)
        return
    comparison, files = api.compare(target, measured, out_dir=out)
    if as_json:
        sys.stdout.write(json.dumps({**comparison.as_dict(),
                                     "memory": [r.as_dict() for r in memory]}) + "\n")
        return
    render_comparison(console, comparison)
    if memory:
        render_memory(console, memory)
    if files:
        console.print(f"traces written: {', '.join(map(str, files))} (open in ui.perfetto.dev)",
                      highlight=False)


@app.command(short_help="Fit the cost model to a traced run or measured times.")
def calibrate(
    run: Annotated[Path | None, typer.Argument(
        help="Run directory of potluck train --trace --out (or give --measured).")] = None,
    measured: Annotated[Path | None, typer.Option(
        "--measured", help="CSV of iteration times measured by any framework: "
        "tp,pp,dp,micro_batch_size,global_batch,seq_len,iteration_time_s (optional "
        f"dtype,recompute,schedule,zero1,partition,groups), at most {MAX_RUNS} runs; needs "
        "--model and --cluster.")] = None,
    model: Annotated[str | None, typer.Option(
        "--model", "-m", help="With --measured: the model the runs trained.")] = None,
    cluster: Annotated[Path | None, typer.Option(
        "--cluster", "-c", help="Cluster file to calibrate (default: the run's, from its plan).")] = None,
    out: Annotated[Path | None, typer.Option(
        "--out", "-o", help="Cluster file to write (default: <cluster>-calibrated.yaml, or "
        "RUN/calibrated.yaml).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")] = False,
) -> None:
    """Fit device efficiency, memory bandwidth and links to a traced run (or, with --measured,
    efficiency, link bandwidths and overheads to measured iteration times); error before and after."""
    if measured is not None or run is None:
        _calibrate_measured(run, measured, model, cluster, out, as_json)
        return
    if model is not None:
        raise ConfigError("--model is for --measured runs; a run directory's plan names its model")
    from potluck.calibrate.report import calibration_json, render_calibration

    outcome = api.calibrate(run, cluster=cluster, out=out)
    if as_json:
        sys.stdout.write(json.dumps(calibration_json(outcome)) + "\n")
        return
    render_calibration(console, outcome)


def _calibrate_measured(run: Path | None, measured: Path | None, model: str | None,
                        cluster: Path | None, out: Path | None, as_json: bool) -> None:
    from potluck.calibrate.measured.report import measured_json, render_measured
    from potluck.profiler.report import progress_reporter

    if run is not None:
        raise ConfigError("give either a run directory or --measured runs.csv, not both")
    if measured is None:
        raise ConfigError("give a run directory of potluck train --trace, or --measured runs.csv")
    if model is None or cluster is None:
        raise ConfigError("--measured needs --model (the model the runs trained) and --cluster "
                          "(the cluster file of the machines they ran on)")
    with progress_reporter(err_console, "calibrate") as report:
        outcome = api.calibrate_measured(measured, model=model, cluster=cluster, out=out,
                                         progress=report)
    if as_json:
        sys.stdout.write(json.dumps(measured_json(outcome)) + "\n")
        return
    render_measured(console, outcome)


@app.command(short_help="Measure this machine's devices and links.")
def profile(
    out: Annotated[Path | None, typer.Option(
        "--out", "-o", help="Cluster file to write (default: cluster.yaml, or "
        "<cluster>-calibrated.yaml).")] = None,
    cluster: Annotated[Path | None, typer.Option(
        "--cluster", "-c", help="Calibrate this cluster file instead of describing this machine.")] = None,
    model: Annotated[str, typer.Option("--model", "-m", help="Whose GEMM shapes to time.")] = "llama2-7b",
    ranks: Annotated[int | None, typer.Option(
        help="Local ranks to spawn (default: the GPUs, or 2 on CPU).")] = None,
    budget: Annotated[float, typer.Option(help="Seconds of matmul timing per dtype.")] = 1.0,
    device_type: Annotated[str | None, typer.Option(help="Catalog name of this device.")] = None,
    timeout: Annotated[float | None, typer.Option(
        help="Stop after this many seconds (default: a few times the estimate).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")] = False,
) -> None:
    """Measure this machine's devices and links (torch.distributed) and write a calibrated cluster file."""
    from potluck.profiler import ProfileOptions
    from potluck.profiler.report import outcome_json, plan_line, progress_reporter, render_outcome

    target = out or (Path(f"{cluster.stem}-calibrated.yaml") if cluster else Path("cluster.yaml"))
    options = ProfileOptions(api.as_model(model), ranks=ranks, budget_s=budget, timeout_s=timeout)
    err_console.print(plan_line(options), highlight=False, markup=False, soft_wrap=True)
    with progress_reporter(err_console) as report:
        outcome = api.profile(target, model=options.model, cluster=cluster, ranks=ranks,
                              budget_s=budget, device_type=device_type, timeout_s=timeout,
                              progress=report)
    if outcome is None:  # a torchrun rank other than 0
        return
    if as_json:
        sys.stdout.write(json.dumps(outcome_json(outcome)) + "\n")
        return
    render_outcome(console, outcome)


@app.command(short_help="Plan mixed clusters, then dry-run a plan on this CPU.")
def demo(
    steps: Annotated[int, typer.Option(help="Steps of the emulated dry run.")] = 6,
) -> None:
    """Plan mixed clusters (3090 pairs, 4090s, A100s), then dry-run a plan on this CPU."""
    from potluck import demo as demo_steps
    from potluck.report import render_plan

    lab = demo_steps.plan_lab()
    console.rule(f"1. plan {demo_steps.DEMO_MODEL} for {lab.balanced.cluster.name}")
    render_plan(console, lab.balanced)
    _print_speedup(lab)
    run = demo_steps.plan_dry_run()
    console.rule(f"2. plan it for {run.balanced.cluster.name}, dry-run it on this CPU")
    render_plan(console, run.balanced)
    _print_speedup(run)
    console.print("training the plan with a tiny stand-in model (same blocks, same layout, "
                  "each op timed like its device)...")
    result = demo_steps.dry_run(run.balanced, steps, before_launch=_before_launch)
    _print_dry_run_summary(run.balanced, result)


def _print_dry_run_summary(plan, result) -> None:
    console.rule("summary")
    console.print(f"plan: {plan.layout()} on {plan.num_gpus} emulated GPUs; "
                  + result.summary(), highlight=False)
    dilated = result.history[-1].predicted_step_time_s if result.history else None
    if dilated:
        real = plan.prediction.iteration_time_s
        console.print(f"emulation stretched every op {dilated / real:.2f}x so the CPU ranks keep the "
                      f"GPUs' pace: on the real GPUs a step would take about {real:.3g} s",
                      highlight=False)


def _print_speedup(comparison) -> None:
    if comparison.uniform is None:
        console.print("The Megatron-style even split (--partition uniform) does not fit in "
                      "memory on these devices.\n")
        return
    console.print(
        f"The Megatron-style even split (--partition uniform) would take "
        f"{comparison.uniform.prediction.iteration_time_s:.3g} s per iteration; potluck's plan "
        f"takes {comparison.balanced.prediction.iteration_time_s:.3g} s: "
        f"[bold]{comparison.speedup:.2f}x[/bold] faster.\n"
    )


@app.command(short_help="List the GPU types: peak TFLOPS, memory, links, prices.")
def catalog(
    name: Annotated[str | None, typer.Argument(
        help="Show one GPU type: every figure with its source (override any of them under "
             "`devices:` in the cluster file).")] = None,
    as_json: Annotated[bool, typer.Option(
        "--json", help="Print JSON on stdout: an array of every type (one object with NAME), "
                       "each with its figures and their sources.")] = False,
) -> None:
    """List the GPU types (names for a cluster file's `gpu:`): peak TFLOPS, memory, links, prices."""
    from potluck.cluster.catalog import catalog as device_catalog
    from potluck.cluster.catalog import lookup

    devices = [lookup(name)] if name else list(device_catalog().values())
    if as_json:
        payload = [_device_json(d) for d in devices]
        sys.stdout.write(json.dumps(payload[0] if name else payload) + "\n")
    elif name:
        _print_device(devices[0])
    else:
        _print_catalog(devices)


def _device_json(device) -> dict:
    """Every figure of a device type under its attribute name, and each one's source."""
    from potluck.cluster.catalog import FIELD_ATTRS, source_of

    figures = {attr: getattr(device, attr) for attr in FIELD_ATTRS.values()}
    figures["link"] = device.link.value
    sources = {attr: source_of(device, key) for key, attr in FIELD_ATTRS.items()}
    return {"name": device.name, **figures, "sources": sources}


def _print_catalog(devices) -> None:
    from rich import box
    from rich.table import Table

    table = Table(title="Device catalog", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1, 0, 0),
                  caption="TFLOPS: dense peaks (16-bit: FP16/BF16 tensor, FP32 accumulate). "
                          "GB, GB/s: memory and its bandwidth. $/h: rent on demand; buy $: "
                          "purchase. `potluck catalog NAME`: every figure with its source.")
    longest = max(len(d.name) for d in devices)
    table.add_column("name", no_wrap=True, min_width=longest)
    for column in ("16-bit", "TF32", "FP32", "GB", "GB/s", "link", "$/h", "buy $"):
        table.add_column(column, justify="left" if column == "link" else "right")
    for d in devices:
        table.add_row(d.name, f"{d.tflops:g}", f"{d.tf32_tflops:g}", f"{d.fp32_tflops:g}",
                      f"{d.memory_bytes / 1e9:g}", f"{d.memory_bandwidth_bytes_per_s / 1e9:g}",
                      d.link.value, f"{d.price_per_hour_usd:.2f}", f"{d.purchase_price_usd:.0f}")
    console.print(table)


_FIELD_FORMATS = {
    "tflops": "{:g} TFLOPS", "fp32_tflops": "{:g} TFLOPS", "tf32_tflops": "{:g} TFLOPS",
    "power_w": "{:g} W", "price_per_hour": "${:.2f}/h", "spot_price_per_hour": "${:.2f}/h",
    "purchase_price": "${:,.0f}",
}


def _field_text(key: str, value) -> str:
    if key == "memory":
        return f"{value / 1e9:g} GB"
    if key.endswith("bandwidth"):
        return f"{value / 1e9:g} GB/s"
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, bool):
        return "yes" if value else "no"
    return _FIELD_FORMATS.get(key, "{:g}").format(value)


def _print_device(device) -> None:
    from rich.table import Table

    from potluck.cluster.catalog import FIELD_ATTRS, source_of

    table = Table(title=f"{device.name} (override a field under `devices:` in your cluster file)")
    for column in ("field", "value", "source"):
        table.add_column(column, no_wrap=column != "source")
    for key, attr in FIELD_ATTRS.items():
        value = _field_text(key, getattr(device, attr))
        table.add_row(key, value, source_of(device, key) or "-")
    console.print(table)


@app.command(short_help="Train with exactly the plan's layout.")
def train(
    cluster: Annotated[Path | None, typer.Option("--cluster", "-c", help="Cluster YAML file.")] = None,
    model: Annotated[str | None, typer.Option(
        "--model", "-m", help="Preset name, config.json or HF model dir.")] = None,
    plan_file: Annotated[Path | None, typer.Option(
        "--plan", help="Plan JSON from potluck plan -o (default: plan now).")] = None,
    data: Annotated[str | None, typer.Option(
        help="Text/jsonl file or directory (default: the corpus shipped with potluck).")] = None,
    tokenizer: Annotated[str | None, typer.Option(
        help="Local HF tokenizer dir (default: --init-from's, else bytes).")] = None,
    init_from: Annotated[Path | None, typer.Option(
        "--init-from", help="Fine-tune: start from this HF model dir's safetensors weights "
                            "(--model defaults to it).")] = None,
    steps: Annotated[int, typer.Option(help="Training steps.")] = 20,
    global_batch: Annotated[int | None, typer.Option(help="Sequences per step (default 64).")] = None,
    seq_len: Annotated[int | None, typer.Option(help="Tokens per sequence (default 2048).")] = None,
    dtype: Annotated[str | None, typer.Option(
        help="bf16, fp16, fp32 or tf32 when planning now (default bf16; --plan: the plan's).")] = None,
    lr: Annotated[float, typer.Option(help="AdamW's peak learning rate (after any warm-up).")] = 3e-4,
    lr_schedule: Annotated[str, typer.Option(
        help=f"{_or(api.LRSchedule)}: after the warm-up keep --lr (constant) or decay it to "
             "--min-lr by the last step.")] = "constant",
    warmup_steps: Annotated[int, typer.Option(
        help="Steps rising linearly to --lr (step s of them: lr * (s+1)/(N+1)).")] = 0,
    min_lr: Annotated[float, typer.Option(
        help="Where cosine and linear decay end (0 to --lr).")] = 0.0,
    weight_decay: Annotated[float, typer.Option(help="AdamW's decoupled weight decay.")] = 0.0,
    max_grad_norm: Annotated[float, typer.Option(
        help="Clip gradients to this global norm (0: no clipping).")] = 1.0,
    seed: Annotated[int, typer.Option(help="Seed of initial weights and data order.")] = 0,
    out: Annotated[Path | None, typer.Option(
        "--out", "-o", help="Run directory: plan.json, metrics.jsonl, checkpoints/.")] = None,
    emulate: Annotated[bool, typer.Option(help="Dry-run on CPU ranks timed like the devices.")] = False,
    checkpoint_every: Annotated[int, typer.Option(
        help="Also checkpoint to DIR every N steps (0: the final state only); under islands "
             "that synchronize rarely, at the next outer step.")] = 0,
    resume: Annotated[bool, typer.Option(help="Continue from the newest checkpoint in DIR.")] = False,
    overwrite: Annotated[bool, typer.Option(
        help="DIR holds another run: delete its files first (without this or --resume, "
             "such a DIR is refused).")] = False,
    tensorboard: Annotated[bool, typer.Option(help="Also write DIR/tensorboard.")] = False,
    dilation: Annotated[float | None, typer.Option(help="Emulation time stretch (default: auto).")] = None,
    stand_in: Annotated[str | None, typer.Option(help="Emulate computing this model (tiny).")] = None,
    timeout: Annotated[float, typer.Option(help="Seconds a rank waits for the others.")] = 600.0,
    trace: Annotated[bool, typer.Option(help="Record every op of a few steps into DIR/trace.json.")] = False,
    trace_steps: Annotated[int, typer.Option(help="Steps --trace records (after 2 warm-up steps).")] = 3,
    count_memory: Annotated[bool, typer.Option(
        help="CPU ranks count the bytes they hold each step (memory rows of metrics.jsonl; "
             "on with --emulate).")] = False,
    print_commands: Annotated[bool, typer.Option(help="Print one torchrun command per machine.")] = False,
    master_addr: Annotated[str, typer.Option(help="First machine's address (torchrun).")] = "FIRST_MACHINE",
    master_port: Annotated[int, typer.Option(help="Rendezvous port (for torchrun).")] = 29500,
    execution: ExecutionOpt = None,
    elastic: Annotated[bool, typer.Option(
        help="When ranks die or devices join (potluck join), replan and continue from the "
             "newest checkpoint (DIR/replans.jsonl).")] = False,
    inject_failure: Annotated[str | None, typer.Option(
        help="--elastic: RANK@STEP, kill that rank (SIGKILL) when it reaches that step (a "
             "drill).")] = None,
    max_restarts: Annotated[int, typer.Option(help="--elastic: restarts after failures.")] = 3,
    replan_margin: Annotated[float, typer.Option(
        help="--elastic: how much faster a plan with joined devices must be.")] = 0.1,
) -> None:
    """Train with exactly the plan's layout: ranks of this machine, or torchrun per machine.

    potluck's runtime runs the potluck execution traits (and with or without overlapped
    gradient reduction, FP32 or 16-bit gradients on the wire, SDPA or eager attention);
    a plan asking for others (fused kernels, 16-bit weights, blocking sends) is refused.
    """
    if resume and out is None:
        raise PotluckError("--resume needs --out DIR (the run directory to continue)")
    if elastic and checkpoint_every <= 0:
        checkpoint_every = max(1, steps // ELASTIC_CHECKPOINTS)
    if dtype is not None:
        _check_choice("--dtype", dtype, DType)
    _note_weights_left(model, init_from)
    whole_number(trace_steps, "--trace-steps")
    port_number(master_port, "--master-port")
    options = api.train_options(
        data=data, tokenizer=tokenizer, out=out, init_from=init_from, steps=steps, lr=lr,
        lr_schedule=lr_schedule,
        warmup_steps=warmup_steps, min_lr=min_lr, weight_decay=weight_decay,
        max_grad_norm=max_grad_norm or None, seed=seed, emulate=emulate,
        checkpoint_every=checkpoint_every, resume=resume, overwrite=overwrite,
        tensorboard=tensorboard,
        dilation=dilation, stand_in=stand_in, timeout_s=timeout,
        trace_steps=trace_steps if trace else 0, elastic=elastic,
        inject_failure=inject_failure, count_memory=count_memory,
    )
    model = api.model_to_train(model, plan_file, init_from)
    settings = api.elastic_settings(max_restarts, replan_margin, _say_replan) if elastic else None
    chosen = api.resolve_plan(cluster, model, plan_file=plan_file, global_batch=global_batch,
                              seq_len=seq_len, dtype=dtype, run_dir=out, execution=execution)
    api.check_launch(chosen, options)  # before any command is printed
    for note in chosen.notes:  # what the plan says of itself (a sequence beyond the positions)
        err_console.print(f"note: {note}", highlight=False, markup=False, soft_wrap=True)
    if print_commands:
        _print_torchrun_commands(chosen, plan_file, options, master_addr, master_port,
                                 max_restarts if elastic else None)
        return
    result = api.run_plan(chosen, options, before_launch=_before_launch, elastic=settings)
    console.print(result.summary(), highlight=False)
    if trace:
        console.print(f"trace: {out / 'trace.json'} (potluck compare {out}; potluck calibrate {out})",
                      highlight=False)


def _note_weights_left(model: str | Path | None, init_from: Path | None) -> None:
    """A note when --model is a directory with weights that the run does not load."""
    note = api.weights_left_note(model, init_from)
    if note is not None:
        err_console.print(f"note: {note}", highlight=False, markup=False, soft_wrap=True)


ELASTIC_CHECKPOINTS = 10  # --elastic without --checkpoint-every: about this many a run


def _say_replan(record) -> None:
    """One line on stderr per replan of an elastic run."""
    parts = []
    if record.lost_devices:
        verb = "lost" if record.reason == "lost" else "taken away:"
        parts.append(f"{verb} {', '.join(record.lost_devices)}")
    if record.joined_devices:
        parts.append(f"{', '.join(record.joined_devices)} joined")
    what = "; ".join(parts)
    err_console.print(
        f"elastic: {what}; replanned {record.old_layout} -> {record.new_layout} "
        f"({record.old_predicted_step_s:.3g} -> {record.new_predicted_step_s:.3g} s a step "
        f"predicted); continuing from step {record.step} ({record.steps_lost} steps again)",
        highlight=False, markup=False, soft_wrap=True)


@app.command(short_help="Offer devices to a running train --elastic run.")
def join(
    run: Annotated[Path, typer.Argument(help="Run directory of potluck train --elastic --out.")],
    device: Annotated[list[str], typer.Option(
        "--device", "-d", help="Device id of the run's cluster, such as box4090.0:1.")],
) -> None:
    """Register devices with an elastic run: it plans with them while it trains and moves
    to the new plan at its next checkpoint if that is faster by its --replan-margin."""
    joined = api.join(run, device)
    console.print(f"registered {', '.join(joined)} with {run}", highlight=False)


@app.command(short_help="Take devices from a running train --elastic run.")
def leave(
    run: Annotated[Path, typer.Argument(help="Run directory of potluck train --elastic --out.")],
    device: Annotated[list[str], typer.Option(
        "--device", "-d", help="Device id of the run's cluster, such as box3090.1:0.")],
) -> None:
    """Take devices away from an elastic run: at its next checkpoint it replans without
    them and continues (whatever --replan-margin says)."""
    left = api.leave(run, device)
    console.print(f"{', '.join(left)} will leave {run} at its next checkpoint", highlight=False)


@app.command(short_help="Export a run's newest checkpoint as a Hugging Face model.")
def export(
    run: Annotated[Path, typer.Argument(help="Run directory of potluck train --out.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Hugging Face directory to write.")],
) -> None:
    """Export the newest checkpoint of a run that verifies as a Hugging Face model (safetensors)
    with the tokenizer the run trained with."""
    done = api.export(run, out)
    loads = f"AutoModelForCausalLM.from_pretrained({str(done.out_dir)!r})"
    if done.tokenizer:
        loads += f", AutoTokenizer.from_pretrained({str(done.out_dir)!r})"
    console.print(f"exported step {done.step} ({done.checkpoint}) to {done.out_dir}: {loads}",
                  highlight=False)


def _before_launch(chosen, options) -> None:
    """What a run says once its checks have passed, before its ranks start."""
    if options.resume and options.out_dir:
        _note_plan_change(chosen, Path(options.out_dir))
    if options.emulate:
        err_console.print(_emulation_line(chosen, options), highlight=False, markup=False,
                          soft_wrap=True)


SLOW_UNPADDED_STEP_S = 60.0  # an emulation's unpadded steps this long get a warning


def _emulation_line(chosen, options) -> str:
    """How an emulated run spends its time, said before its ranks start."""
    computing = f"computing {options.stand_in}" if options.stand_in else "computing the model"
    unpadded = api.calibration_steps(options)
    first = f"time {unpadded} steps unpadded to set the dilation, then " if unpadded else ""
    line = (f"dry run: {chosen.num_gpus} CPU ranks stand for the plan's devices, {computing}; "
            f"once started they {first}say how long the {options.steps} steps will take")
    if options.stand_in is None and options.dilation is None:
        step_s = api.unpadded_step_s(chosen, options)
        if step_s > SLOW_UNPADDED_STEP_S:
            line += (f"; each unpadded step computes for at least {step_s / 60:.0f} min "
                     "here (an estimate): --stand-in tiny computes a tiny model with the same "
                     "blocks and layout in seconds")
    return line


def _note_plan_change(chosen, out: Path) -> None:
    """Say so when a resumed run continues under a plan other than the one it saved."""
    from potluck.plans import load_plan, plan_to_json
    from potluck.yamlio import read_text

    path = out / "plan.json"
    if not path.is_file() or read_text(path, "plan") == plan_to_json(chosen) + "\n":
        return
    try:
        before = load_plan(path).layout()
    except PotluckError:
        before = "unreadable"
    saved = "the same layout with other details" if before == chosen.layout() else before
    err_console.print(f"note: {path} holds another plan ({saved}); the run continues under "
                      f"{chosen.layout()} and writes it there once it has started",
                      highlight=False, markup=False, soft_wrap=True)


def _print_torchrun_commands(chosen, plan_file: Path | None, options, master_addr: str,
                             master_port: int, max_restarts: int | None = None) -> None:
    """One torchrun command per machine; the plan is written where they can read it."""
    from potluck.plans import save_plan

    api.claim_run_dir(options)
    path = plan_file
    if path is None:
        path = Path(options.out_dir or ".") / "plan.json"
        _refuse_replacing_a_plan(chosen, path)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_plan(chosen, path)
        console.print(f"# plan written to {path}; copy it to every machine", highlight=False)
    for node in api.torchrun_commands(chosen, path, options, master_addr=master_addr,
                                      master_port=master_port, max_restarts=max_restarts):
        console.print(f"# machine {node.node} ({node.nproc} ranks)", highlight=False)
        console.print(node.command, highlight=False, markup=False, soft_wrap=True)


def _refuse_replacing_a_plan(chosen, path: Path) -> None:
    """The torchrun commands need the plan in a file at once, before any rank has run:
    never replace another plan there (a run's, which a resume continues)."""
    from potluck.plans import plan_to_json
    from potluck.yamlio import read_bounded

    if path.exists() and (not path.is_file() or read_bounded(path, "plan").decode(errors="replace")
                          != plan_to_json(chosen) + "\n"):
        raise ConfigError(f"{path} holds another plan; write this one elsewhere with potluck plan "
                          "-o FILE and pass --plan FILE")


def _pricing(mode: str, *, spot: bool, lifetime_years: float, utilization: float,
             electricity_usd_per_kwh: float, pue: float) -> prices.Pricing:
    _check_choice("--mode", mode, prices.PriceMode)
    return prices.Pricing(prices.PriceMode(mode), spot, lifetime_years, utilization,
                          electricity_usd_per_kwh, pue)


def _check_choice(flag: str, value: str, choices: Iterable[Enum], *extra: str) -> None:
    """One line if ``value`` is none of ``choices``' values (nor of ``extra``, e.g. ``auto``)."""
    allowed = (*_names(choices), *extra)
    if value not in allowed:
        raise PotluckError(f"{flag} must be one of {', '.join(allowed)}, not {value!r}")


def _zero_stage(zero: int | None, zero1: bool | None) -> int | None:
    """``--zero N``, or ``--zero1``/``--no-zero1`` as its alias; both must agree."""
    if zero is not None and not 0 <= zero <= 3:
        raise PotluckError(f"--zero must be 0, 1, 2 or 3, not {zero}")
    if zero1 is None:
        return zero
    alias = 1 if zero1 else 0
    if zero is not None and zero != alias:
        raise PotluckError(f"--zero {zero} and --{'' if zero1 else 'no-'}zero1 disagree; "
                           "give one of them")
    return alias


def main() -> None:
    """Entry point: run the app, turning user errors (bad input, bad flags) into one line and
    an exit code."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        code = app(prog_name="potluck", standalone_mode=False)
    except _USAGE_ERROR as err:
        if type(err).__name__ == "NoArgsIsHelpError":  # plain `potluck`: the help
            err.show()
            sys.exit(err.exit_code)
        _fail(f"{_usage_message(err).rstrip('.')}; see {_command_path()} --help", err.exit_code)
    except _CLICK_ERROR as err:
        _fail(err.format_message(), err.exit_code)
    except PotluckError as err:
        _fail(str(err), err.exit_code)
    except OSError as err:  # the file system refused something no check named
        from potluck.safe_files import os_error_text

        _fail(os_error_text(err), 1)
    except (KeyboardInterrupt, typer.Abort):
        err_console.print("potluck: interrupted")
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


# Flags other trainers spell differently, and potluck's flag for the same thing.
FLAG_SYNONYMS = {"--batch-size": "--global-batch", "--global-batch-size": "--global-batch",
                 "--bs": "--global-batch", "--mbs": "--micro-batch-size",
                 "--learning-rate": "--lr", "--max-steps": "--steps", "--iters": "--steps"}


def _usage_message(err: Exception) -> str:
    """click's message, except for an unknown flag that is another trainer's name of one of
    the command's flags: that flag is named (click's guess for ``--batch-size`` is
    ``--micro-batch-size``, not the batch a step trains on)."""
    name = getattr(err, "option_name", None)
    synonym = FLAG_SYNONYMS.get(name) if isinstance(name, str) else None
    command = getattr(getattr(err, "ctx", None), "command", None)
    flags = {opt for param in getattr(command, "params", ()) for opt in param.opts}
    if synonym in flags:
        return f"No such option: {name} (potluck calls it {synonym})"
    return err.format_message()


def _command_path() -> str:
    """``potluck plan`` when the command line names a command, else ``potluck``."""
    names = {info.name or info.callback.__name__ for info in app.registered_commands
             if info.callback is not None}
    command = next((arg for arg in sys.argv[1:] if not arg.startswith("-")), None)
    return f"potluck {command}" if command in names else "potluck"


def _base_named(error_type: type, name: str) -> type:
    """click's exception class ``name`` among ``error_type``'s bases (typer re-exports only
    some of click's exceptions, and newer typers carry their own copy of click)."""
    return next(base for base in error_type.__mro__ if base.__name__ == name)


_USAGE_ERROR = _base_named(typer.BadParameter, "UsageError")  # unknown option, bad value, ...
_CLICK_ERROR = _base_named(typer.BadParameter, "ClickException")


def _fail(message: str, exit_code: int) -> None:
    text = " ".join(message.split())  # one line, however the message was wrapped
    err_console.print(f"potluck: error: {text}", highlight=False, markup=False, soft_wrap=True)
    sys.exit(exit_code)
