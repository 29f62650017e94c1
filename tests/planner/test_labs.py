"""The search on labs of distinct machines: as good as the best pin on issue 29's lab, and
never worse for one machine more (every plan of the smaller lab is a plan of the larger,
with the new machine left out)."""

from __future__ import annotations

import pytest

from potluck.cluster import parse_cluster
from potluck.examples import example_path
from potluck.model import load_model
from potluck.planner.search import SearchOptions, search
from potluck.plans import TrainingShape

ISSUE_LAB = example_path("five-machines.yaml").read_text()  # the lab issue 29 named

DESKTOPS = [  # (name, gpu, GPUs, NVLink, network): a lab grown one machine at a time
    ("box3090", "rtx3090", 2, "pairs", "10Gb/s"), ("d4090", "rtx4090", 1, "none", "1Gb/s"),
    ("a100", "a100-40g-pcie", 2, "none", "25Gb/s"), ("d3060", "rtx3060", 1, "none", "1Gb/s"),
    ("l40s", "l40s", 2, "none", "25Gb/s"), ("d3080", "rtx3080", 1, "none", "1Gb/s"),
    ("t4", "t4", 2, "none", "10Gb/s"), ("d2080ti", "rtx2080ti", 1, "none", "1Gb/s"),
]


def _lab(machines: int) -> str:
    return "nodes:\n" + "\n".join(
        f"  - {{name: {name}, gpu: {gpu}, gpus_per_node: {gpus}, nvlink: {nvlink}, "
        f"inter_bandwidth: {network}}}" for name, gpu, gpus, nvlink, network in DESKTOPS[:machines])


def test_issue_29s_lab_plans_as_fast_as_pinning_one_long_tp1_pipeline():
    """The default chose 48.9 s per step where ``--tp 1 --pp 14`` gave 42.7 s (issue 29)."""
    spec, model, shape = parse_cluster(ISSUE_LAB), load_model("llama2-13b"), TrainingShape(128, 4096)
    default = search(spec, model, shape).best.prediction.iteration_time_s
    pinned = search(spec, model, shape, SearchOptions(tp=1, pp=14)).best
    assert default <= pinned.prediction.iteration_time_s / 0.98


@pytest.mark.parametrize("machines", [7])
def test_one_machine_more_never_makes_the_plan_slower(machines):
    model, shape = load_model("gpt3-1.3b"), TrainingShape(64, 2048)
    smaller = search(parse_cluster(_lab(machines)), model, shape).best
    larger = search(parse_cluster(_lab(machines + 1)), model, shape).best
    assert larger.prediction.iteration_time_s <= smaller.prediction.iteration_time_s / 0.98
