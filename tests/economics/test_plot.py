"""The Pareto plot reads right to a person choosing hardware: units, names, the front."""

from __future__ import annotations

import pytest
from matplotlib.colors import to_hex
from matplotlib.text import Text

from potluck.economics.candidates import CostRequest
from potluck.economics.offers import parse_offers
from potluck.economics.plot import FRONT_COLOR, pareto_figure, plot_study
from potluck.economics.study import cost_study
from potluck.errors import ConfigError

OFFERS = """\
offers:
  - {name: four, gpu: rtx4090, gpus_per_node: 4}
  - {name: four-dear, gpu: rtx4090, gpus_per_node: 4, price_per_hour: 1.20}
  - {name: eight, gpu: rtx4090, gpus_per_node: 8}
  - {name: pairs, gpu: rtx3090, gpus_per_node: 8, nvlink: pairs}
  - {name: h100, gpu: h100-sxm, gpus_per_node: 8}
  - {name: a100, gpu: a100-80g-sxm, gpus_per_node: 8}
  - {name: one, gpu: rtx3090, gpus_per_node: 1}
"""


@pytest.fixture
def study(model, shape):
    return cost_study(model, shape, parse_offers(OFFERS), CostRequest(10**9, deadline_hours=0.5))


def test_axes_say_what_they_measure_with_units(study):
    axes = pareto_figure(study).axes[0]
    assert "hours" in axes.get_xlabel() and "1B tokens" in axes.get_xlabel()
    assert "USD" in axes.get_ylabel()
    assert study.model.name in axes.get_title()


def test_every_candidate_is_named_once_inside_the_axes_and_no_labels_overlap(study):
    figure = pareto_figure(study)
    axes = figure.axes[0]
    labels = [t.get_text() for t in axes.texts]
    assert sorted(labels) == sorted(c.name for c in study.candidates)
    renderer = figure.canvas.get_renderer()
    boxes = [Text.get_window_extent(t, renderer) for t in axes.texts]
    inside = axes.get_window_extent(renderer)
    assert all(inside.x0 <= b.x0 and b.x1 <= inside.x1 and inside.y0 <= b.y0 and b.y1 <= inside.y1
               for b in boxes)
    for i, box in enumerate(boxes):
        assert not any(box.overlaps(other) for other in boxes[i + 1:]), labels[i]


def test_the_front_is_highlighted_and_joined(study):
    axes = pareto_figure(study).axes[0]
    front = {c.name for c in study.pareto}
    for text in axes.texts:
        in_front = to_hex(text.get_color()) == FRONT_COLOR
        assert in_front == (text.get_text() in front)
    (line,) = [ln for ln in axes.lines if to_hex(ln.get_color()) == FRONT_COLOR]
    assert len(set(line.get_xdata())) == len(front)
    legend = [t.get_text() for t in axes.get_legend().get_texts()]
    assert any("Pareto front" in t for t in legend) and any("deadline" in t for t in legend)


def test_wide_ranges_get_log_axes(study):
    hours = [c.figures.hours_to_train for c in study.candidates]
    assert max(hours) > 10 * min(hours), "precondition: eight H100s are over ten times faster than one 3090"
    assert pareto_figure(study).axes[0].get_xscale() == "log"


def test_the_plot_is_written_as_an_image(study, tmp_path):
    path = plot_study(study, tmp_path / "costs.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_unwritable_plot_path_is_one_clear_error(study, tmp_path):
    with pytest.raises(ConfigError, match="--plot"):
        plot_study(study, tmp_path / "missing-dir" / "costs.png")
