"""The plan tables a user reads: they fit an 80-column terminal, name the dtype each device
trains in, and alternatives that share a layout say what tells them apart."""

from __future__ import annotations

import io
from dataclasses import replace

from rich.console import Console

from potluck import api
from potluck.cluster.spec import parse_cluster
from potluck.examples import example_path
from potluck.report import plan_dtype_notes, render_result, same_layout_notes, stage_order


def _rendered(width: int) -> str:
    result = api.plan(example_path("mixed.yaml"), "llama2-7b")
    out = io.StringIO()
    render_result(Console(file=out, width=width, color_system=None), result)
    return out.getvalue()


def test_the_plan_tables_fit_80_columns_without_cutting_a_value():
    text = _rendered(80)
    table_lines = [line for line in text.splitlines() if "box3090.0:0-1" in line]
    assert table_lines, text
    assert "…" not in text
    assert all(len(line) <= 80 for line in text.splitlines())


def test_stage_order_counts_runs_of_node_groups_in_pipeline_order():
    plan = api.plan(example_path("mixed.yaml"), "llama2-7b", pp=4, dp=1).best
    groups = [s.devices[0].split(".")[0] for s in plan.pipelines[0].stages]
    expanded = []
    for part in stage_order(plan).split(", "):
        name, _, count = part.partition(" x")
        expanded += [name] * int(count or 1)
    assert expanded == groups
    names = [part.partition(" x")[0] for part in stage_order(plan).split(", ")]
    assert all(a != b for a, b in zip(names, names[1:], strict=False))  # runs are maximal


def test_alternatives_with_one_layout_in_two_orders_are_told_apart():
    plan = api.plan(example_path("mixed.yaml"), "llama2-7b", pp=4, dp=1).best
    stages = plan.pipelines[0].stages
    reordered = replace(plan, pipelines=(replace(plan.pipelines[0], stages=stages[::-1]),))
    notes = same_layout_notes((plan, reordered))
    assert notes == [f"#1 stage order: {stage_order(plan)}",
                     f"#2 stage order: {stage_order(reordered)}"]
    assert same_layout_notes((plan, plan)) == []


def test_a_note_names_the_devices_that_train_in_another_dtype():
    cluster = parse_cluster("nodes:\n  - {name: a, gpu: a100-80g-sxm, gpus_per_node: 2}\n"
                            "  - {name: v, gpu: v100-32g, gpus_per_node: 2}\n", "mixed.yaml")
    plan = api.plan(cluster, "gpt3-125m", dp=4, pp=1, tp=1).best
    assert plan_dtype_notes(plan) == ["v100-32g computes in fp16, not bf16: no bf16 support"]
    cpus = parse_cluster("nodes:\n  - {name: c, gpu: cpu, gpus_per_node: 2}\n", "cpu.yaml")
    assert plan_dtype_notes(api.plan(cpus, "tiny-llama").best) == [
        "cpu computes in fp32, not bf16: CPU ranks train in fp32"]
    a100s = parse_cluster("nodes:\n  - {name: a, gpu: a100-80g-sxm, gpus_per_node: 2}\n", "a.yaml")
    assert plan_dtype_notes(api.plan(a100s, "gpt3-125m").best) == []
