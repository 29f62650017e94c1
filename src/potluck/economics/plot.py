"""The Pareto plot of a cost study: hours to train N tokens against total USD, every candidate named.

Lower left is better. The Pareto front (no other candidate is both faster
and cheaper) is drawn in colour and joined by its staircase; the others are
grey; candidates that miss the deadline are hollow, right of a dashed
deadline line. Axes turn logarithmic when the values span more than
``LOG_SPAN``. Labels are placed greedily where they overlap no earlier label
(front first), with a leader line when they had to move away. Uses the Agg
canvas directly: no pyplot, no global state.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.axis import XAxis, YAxis
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.text import Annotation, Text
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
from matplotlib.transforms import Bbox

from potluck.economics.candidates import Candidate
from potluck.economics.study import CostStudy
from potluck.errors import ConfigError

LOG_SPAN = 10.0
FRONT_COLOR = "#c0392b"
OTHER_COLOR = "#7f8c8d"
NEAR_OFFSETS_PT = ((6, 4), (6, -11), (-6, 4), (-6, -11), (0, 9), (0, -15))
FAR_OFFSETS_PT = tuple((dx * r, dy * r) for r in (1.5, 2.2, 3.0, 4.0, 5.2)
                       for dx, dy in ((14, 10), (14, -14), (-14, 10), (-14, -14), (0, 16), (0, -20),
                                      (20, 0), (-20, 0)))


def plot_study(study: CostStudy, path: str | Path) -> Path:
    """Write the Pareto plot of ``study`` to ``path`` (format from the suffix: png, svg, pdf)."""
    path = Path(path)
    try:
        pareto_figure(study).savefig(path)
    except (OSError, ValueError) as err:
        raise ConfigError(f"--plot {str(path)!r}: cannot write the plot ({err})") from None
    return path


def pareto_figure(study: CostStudy) -> Figure:
    """The Pareto plot of ``study`` as a matplotlib figure."""
    figure = Figure(figsize=(11, 7.5), dpi=130)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    front = study.pareto
    others = [c for c in study.candidates if c not in front]
    _draw_points(axes, front, others)
    _draw_front(axes, front)
    _draw_deadline(axes, study.request.deadline_hours)
    _decorate(axes, study)
    figure.tight_layout()
    _label_points(figure, axes, front, others)
    return figure


def _xy(candidates: Sequence[Candidate]) -> tuple[list[float], list[float]]:
    return ([c.figures.hours_to_train for c in candidates], [c.figures.total_usd for c in candidates])


def _draw_points(axes: Axes, front: list[Candidate], others: list[Candidate]) -> None:
    for group, color, size, label in ((front, FRONT_COLOR, 60, "Pareto front: none is both faster and "
                                       "cheaper"), (others, OTHER_COLOR, 30, "other candidates")):
        meets = [c for c in group if c.meets_deadline]
        misses = [c for c in group if not c.meets_deadline]
        if meets:
            axes.scatter(*_xy(meets), s=size, color=color, zorder=3, label=label)
        if misses:
            axes.scatter(*_xy(misses), s=size, facecolors="none", edgecolors=color, zorder=3,
                         label=f"{label}, misses the deadline")


def _draw_front(axes: Axes, front: list[Candidate]) -> None:
    if len(front) > 1:
        xs, ys = _xy(front)
        axes.step(xs, ys, where="post", color=FRONT_COLOR, linewidth=1.2, alpha=0.7, zorder=2)


def _draw_deadline(axes: Axes, deadline_hours: float | None) -> None:
    if deadline_hours is not None:
        axes.axvline(deadline_hours, color="black", linestyle="--", linewidth=1,
                     label=f"deadline: {deadline_hours:g} h")


def _decorate(axes: Axes, study: CostStudy) -> None:
    xs, ys = _xy(study.candidates)
    for axis, values in ((axes.xaxis, xs), (axes.yaxis, ys)):
        if max(values) > LOG_SPAN * min(values):
            _log_scale(axes, axis)
    axes.margins(0.12)
    tokens = _tokens_text(study.request.tokens)
    axes.set_xlabel(f"time to train {tokens} tokens (hours)")
    axes.set_ylabel(f"total cost to train {tokens} tokens (USD)")
    axes.set_title(f"{study.model.name}, {tokens} tokens, global batch {study.training.global_batch} x "
                   f"{study.training.seq_len}: time against cost\n{study.request.pricing.describe()}; "
                   "lower left is better", fontsize=11)
    axes.grid(True, which="both", alpha=0.25)
    axes.legend(loc="upper center", bbox_to_anchor=(0.5, -0.09), ncol=2, fontsize=8, frameon=False)


def _log_scale(axes: Axes, axis: XAxis | YAxis) -> None:
    """A log axis with plain numbers at 1, 2, 5 x powers of ten."""
    (axes.set_xscale if isinstance(axis, XAxis) else axes.set_yscale)("log")
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda value, _pos: f"{value:g}"))
    axis.set_minor_formatter(NullFormatter())


def _tokens_text(tokens: int) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if tokens >= scale:
            return f"{tokens / scale:g}{suffix}"
    return str(tokens)


def _label_points(figure: Figure, axes: Axes, front: list[Candidate], others: list[Candidate]) -> None:
    """Name every point, front first, where its label overlaps the fewest labels and points."""
    renderer = figure.canvas.get_renderer()  # type: ignore[attr-defined]
    placed = [_marker_box(axes, c) for c in [*front, *others]]
    inside = axes.get_window_extent(renderer)
    for candidate in [*front, *others]:
        style = {"fontweight": "bold", "color": FRONT_COLOR} if candidate in front else {}
        xy = (candidate.figures.hours_to_train, candidate.figures.total_usd)
        best: tuple[float, tuple[float, float]] | None = None
        for offset in (*NEAR_OFFSETS_PT, *FAR_OFFSETS_PT):
            text = _annotate(axes, candidate.name, xy, offset, style)
            box = _text_box(text, renderer).expanded(1.04, 1.1)
            overlap = _overlap_px2(box, placed) + _outside_px2(box, inside)
            text.remove()
            if best is None or overlap < best[0]:
                best = (overlap, offset)
            if overlap == 0:
                break
        assert best is not None
        placed.append(_text_box(_annotate(axes, candidate.name, xy, best[1], style), renderer))


def _text_box(annotation: Annotation, renderer: object) -> Bbox:
    """The box of the label's text alone (an annotation's own extent includes its leader line)."""
    annotation.update_positions(renderer)
    return Text.get_window_extent(annotation, renderer)


def _overlap_px2(box: Bbox, others: list[Bbox]) -> float:
    return sum(_intersection_px2(box, other) for other in others)


def _outside_px2(box: Bbox, inside: Bbox) -> float:
    """The area of ``box`` that sticks out of the axes."""
    return box.width * box.height - _intersection_px2(box, inside)


def _intersection_px2(a: Bbox, b: Bbox) -> float:
    width = min(a.x1, b.x1) - max(a.x0, b.x0)
    height = min(a.y1, b.y1) - max(a.y0, b.y0)
    return width * height if width > 0 and height > 0 else 0.0


def _marker_box(axes: Axes, candidate: Candidate, half_px: float = 4.0) -> Bbox:
    x, y = axes.transData.transform((candidate.figures.hours_to_train, candidate.figures.total_usd))
    return Bbox.from_extents(x - half_px, y - half_px, x + half_px, y + half_px)


def _annotate(axes: Axes, name: str, xy: tuple[float, float], offset: tuple[float, float],
              style: dict[str, str]) -> Annotation:
    far = offset not in NEAR_OFFSETS_PT
    return axes.annotate(
        name, xy, xytext=offset, textcoords="offset points", fontsize=7, **style,
        ha="left" if offset[0] > 0 else "right" if offset[0] < 0 else "center",
        va="bottom" if offset[1] >= 0 else "top",
        arrowprops={"arrowstyle": "-", "color": "#999999", "linewidth": 0.6} if far else None,
    )
