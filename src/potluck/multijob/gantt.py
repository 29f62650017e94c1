"""The Gantt chart of a schedule: every machine of the cluster over time, coloured by job.

One row per machine (grouped by node group, labelled with its GPU type), one bar per job
segment on each machine it held; the restart at the start of a segment is drawn pale.
Each job's name is written on its longest segment where the bar is wide enough. Uses the
Agg canvas directly, as :mod:`potluck.economics.plot` does: no pyplot, no global state.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from potluck.errors import ConfigError
from potluck.multijob.allocations import machine_ids
from potluck.multijob.machines import Machine, machine_name
from potluck.multijob.simulation import HOUR_S, ScheduleResult, Segment

ROW_INCHES = 0.28
MAX_TICK_ROWS = 40  # more machines than this: label the node groups only
LABEL_MIN_SHARE = 0.04  # a bar this share of the time axis wide gets its job's name


def write_gantt(result: ScheduleResult, path: str | Path) -> Path:
    """Write the Gantt chart of ``result`` to ``path`` (format from the suffix)."""
    path = Path(path)
    try:
        gantt_figure(result).savefig(path)
    except (OSError, ValueError) as err:
        raise ConfigError(f"--gantt {str(path)!r}: cannot write the chart ({err})") from None
    return path


def gantt_figure(result: ScheduleResult) -> Figure:
    """The Gantt chart of ``result`` as a matplotlib figure."""
    machines = list(machine_ids(result.cluster))
    rows = {machine: row for row, machine in enumerate(machines)}
    figure = Figure(figsize=(12, 1.6 + ROW_INCHES * len(machines)), dpi=110)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    colours = colormaps["tab20"]
    span_h = max(result.makespan_h, 1e-6)
    for number, outcome in enumerate(result.outcomes):
        colour = colours(number % colours.N)
        for segment in outcome.segments:
            _draw_segment(axes, segment, rows, colour)
        _label(axes, outcome.job.name, outcome.main, rows, span_h)
    _decorate(axes, result, machines)
    figure.tight_layout()
    return figure


def _draw_segment(axes: Axes, segment: Segment, rows: dict[Machine, int], colour) -> None:
    start_h, restart_h = segment.start_s / HOUR_S, segment.training_from_s / HOUR_S
    end_h = segment.end_s / HOUR_S
    for machine in segment.machines:
        row = rows[machine]
        axes.broken_barh([(start_h, min(restart_h, end_h) - start_h)], (row - 0.4, 0.8),
                         facecolors=colour, alpha=0.35, linewidth=0)
        if end_h > restart_h:
            axes.broken_barh([(restart_h, end_h - restart_h)], (row - 0.4, 0.8),
                             facecolors=colour, edgecolor="white", linewidth=0.4)


def _label(axes: Axes, name: str, segment: Segment, rows: dict[Machine, int], span_h: float) -> None:
    width_h = (segment.end_s - segment.start_s) / HOUR_S
    if width_h < LABEL_MIN_SHARE * span_h:
        return
    middle = sum(rows[m] for m in segment.machines) / len(segment.machines)
    axes.text((segment.start_s + segment.end_s) / 2 / HOUR_S, middle, name, ha="center",
              va="center", fontsize=7, clip_on=True)


def _decorate(axes: Axes, result: ScheduleResult, machines: list[Machine]) -> None:
    spec = result.cluster
    gpu = {group.name: group.gpu for group in spec.nodes}
    if len(machines) <= MAX_TICK_ROWS:
        axes.set_yticks(range(len(machines)),
                        [f"{machine_name(m)} ({gpu[m[0]]})" for m in machines], fontsize=7)
    else:
        firsts = [row for row, m in enumerate(machines) if m[1] == 0]
        axes.set_yticks(firsts, [f"{m[0]} ({gpu[m[0]]})" for m in machines if m[1] == 0],
                        fontsize=8)
    for row, machine in enumerate(machines):
        if machine[1] == 0 and row:
            axes.axhline(row - 0.5, color="grey", linewidth=0.6)
    axes.set_ylim(len(machines) - 0.5, -0.5)
    axes.set_xlim(0, max(o.end_h for o in result.outcomes) * 1.01)
    axes.set_xlabel("hours")
    axes.set_title(f"potluck schedule ({result.policy.value}) on {spec.name}: average JCT "
                   f"{result.avg_completion_h:.2f} h, makespan {result.makespan_h:.2f} h",
                   fontsize=10)
    axes.grid(axis="x", alpha=0.3)
