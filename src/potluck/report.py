"""Presenting plans: the JSON summary of ``potluck plan --json`` and the rich tables.

The summary fields are documented in the README; keep the two in step.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from potluck.cluster.topology import Cluster
from potluck.planner.search import SearchResult
from potluck.plans import Plan, Prediction, plan_to_dict
from potluck.units import format_duration

GB = 1e9


def plan_summary(plan: Plan) -> dict[str, Any]:
    """The headline figures of one plan, as in ``potluck plan --json``."""
    prediction = _prediction(plan)
    cluster = Cluster(plan.cluster)
    memory = {m.device: m for m in prediction.memory}
    devices = []
    for device_id in plan.devices:
        device, used = cluster.device(device_id), memory[device_id]
        devices.append({
            "id": device_id, "node": device.node, "type": device.type.name,
            "pipeline": used.pipeline, "stage": used.stage,
            "memory_gb": round(used.total_bytes / GB, 3),
            "memory_capacity_gb": round(device.type.memory_bytes / GB, 3),
        })
    breakdown = prediction.breakdown
    return {
        "layout": plan.layout(),
        "iteration_time_s": prediction.iteration_time_s,
        "tokens_per_s": prediction.tokens_per_s,
        "tflops_per_gpu": prediction.tflops_per_gpu,
        "mfu": prediction.mfu,
        "peak_memory_gb": prediction.peak_memory_bytes / GB,
        "num_gpus": plan.num_gpus,
        "unused_devices": list(plan.unused_devices),
        "micro_batch_size": plan.pipelines[0].micro_batch_size,
        "recompute": plan.recompute.value,
        "schedule": plan.schedule.value,
        "breakdown_s": {k: getattr(breakdown, k) for k in breakdown.__dataclass_fields__},
        "devices": devices,
        "notes": list(plan.notes),
    }


def result_json(result: SearchResult) -> dict[str, Any]:
    """``potluck plan --json``: the best plan's figures, the plan itself, the alternatives."""
    best = result.best
    summary = plan_summary(best)
    summary["search_time_s"] = result.search_time_s
    summary["search_notes"] = list(result.notes)
    summary["candidates"] = result.candidates
    summary["alternatives"] = [
        {k: v for k, v in plan_summary(p).items() if k not in ("devices",)}
        for p in result.plans[1:]
    ]
    summary["plan"] = plan_to_dict(best)
    return summary


def _prediction(plan: Plan) -> Prediction:
    if plan.prediction is None:
        from potluck.planner.cost import CostModel

        return CostModel.for_plan(plan).evaluate(plan)
    return plan.prediction


def render_result(console: Console, result: SearchResult) -> None:
    """The best plan as tables, then its alternatives."""
    best = result.best
    render_plan(console, best)
    if len(result.plans) > 1:
        console.print(_alternatives_table(result.plans))
    console.print(
        f"[dim]searched {result.candidates} candidates in {result.search_time_s:.2f} s[/dim]"
    )


def render_plan(console: Console, plan: Plan) -> None:
    prediction = _prediction(plan)
    shape = plan.training
    console.print(
        f"[bold]{plan.model.name}[/bold] on [bold]{plan.cluster.name}[/bold] "
        f"({plan.num_gpus} of {plan.cluster.num_gpus} GPUs): {plan.layout()}, "
        f"micro-batch {plan.pipelines[0].micro_batch_size}, recompute {plan.recompute.value}, "
        f"schedule {plan.schedule.value}; global batch {shape.global_batch} x {shape.seq_len} "
        f"tokens, {shape.dtype.value}"
    )
    console.print(_stage_table(plan, prediction))
    console.print(_headline_table(prediction))
    for note in plan.notes:
        console.print(f"[yellow]note:[/yellow] {note}")


def _stage_table(plan: Plan, prediction: Prediction) -> Table:
    cluster = Cluster(plan.cluster)
    memory = {m.device: m.total_bytes for m in prediction.memory}
    table = Table(title="Pipelines and stages", title_justify="left")
    for column in ("pipe", "batch", "stage", "devices", "type", "tp", "layers",
                   "memory GB", "time/µbatch"):
        table.add_column(column, justify="right" if column != "devices" else "left")
    for k, pipeline in enumerate(plan.pipelines):
        for i, stage in enumerate(pipeline.stages):
            device_type = cluster.device(stage.devices[0]).type
            peak = max(memory[d] for d in stage.devices)
            layers = ", ".join(f"{a}-{b - 1}" for a, b in stage.layer_ranges)
            table.add_row(
                str(k) if i == 0 else "",
                f"{pipeline.num_micro_batches}x{pipeline.micro_batch_size}" if i == 0 else "",
                str(i), compact_ids(stage.devices), device_type.name, str(stage.tp), layers,
                f"{peak / GB:.1f}/{device_type.memory_bytes / GB:.0f}",
                format_duration(prediction.stage_times_s[k][i]),
            )
    return table


def _headline_table(prediction: Prediction) -> Table:
    table = Table(title="Predicted iteration", title_justify="left")
    b = prediction.breakdown
    for column in ("iteration", "tokens/s", "TFLOPS/GPU", "MFU", "compute", "bubble", "TP",
                   "PP", "DP", "optimizer"):
        table.add_column(column, justify="right")
    table.add_row(
        format_duration(prediction.iteration_time_s), f"{prediction.tokens_per_s:,.0f}",
        f"{prediction.tflops_per_gpu:.1f}", f"{prediction.mfu:.1%}",
        *(format_duration(x) for x in (b.compute_s, b.bubble_s, b.tp_s, b.pp_s, b.dp_s,
                                       b.optimizer_s)),
    )
    return table


def _alternatives_table(plans: tuple[Plan, ...]) -> Table:
    table = Table(title="Best alternatives", title_justify="left")
    for column in ("#", "layout", "µbatch", "recompute", "GPUs", "iteration", "tokens/s", "MFU",
                   "peak GB"):
        table.add_column(column, justify="right")
    for rank, plan in enumerate(plans, start=1):
        p = _prediction(plan)
        table.add_row(
            str(rank), plan.layout(), str(plan.pipelines[0].micro_batch_size),
            plan.recompute.value, str(plan.num_gpus), format_duration(p.iteration_time_s),
            f"{p.tokens_per_s:,.0f}", f"{p.mfu:.1%}", f"{p.peak_memory_bytes / GB:.1f}",
        )
    return table


def compact_ids(ids: tuple[str, ...]) -> str:
    """``('a.0:0', 'a.0:1', 'a.0:2')`` -> ``a.0:0-2``."""
    if len(ids) == 1:
        return ids[0]
    node = ids[0].rsplit(":", 1)[0]
    locals_ = [int(i.rsplit(":", 1)[1]) for i in ids]
    same_node = all(i.rsplit(":", 1)[0] == node for i in ids)
    contiguous = locals_ == list(range(locals_[0], locals_[0] + len(ids)))
    if same_node and contiguous:
        return f"{node}:{locals_[0]}-{locals_[-1]}"
    return ",".join(ids)
