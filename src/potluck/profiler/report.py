"""What ``potluck profile`` prints: how long it will take, its progress, the figures measured
and the file written.

Progress goes to stderr: a bar on a terminal, else one plain line per phase (so a log or
a pipe shows it too).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from potluck.profiler import ProfileOutcome
from potluck.profiler.run import ProfileOptions, deadline_s, default_ranks, dtypes_of, estimate_s


def plan_line(options: ProfileOptions) -> str:
    """What a profile will measure and about how long it takes."""
    ranks = options.ranks or default_ranks()
    return (f"profiling {ranks} rank{'s' if ranks > 1 else ''}: matmuls at {options.model.name}'s "
            f"shapes in {', '.join(dtypes_of(options))} ({options.budget_s:g} s each), memory "
            f"bandwidth{', links and an all-reduce' if ranks > 1 else ''}; about "
            f"{estimate_s(options):.0f} s (stopped after {deadline_s(options):.0f} s)")


@contextmanager
def progress_reporter(console: Console, label: str = "profile") -> Iterator[Any]:
    """A ``progress(fraction, what)`` callback showing on ``console``: a bar on a terminal,
    else one line per call, each starting with ``label``."""
    if console.is_terminal:
        bar = Progress(TextColumn(label), BarColumn(), TextColumn("{task.description}"),
                       TimeElapsedColumn(), console=console, transient=True)
        task = bar.add_task("starting", total=1.0)
        with bar:
            yield lambda fraction, what: bar.update(task, completed=fraction, description=what)
        return
    started = time.monotonic()

    def line(fraction: float, what: str) -> None:
        console.print(f"{label}: {fraction:4.0%} {what} ({time.monotonic() - started:.0f} s)",
                      highlight=False, markup=False, soft_wrap=True)

    yield line


def outcome_json(outcome: ProfileOutcome) -> dict[str, Any]:
    """``potluck profile --json``: per-rank devices, links, the all-reduce, the file."""
    result = outcome.result
    return {
        "cluster_file": str(outcome.path),
        "device_type": outcome.device_type,
        "elapsed_s": result.elapsed_s,
        "ranks": [
            {"host": host, "device": d.device_name,
             "matmul_tflops": {k: v / 1e12 for k, v in d.matmul_flops.items()},
             "memory_bandwidth_gbps": d.memory_bandwidth_bytes_per_s / 1e9}
            for host, d in zip(result.hosts, result.devices, strict=True)
        ],
        "links": [
            {"from_rank": 0, "to_rank": p.peer, "same_host": p.same_host,
             "bandwidth_gbps": p.bandwidth_bytes_per_s / 1e9, "latency_s": p.latency_s}
            for p in result.pairs
        ],
        "allreduce_bus_bandwidth_gbps": (result.allreduce.bus_bandwidth_bytes_per_s / 1e9
                                         if result.allreduce else None),
    }


def render_outcome(console: Console, outcome: ProfileOutcome) -> None:
    result = outcome.result
    devices = Table(title=f"{len(result.devices)} ranks ({outcome.device_type})")
    dtypes = list(result.devices[0].matmul_flops)
    for column in ["rank", "host", *[f"{d} TFLOPS" for d in dtypes], "mem GB/s"]:
        devices.add_column(column, justify="left" if column == "host" else "right")
    for rank, (host, d) in enumerate(zip(result.hosts, result.devices, strict=True)):
        devices.add_row(str(rank), host, *[f"{d.matmul_flops[k] / 1e12:.3g}" for k in dtypes],
                        f"{d.memory_bandwidth_bytes_per_s / 1e9:.3g}")
    console.print(devices)
    if result.pairs:
        links = Table(title="links from rank 0")
        for column in ("to rank", "same host", "GB/s", "latency"):
            links.add_column(column, justify="right")
        for p in result.pairs:
            links.add_row(str(p.peer), "yes" if p.same_host else "no",
                          f"{p.bandwidth_bytes_per_s / 1e9:.3g}", f"{p.latency_s * 1e6:.0f} us")
        console.print(links)
    if result.allreduce is not None:
        console.print(f"all-reduce over {result.allreduce.ranks} ranks: bus bandwidth "
                      f"{result.allreduce.bus_bandwidth_bytes_per_s / 1e9:.3g} GB/s")
    device = outcome.cluster.device_type(outcome.device_type)
    console.print(f"{outcome.device_type}: matmul efficiency {device.matmul_efficiency:.3g} of "
                  f"{device.tflops:g} TFLOPS, memory bandwidth input "
                  f"{device.memory_bandwidth_bytes_per_s / 1e9:.3g} GB/s (the cost model derates it "
                  f"to what was measured)\nwrote {outcome.path} in {result.elapsed_s:.0f} s; "
                  f"plan with `potluck plan -c {outcome.path}`")
