"""Pictures of a simulated iteration: the Gantt chart (timeline.png) and memory.png.

The Gantt chart has one row per device (one per stage of each distinct
pipeline when a plan has more than 64 devices; identical replicas are drawn
once and labelled ``x N``). Forward, backward, weight backward, tensor-parallel
collectives and the optimizer step fill the row in distinct colours; the light
grey behind them is idle time; pipeline transfers and gradient all-reduces
run in a thin band at the bottom of the row (they overlap compute), and so does the part of
a split plan's outer exchange between islands that a step waits for, amortized over the
inner steps and drawn at the step's end (the exchange itself runs every H steps). Thin
lines separate stages, thick lines pipelines. Each row ends with its busy
share, and the busiest device, the one the others wait for, is marked in red.

Drawn with matplotlib's object API (no pyplot state), so it is safe in
libraries and tests.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from potluck.ops import OpKind
from potluck.sim.result import SimulationResult

MAX_DEVICE_ROWS = 64
TRANSFER, IDLE = "transfer", "idle"  # bars that are no single op kind: any send, no op
OUTER = "outer"  # islands' outer exchange, its amortized exposed part at the step's end
COLOURS: dict[str, str] = {
    OpKind.FORWARD: "#4C72B0", OpKind.BACKWARD: "#DD8452", OpKind.BACKWARD_INPUT: "#DD8452",
    OpKind.BACKWARD_WEIGHT: "#E8C547", OpKind.TP_ALLREDUCE: "#8172B3", OpKind.OPTIMIZER: "#937860",
    TRANSFER: "#55A868", OpKind.DP_ALLREDUCE: "#2A9D8F", IDLE: "#EEEEEE", OUTER: "#C44E52",
}
LEGEND = [(OpKind.FORWARD, "forward"), (OpKind.BACKWARD, "backward"),
          (OpKind.BACKWARD_WEIGHT, "weight backward"), (OpKind.TP_ALLREDUCE, "TP collective"),
          (TRANSFER, "pipeline send/recv"), (OpKind.DP_ALLREDUCE, "gradient all-reduce"),
          (OpKind.OPTIMIZER, "optimizer"), (IDLE, "idle")]
COMPUTE_BARS = (OpKind.FORWARD, OpKind.BACKWARD, OpKind.BACKWARD_INPUT, OpKind.BACKWARD_WEIGHT,
                OpKind.OPTIMIZER, OpKind.TP_ALLREDUCE)
COMM_BARS = (TRANSFER, OpKind.DP_ALLREDUCE, OUTER)
OUTER_LEGEND = (OUTER, "outer exchange (amortized)")


@dataclass
class _Row:
    label: str
    pipeline: int
    stage: int
    busy_s: float
    bars: dict[str, list[tuple[float, float]]] = field(default_factory=lambda: defaultdict(list))


def write_timeline(result: SimulationResult, path: str | Path) -> None:
    """Save the Gantt chart of ``result`` as a PNG."""
    write_timelines([(None, result)], path)


def write_timelines(results: list[tuple[str | None, SimulationResult]], path: str | Path) -> None:
    """Save the Gantt charts of several simulated iterations, one above the other on one
    time axis (a plan before and after a change), each titled by its label."""
    rows = [_rows(result) for _, result in results]
    longest_s = max(result.iteration_time_s for _, result in results)
    scale, unit = _time_unit(longest_s)
    heights = [1.0 + 0.28 * len(r) for r in rows]
    fig = Figure(figsize=(14, 0.6 + sum(heights)), dpi=110)
    axes = fig.subplots(len(results), 1, squeeze=False, height_ratios=heights)[:, 0]
    for ax, (label, result), chart in zip(axes, results, rows, strict=True):
        _draw_chart(ax, result, chart, scale, longest_s)
        title = _title(result, chart)
        ax.set_title(f"{label}: {title}" if label else title, fontsize=10)
    axes[-1].set_xlabel(f"time ({unit})   ·   right: busy share; red: the busiest device")
    height_in = fig.get_figheight()
    legend = [*LEGEND, *([OUTER_LEGEND] if any(r.outer_s for _, r in results) else [])]
    fig.legend(handles=[Patch(color=COLOURS[k], label=label) for k, label in legend],
               loc="upper center", ncol=len(legend), fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.3 / height_in))  # room for the legend on top
    fig.savefig(path)


def _draw_chart(ax, result: SimulationResult, rows: list[_Row], scale: float,
                longest_s: float) -> None:
    bottleneck = max(range(len(rows)), key=lambda r: rows[r].busy_s)
    for y, row in enumerate(rows):
        _draw_row(ax, y, row, result.iteration_time_s, scale)
        ax.text(result.iteration_time_s * scale * 1.005, y,
                f"{row.busy_s / result.iteration_time_s:.0%}", va="center", fontsize=7,
                color="#B22222" if y == bottleneck else "#333333")
    _draw_boundaries(ax, rows)
    ax.set_yticks(range(len(rows)), [r.label for r in rows], fontsize=7 if len(rows) > 24 else 8)
    ax.get_yticklabels()[bottleneck].set_color("#B22222")
    ax.get_yticklabels()[bottleneck].set_fontweight("bold")
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, longest_s * scale * 1.04)


def _title(result: SimulationResult, rows: list[_Row]) -> str:
    devices = result.plan.num_gpus
    shown = "" if len(rows) >= devices else f" · {len(rows)} rows for {devices} devices"
    return (f"{result.plan.layout()} · {result.schedule.value} · iteration "
            f"{result.iteration_time_s:.4g} s · bubble {result.bubble_fraction:.1%}{shown}\n"
            f"critical path: {result.critical_summary()}\n")


def _time_unit(total_s: float) -> tuple[float, str]:
    return (1.0, "s") if total_s >= 1.0 else (1e3, "ms")


def _rows(result: SimulationResult) -> list[_Row]:
    """One row per device, or per stage of each distinct pipeline for large plans."""
    plan, per_device = result.plan, result.plan.num_gpus <= MAX_DEVICE_ROWS
    twins = defaultdict(int)
    for run in result.pipelines:
        twins[run.twin_of] += 1
    busy = {(d.pipeline, d.stage): d.busy_s for d in result.devices}
    rows = []
    for k, pipeline in enumerate(plan.pipelines):
        if not per_device and result.pipelines[k].twin_of != k:
            continue
        for i, stage in enumerate(pipeline.stages):
            labels = ([f"{d}  p{k}s{i}" for d in stage.devices] if per_device
                      else [f"p{k} s{i} [{stage.devices[0]}, tp={stage.tp}]"
                            + (f" x{twins[k]}" if twins[k] > 1 else "")])
            rows.extend(_Row(label, k, i, busy[(k, i)]) for label in labels)
    _fill_bars(result, rows)
    return rows[:MAX_DEVICE_ROWS * 2]


def _fill_bars(result: SimulationResult, rows: list[_Row]) -> None:
    bars: dict[tuple[int, int], dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for k in {row.pipeline for row in rows}:
        for op in result.pipelines[k].ops:
            span = (op.start_s, op.end_s - op.start_s)
            if op.peer != -1:
                bars[(k, op.stage)][TRANSFER].append(span)
                bars[(k, op.peer)][TRANSFER].append(span)
                continue
            bars[(k, op.stage)][op.kind].append(span)
            if op.tp_s > 0:
                bars[(k, op.stage)][OpKind.TP_ALLREDUCE].append((op.end_s - op.tp_s, op.tp_s))
    for sync in result.gradient_syncs:
        for member in sync.members:
            bars[member][OpKind.DP_ALLREDUCE].append((sync.start_s, sync.end_s - sync.start_s))
    for step in result.optimizer_steps:
        bars[(step.pipeline, step.stage)][OpKind.OPTIMIZER].append((step.start_s, step.end_s - step.start_s))
    for row in rows:
        row.bars = bars[(row.pipeline, row.stage)]
        if result.outer_s:
            row.bars[OUTER].append((result.iteration_time_s - result.outer_s, result.outer_s))


def _draw_row(ax, y: int, row: _Row, total_s: float, scale: float) -> None:
    ax.broken_barh([(0, total_s * scale)], (y - 0.4, 0.8), color=COLOURS[IDLE])
    for kind in COMPUTE_BARS:
        spans = [(start * scale, width * scale) for start, width in row.bars.get(kind, ())]
        if spans:
            ax.broken_barh(spans, (y - 0.4, 0.8), color=COLOURS[kind], linewidth=0)
    for kind in COMM_BARS:
        spans = [(start * scale, width * scale) for start, width in row.bars.get(kind, ())]
        if spans:
            ax.broken_barh(spans, (y + 0.22, 0.18), color=COLOURS[kind], linewidth=0)


def _draw_boundaries(ax, rows: list[_Row]) -> None:
    for y in range(1, len(rows)):
        before, after = rows[y - 1], rows[y]
        if before.pipeline != after.pipeline:
            ax.axhline(y - 0.5, color="black", linewidth=1.2)
        elif before.stage != after.stage:
            ax.axhline(y - 0.5, color="#888888", linewidth=0.6)


def write_memory(result: SimulationResult, path: str | Path, max_lines: int = 24) -> None:
    """Save each stage's memory over the iteration (GB per device) as a PNG."""
    plan = result.plan
    scale, unit = _time_unit(result.iteration_time_s)
    traces = [(k, i, result.memory[k][i]) for k, run in enumerate(result.pipelines)
              if run.twin_of == k for i in range(plan.pipelines[k].pp)]
    traces.sort(key=lambda item: -item[2].peak_bytes)
    fig = Figure(figsize=(12, 5), dpi=110)
    ax = fig.subplots()
    for k, i, trace in traces[:max_lines]:
        times = [t * scale for t in trace.times_s] + [result.iteration_time_s * scale]
        held = [b / 1e9 for b in trace.bytes] + [trace.bytes[-1] / 1e9]
        ax.step(times, held, where="post", linewidth=1.2,
                label=f"p{k} s{i} {plan.pipelines[k].stages[i].devices[0]}")
    _capacity_lines(ax, result)
    ax.set_xlabel(f"time ({unit})")
    ax.set_ylabel("GB per device")
    shown = "" if len(traces) <= max_lines else f" (the {max_lines} highest of {len(traces)} stages)"
    ax.set_title(f"Memory per device: {plan.layout()} · {result.schedule.value}{shown}", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path)


def _capacity_lines(ax, result: SimulationResult) -> None:
    from potluck.cluster.topology import Cluster
    from potluck.planner.cost import usable_memory_bytes

    cluster = Cluster(result.plan.cluster)
    names_by_gb: dict[float, list[str]] = defaultdict(list)
    for device_type in {cluster.device(d).type for d in result.plan.devices}:
        names_by_gb[usable_memory_bytes(device_type) / 1e9].append(device_type.name)
    for gb, names in names_by_gb.items():
        ax.axhline(gb, linestyle="--", linewidth=0.8, color="#B22222")
        ax.annotate(f"{', '.join(sorted(names))} usable", (0, gb), fontsize=7, color="#B22222",
                    va="bottom")
