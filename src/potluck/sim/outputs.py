"""Files and summaries of a simulation: the pictures, the trace, the terminal table.

``write_outputs`` writes ``timeline.png``, ``memory.png`` and ``trace.json``
into a folder; ``render_summary`` prints what ``potluck simulate`` shows:
simulated against predicted iteration time, the bubble, the bottleneck and
each device's busy, communication and idle time.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from potluck.errors import ConfigError
from potluck.sim.result import SimulationResult
from potluck.sim.timeline import write_memory, write_timeline
from potluck.sim.trace import simulation_trace
from potluck.tables import compact_table
from potluck.traces import write_trace

MAX_TABLE_ROWS = 32


@dataclass(frozen=True)
class SimulationFiles:
    timeline: Path
    memory: Path
    trace: Path


def write_outputs(result: SimulationResult, out_dir: str | Path) -> SimulationFiles:
    """Write the Gantt chart, the memory chart and the Chrome trace into ``out_dir``."""
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"cannot create output folder {str(out)!r}: {err.strerror}") from None
    files = SimulationFiles(out / "timeline.png", out / "memory.png", out / "trace.json")
    write_timeline(result, files.timeline)
    write_memory(result, files.memory)
    write_trace(simulation_trace(result), files.trace)
    return files


def render_summary(console: Console, result: SimulationResult,
                   files: SimulationFiles | None = None) -> None:
    """The headline figures and the per-device table."""
    error = result.predicted_time_s / result.iteration_time_s - 1.0
    side = "below" if error < 0 else "above"
    bottleneck = result.bottleneck
    console.print(
        f"[bold]{result.plan.layout()}[/bold] · {result.schedule.value} · "
        f"{result.plan.num_gpus} devices\n"
        f"simulated iteration [bold]{result.iteration_time_s:.4g} s[/bold] "
        f"(the cost model predicts {result.predicted_time_s:.4g} s, {abs(error):.1%} {side}) · "
        f"bubble {result.bubble_fraction:.1%} · pipeline {result.pipeline_time_s:.4g} s\n"
        f"busiest device: [bold red]{bottleneck.device}[/bold red] (pipeline {bottleneck.pipeline} "
        f"stage {bottleneck.stage}) busy {bottleneck.busy_s / result.iteration_time_s:.0%}\n"
        f"critical path: {result.critical_summary()}"
    )
    console.print(_table(result))
    if files is not None:
        console.print(f"wrote {files.timeline}, {files.memory}, {files.trace} (open in ui.perfetto.dev)")


def _table(result: SimulationResult) -> Table:
    devices = sorted(result.devices, key=lambda d: -d.busy_s)
    title = "per device" if len(devices) <= MAX_TABLE_ROWS else \
        f"the {MAX_TABLE_ROWS} busiest of {len(devices)} devices"
    table = compact_table(title, ("device", "pipe", "stage", "busy s", "compute s", "TP s",
                                  "transfer s", "idle s", "peak GB"), left=("device",))
    for d in devices[:MAX_TABLE_ROWS]:
        table.add_row(d.device, str(d.pipeline), str(d.stage), f"{d.busy_s:.4g}",
                      f"{d.compute_s:.4g}", f"{d.tp_comm_s:.3g}", f"{d.transfer_s:.3g}",
                      f"{d.idle_s:.3g}", f"{d.peak_memory_bytes / 1e9:.2f}")
    return table
