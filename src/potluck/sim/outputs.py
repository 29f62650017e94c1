"""Files and summaries of a simulation: the pictures, the trace, the terminal table.

``write_outputs`` writes ``timeline.png``, ``memory.png`` and ``trace.json``
into a folder, and ``outer_cycle.json`` where the plan's islands synchronize rarely;
``render_summary`` prints what ``potluck simulate`` shows:
simulated against predicted iteration time, the bubble (with how it is
defined, beside the plan's critical-path bubble, which is defined otherwise),
the bottleneck and each device's busy, communication and idle time, in plan
order, then the islands' outer cycle (each exchange: when sent, how long, when applied,
what training waited for it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from potluck.errors import ConfigError
from potluck.ops import OpKind
from potluck.sim.outer import OuterCycle
from potluck.sim.result import SimulationResult
from potluck.sim.timeline import write_memory, write_timeline
from potluck.sim.trace import simulation_trace
from potluck.tables import compact_table
from potluck.traces import COMM, COMPUTE, Trace, TraceEvent, write_trace

MAX_TABLE_ROWS = 32


@dataclass(frozen=True)
class SimulationFiles:
    timeline: Path
    memory: Path
    trace: Path
    outer: Path | None = None  # the islands' outer cycle, where there is one


def write_outputs(result: SimulationResult, out_dir: str | Path) -> SimulationFiles:
    """Write the Gantt chart, the memory chart and the Chrome trace into ``out_dir``."""
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"cannot create output folder {str(out)!r}: {err.strerror}") from None
    cycle = result.outer_cycle
    files = SimulationFiles(out / "timeline.png", out / "memory.png", out / "trace.json",
                            out / "outer_cycle.json" if cycle else None)
    write_timeline(result, files.timeline)
    write_memory(result, files.memory)
    write_trace(simulation_trace(result), files.trace)
    if cycle and files.outer:
        write_trace(outer_trace(cycle), files.outer)
    return files


INNER_LANE, EXCHANGE_LANE = "inner steps", "outer exchange"


def outer_trace(cycle: OuterCycle) -> Trace:
    """One outer period as a Chrome trace: the inner steps (and their waits) on one lane, the
    exchanges between the islands on their own (``outer_sync``, as the runtime records them;
    the fragment as the chunk, the step it is sent after as the step)."""
    trace = Trace([INNER_LANE, EXCHANGE_LANE], metadata={
        "source": "simulator", "outer_cycle": cycle.sync.value, "period_s": cycle.period_s})
    for step in cycle.steps:
        trace.events.append(TraceEvent(INNER_LANE, COMPUTE, "inner_step", step.start_s,
                                       cycle.step_s, step=step.step))
        if step.waited_s > 0.0:
            trace.events.append(TraceEvent(INNER_LANE, COMM, "outer_wait",
                                           step.end_s - step.waited_s, step.waited_s,
                                           step=step.step))
    for send in cycle.sends:
        trace.events.append(TraceEvent(EXCHANGE_LANE, COMM, OpKind.OUTER_SYNC.value, send.start_s,
                                       send.end_s - send.start_s, chunk=send.fragment,
                                       step=send.sent_after_step))
    return trace


def _outer_part(result: SimulationResult) -> str:
    """The islands' amortized outer exchange, where the plan has islands."""
    if not result.plan.islands.split:
        return ""
    islands = result.plan.islands
    return (f" · outer exchange {result.outer_s:.4g} s per step (amortized over "
            f"H={islands.inner_steps}, {islands.fragments} fragment(s))")


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
        f"pipeline {result.pipeline_time_s:.4g} s{_outer_part(result)}\n"
        f"{bubble_line(result)}\n"
        f"busiest device: [bold red]{bottleneck.device}[/bold red] (pipeline {bottleneck.pipeline} "
        f"stage {bottleneck.stage}) busy {bottleneck.busy_s / result.iteration_time_s:.0%}\n"
        f"critical path: {result.critical_summary()}"
    )
    console.print(_table(result))
    if result.outer_cycle is not None:
        console.print(outer_table(result.outer_cycle))
    if files is not None:
        outer = f", {files.outer}" if files.outer else ""
        console.print(f"wrote {files.timeline}, {files.memory}, {files.trace}{outer} "
                      "(open in ui.perfetto.dev)")


def bubble_line(result: SimulationResult) -> str:
    """The simulated bubble with its definition, beside the plan's, which counts otherwise."""
    from potluck.planner.evaluate import predict

    predicted = predict(result.plan)
    plan_bubble_s = predicted.breakdown.bubble_s
    return (f"bubble {result.bubble_fraction:.1%}: the devices' idle share of their time until "
            f"the last forward or backward ends, every stage counted; the plan's bubble "
            f"({plan_bubble_s:.3g} s, {plan_bubble_s / predicted.iteration_time_s:.1%} of its "
            f"iteration) is the critical path's: what the slowest pipeline's bottleneck stage "
            f"waits beyond its compute, TP and sends")


def _table(result: SimulationResult) -> Table:
    """Devices in plan order (pipeline, stage); past :data:`MAX_TABLE_ROWS`, the busiest."""
    devices = result.devices
    if len(devices) > MAX_TABLE_ROWS:
        busiest = set(sorted(range(len(devices)), key=lambda i: -devices[i].busy_s)[:MAX_TABLE_ROWS])
        devices = tuple(d for i, d in enumerate(devices) if i in busiest)
    title = "per device" if len(devices) == len(result.devices) else \
        f"the {MAX_TABLE_ROWS} busiest of {len(result.devices)} devices"
    table = compact_table(title, ("device", "pipe", "stage", "busy s", "compute s", "TP s",
                                  "transfer s", "idle s", "peak GB"), left=("device",))
    for d in devices:
        table.add_row(d.device, str(d.pipeline), str(d.stage), f"{d.busy_s:.4g}",
                      f"{d.compute_s:.4g}", f"{d.tp_comm_s:.3g}", f"{d.transfer_s:.3g}",
                      f"{d.idle_s:.3g}", f"{d.peak_memory_bytes / 1e9:.2f}")
    return table


def outer_table(cycle: OuterCycle) -> Table:
    """One outer period: each exchange, when it is sent and applied (steps past H are the
    next period's), how long it takes and what training waits for it."""
    h = len(cycle.steps)
    title = (f"outer cycle ({cycle.sync.value}, H={h}, {cycle.period_s:.4g} s): waited "
             f"{cycle.waited_s:.4g} s, {cycle.waited_s / h:.4g} s per step")
    table = compact_table(title, ("fragment", "sent after step", "exchange s",
                                  "applied after step", "waited s"), left=("fragment",))
    for send in cycle.sends:
        table.add_row(str(send.fragment), str(send.sent_after_step),
                      f"{send.end_s - send.start_s:.4g}", str(send.applied_after_step),
                      f"{send.waited_s:.4g}")
    return table
