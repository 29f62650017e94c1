"""The ``potluck`` command line: a thin shell over :mod:`potluck.api`.

Every command parses its flags, calls the API and renders the result. A
``PotluckError`` becomes one line on stderr and a non-zero exit code.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from potluck import api
from potluck.errors import PotluckError

app = typer.Typer(
    add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
    help="Plan, predict and run hybrid-parallel training on the GPUs you actually have.",
)
console = Console()
err_console = Console(stderr=True)

ClusterOpt = Annotated[Path, typer.Option("--cluster", "-c", help="Cluster YAML file.")]
ModelOpt = Annotated[str, typer.Option("--model", "-m", help="Preset name, config.json or HF model dir.")]


@app.command()
def plan(
    cluster: ClusterOpt,
    model: ModelOpt,
    global_batch: Annotated[int | None, typer.Option(help="Sequences per iteration [64].")] = None,
    seq_len: Annotated[int | None, typer.Option(help="Tokens per sequence [min(2048, model's)].")] = None,
    dtype: Annotated[str, typer.Option(help="bf16 or fp16 (devices without bf16 use fp16).")] = "bf16",
    tp: Annotated[int | None, typer.Option(help="Pin the tensor-parallel degree.")] = None,
    pp: Annotated[int | None, typer.Option(help="Pin the number of pipeline stages.")] = None,
    dp: Annotated[int | None, typer.Option(help="Pin the number of data-parallel replicas.")] = None,
    micro_batch_size: Annotated[int | None, typer.Option(help="Pin the micro-batch size.")] = None,
    recompute: Annotated[str | None, typer.Option(help="Pin recomputation: none|selective|full.")] = None,
    partition: Annotated[str, typer.Option(help="balanced, or uniform (even-split baseline).")] = "balanced",
    schedule: Annotated[str, typer.Option(help="1f1b (default), gpipe, interleaved or zb.")] = "1f1b",
    zero1: Annotated[bool | None, typer.Option(
        "--zero1/--no-zero1", help="Shard optimizer states [only if needed to fit].")] = None,
    top: Annotated[int, typer.Option("--top", help="How many plans to show.")] = 5,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")] = False,
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", help="Write the best plan to this file.")] = None,
) -> None:
    """Find the fastest data/tensor/pipeline-parallel plan for a model on a cluster."""
    from potluck.plans import save_plan
    from potluck.report import render_result, result_json

    _check_choice("--dtype", dtype, ("bf16", "fp16"))
    _check_choice("--partition", partition, ("balanced", "uniform"))
    _check_choice("--schedule", schedule, ("1f1b", "gpipe", "interleaved", "zb"))
    if recompute is not None:
        _check_choice("--recompute", recompute, ("none", "selective", "full"))
    with _progress("planning", enabled=not as_json) as report:
        result = api.plan(
            cluster, model, global_batch=global_batch, seq_len=seq_len, dtype=dtype, tp=tp,
            pp=pp, dp=dp, micro_batch_size=micro_batch_size, recompute=recompute,
            partition=partition, schedule=schedule, zero1=zero1, top_k=top, progress=report,
        )
    if output is not None:
        save_plan(result.best, output)
    if as_json:
        sys.stdout.write(json.dumps(result_json(result)) + "\n")
        return
    render_result(console, result)
    if output is not None:
        console.print(f"plan written to {output}")


@app.command()
def simulate(
    plan_file: Annotated[Path, typer.Argument(help="A plan file from `potluck plan -o`.")],
    schedule: Annotated[str | None, typer.Option(
        help="gpipe, 1f1b, interleaved or zb [the plan's].")] = None,
    out: Annotated[Path | None, typer.Option(
        "--out", help="Folder for timeline.png, memory.png, trace.json [<plan>-sim].")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")] = False,
) -> None:
    """Simulate one training iteration of a plan: timeline, memory, Chrome trace, summary."""
    from potluck.sim.outputs import render_summary, write_outputs

    if schedule is not None:
        _check_choice("--schedule", schedule, ("gpipe", "1f1b", "interleaved", "zb"))
    result = api.simulate(plan_file, schedule=schedule)
    files = write_outputs(result, out or Path(f"{plan_file.stem}-sim"))
    if as_json:
        sys.stdout.write(json.dumps(result.summary()) + "\n")
        return
    render_summary(console, result, files)


@app.command()
def profile(
    out: Annotated[Path | None, typer.Option(
        "--out", "-o", help="Cluster file to write [cluster.yaml, or <cluster>-calibrated.yaml].")] = None,
    cluster: Annotated[Path | None, typer.Option(
        "--cluster", "-c", help="Calibrate this cluster file instead of describing this machine.")] = None,
    model: Annotated[str, typer.Option("--model", "-m", help="Whose GEMM shapes to time.")] = "llama2-7b",
    ranks: Annotated[int | None, typer.Option(help="Local ranks to spawn [GPUs, or 2 on CPU].")] = None,
    budget: Annotated[float, typer.Option(help="Seconds of matmul timing per dtype.")] = 1.0,
    device_type: Annotated[str | None, typer.Option(help="Catalog name of this device.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")] = False,
) -> None:
    """Measure this machine's devices and links (torch.distributed) and write a calibrated cluster file."""
    from potluck.profiler.report import outcome_json, render_outcome

    target = out or (Path(f"{cluster.stem}-calibrated.yaml") if cluster else Path("cluster.yaml"))
    with _progress("profiling", enabled=not as_json) as report:
        outcome = api.profile(target, model=model, cluster=cluster, ranks=ranks, budget_s=budget,
                              device_type=device_type, progress=report)
    if outcome is None:  # a torchrun rank other than 0
        return
    if as_json:
        sys.stdout.write(json.dumps(outcome_json(outcome)) + "\n")
        return
    render_outcome(console, outcome)


@app.command()
def demo() -> None:
    """Plan a built-in mixed cluster (3090 pairs, 4090s, A100s) and compare with the even split."""
    from potluck.demo import run_demo
    from potluck.report import render_plan

    outcome = run_demo()
    console.rule(f"potluck demo: {outcome.model} on {outcome.cluster}")
    render_plan(console, outcome.balanced)
    console.print(
        f"\nThe Megatron-style even split (--partition uniform) would take "
        f"{outcome.uniform.prediction.iteration_time_s:.2f} s per iteration; potluck's plan takes "
        f"{outcome.balanced.prediction.iteration_time_s:.2f} s: [bold]{outcome.speedup:.2f}x[/bold] "
        "faster."
    )


@app.command()
def catalog() -> None:
    """List the GPU types potluck knows, with their figures."""
    from rich.table import Table

    from potluck.cluster.catalog import catalog as device_catalog

    table = Table(title="Device catalog (override any figure in your cluster file)")
    for column in ("name", "TFLOPS", "memory GB", "mem BW GB/s", "link", "bf16", "$/h"):
        table.add_column(column, justify="left" if column in ("name", "link") else "right")
    for name, d in device_catalog().items():
        table.add_row(name, f"{d.tflops:g}", f"{d.memory_bytes / 1e9:g}",
                      f"{d.memory_bandwidth_bytes_per_s / 1e9:g}", d.link.value,
                      "yes" if d.bf16 else "no", f"{d.price_per_hour_usd:.2f}")
    console.print(table)


def _check_choice(flag: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise PotluckError(f"{flag} must be one of {', '.join(allowed)}, not {value!r}")


class _progress:
    """A progress bar on stderr for long searches; silent when disabled or not a terminal."""

    def __init__(self, label: str, enabled: bool) -> None:
        self.label = label
        self.enabled = enabled and err_console.is_terminal
        self.bar: Progress | None = None
        self.task = None

    def __enter__(self):
        if not self.enabled:
            return None
        self.bar = Progress(TextColumn(self.label), BarColumn(), TimeElapsedColumn(),
                            console=err_console, transient=True)
        self.bar.start()
        self.task = self.bar.add_task(self.label, total=1.0)
        return self._update

    def _update(self, fraction: float) -> None:
        assert self.bar is not None
        self.bar.update(self.task, completed=fraction)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()


def main() -> None:
    """Entry point: run the app, turning user errors into one line and an exit code."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        app(standalone_mode=True)
    except PotluckError as err:
        err_console.print(f"potluck: error: {err}", highlight=False, markup=False, soft_wrap=True)
        sys.exit(err.exit_code)
    except KeyboardInterrupt:
        err_console.print("potluck: interrupted")
        sys.exit(130)
